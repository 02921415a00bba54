"""Launches whose programs must fit an SM twice: a decode step's one-row-a-program finishes
(``triton_mhc.ROW_LAUNCH``) and the MoE's routing with its rows' gather (``triton_route.ROWS_TILE``),
at flash4's 256 rows more programs than a 132-SM GPU has SMs. Their sm_90a builds, as launched,
leave two 8-warp programs room in an SM's registers without spilling; the controls (the same
kernels as launched before) hold one an SM."""

import pytest

from v4stack.kernels.builds import programs_per_sm


def test_programs_per_sm_counts_a_warps_registers_in_allocation_units():
    assert programs_per_sm(128, 8) == 2  # 128 x 32 x 8 x 2 = 65536: exactly two
    assert programs_per_sm(129, 8) == 1  # 129 x 32 = 4128, allocated as 4352 a warp
    assert programs_per_sm(155, 8) == 1
    assert programs_per_sm(108, 8) == 2
    assert programs_per_sm(255, 4) == 2  # 8160 -> 8192 a warp
    assert programs_per_sm(32, 1) == 64


def test_row_programs_fit_an_sm_twice_as_launched():
    pytest.importorskip("triton")
    from tests.ops.hopper import registers
    from v4stack.kernels import triton_mhc as tm
    from v4stack.kernels import triton_route as tr

    got = registers(("finish_read_norm", "finish_head_read_norm", "moe_route_rows", "finish_read_norm_uncapped",
                     "moe_route_rows_br32"))
    warps = {"finish_read_norm": tm.ROW_LAUNCH["num_warps"], "finish_head_read_norm": tm.ROW_LAUNCH["num_warps"],
             "moe_route_rows": tr.ROWS_TILE["num_warps"]}
    for name, w in warps.items():
        assert got[name]["spill_bytes"] == 0, name
        assert programs_per_sm(got[name]["registers"], w) >= 2, (name, got[name])
    # controls: uncapped, the finish takes more than 128 registers; 32 rows a step, the gather does
    assert programs_per_sm(got["finish_read_norm_uncapped"]["registers"], 8) == 1
    assert programs_per_sm(got["moe_route_rows_br32"]["registers"], 8) == 1
