"""``kernels.builds.programs_per_sm``: how many programs of a launch an SM's registers hold at once
(``bench/register_cap.py`` records it for the builds it times)."""

import pytest

from v4stack.kernels.builds import programs_per_sm


def test_programs_per_sm_counts_a_warps_registers_in_allocation_units():
    assert programs_per_sm(128, 8) == 2  # 128 x 32 x 8 x 2 = 65536: exactly two
    assert programs_per_sm(129, 8) == 1  # 129 x 32 = 4128, allocated as 4352 a warp
    assert programs_per_sm(155, 8) == 1
    assert programs_per_sm(108, 8) == 2
    assert programs_per_sm(255, 4) == 2  # 8160 -> 8192 a warp
    assert programs_per_sm(32, 1) == 64


def test_the_register_cap_reaches_the_build():
    """``maxnreg`` (a launch option, ``launch.OPTIONS``) caps the sm_90a build: the finish takes 155
    registers uncapped and 128 capped, without spills."""
    pytest.importorskip("triton")
    from tests.ops.hopper import registers

    got = registers(("finish_read_norm", "finish_read_norm_maxnreg128"))
    assert got["finish_read_norm"]["registers"] > 128 and programs_per_sm(got["finish_read_norm"]["registers"], 8) == 1
    assert got["finish_read_norm_maxnreg128"] == dict(got["finish_read_norm_maxnreg128"], registers=128, spill_bytes=0)
