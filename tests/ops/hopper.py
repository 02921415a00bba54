"""Hopper builds for the tests: kernels of ``kernels/builds.py`` compiled to PTX in a fresh process
(without ``TRITON_INTERPRET``), and the float semantics every kernel must keep
(``triton_slices.FLOAT_SEMANTICS``): 3xTF32 only where declared, correctly rounded division and square
root everywhere."""

import os
import subprocess
import sys

TF32X3 = ("gemm_fp32_tf32x3", "hc_mix", "hc_mix_bf16_streams")


def _fresh(expr: str, names) -> dict:
    """``{n: expr(n)}`` for each kernel name, computed in a fresh process without ``TRITON_INTERPRET``
    (the kernels must be real JIT functions to compile); ``expr`` is a ``kernels.builds`` call on ``n``."""
    code = f"import json,sys; from v4stack.kernels import builds; print(json.dumps({{n: {expr} for n in sys.argv[1:]}}))"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    return json.loads(r.stdout.strip().splitlines()[-1])


def ptx(names):
    return _fresh("builds.build(n).asm['ptx']", names)


def registers(names):
    """``kernels.builds.registers`` of each name."""
    return _fresh("builds.registers(n)", names)


def check(ptx: dict):
    for name, src in ptx.items():
        assert ".entry" in src, name
        if name in TF32X3:  # 3xTF32: TF32 MMAs only, on operands split by integer masks (and.b32)
            assert "wgmma.mma_async" in src and ".tf32" in src and "and.b32" in src, name
            assert "cvt.rna.tf32" not in src, name  # no conversion of its own: the split is exact
        else:
            assert "tf32" not in src, name  # no TF32 tensor-core rounding anywhere else
        assert "div.approx" not in src and "div.full" not in src and "sqrt.approx" not in src, name
    for name, src in ptx.items():  # every bf16 GEMM tile on the tensor cores (wgmma, or mma.sync for BM < 64:
        if name.startswith("gemm_bf16"):  # bench/gemm_tiles.py keeps a tile only where its bits equal wgmma's)
            assert "wgmma.mma_async" in src or "mma.sync.aligned" in src, name
        if name.endswith("_tma"):  # operands through the tensor-memory accelerator into wgmma
            assert "cp.async.bulk.tensor" in src and "wgmma.mma_async" in src, name
