"""The TileLang kernels lower and compile to sm_90a cubins with nvcc, with no GPU present.

Skips cleanly when TileLang (the optional extra ``tilelang``) or nvcc is missing.
"""

import shutil

import pytest

pytest.importorskip("tilelang")
if shutil.which("nvcc") is None:
    pytest.skip("needs nvcc", allow_module_level=True)

from v4stack.kernels import tilelang_ops as k  # noqa: E402


@pytest.mark.parametrize("name", list(k.programs(widths=((1024, 4096),))))
def test_kernel_compiles_for_hopper(name):
    art = k.lower_for(k.programs(widths=((1024, 4096),))[name])
    src = art.kernel_source
    assert "__global__" in src
    if name.startswith("gemm"):
        assert "wgmma" in src  # Hopper tensor-core path, one block per output tile
        assert "atomicAdd" not in src  # no split-K partial sums


def test_fast_math_is_off_unless_asked():
    from tilelang.transform import PassConfigKey

    assert k.pass_configs()[PassConfigKey.TL_ENABLE_FAST_MATH] is False
    assert k.pass_configs(fast_math=True)[PassConfigKey.TL_ENABLE_FAST_MATH] is True
