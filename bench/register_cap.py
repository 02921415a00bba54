"""Launches of one 8-warp program a row with and without ptxas's register cap (``maxnreg``).

A decode step's two coefficient finishes (``triton_mhc.finish_read_norm`` for each sublayer,
``finish_head_read_norm`` for the head) launch one program of 8 warps a row. Uncapped, their
sm_90a builds take 155 registers a thread, so one program holds an SM's 64K registers and 256 rows
run as two programs an SM in turn; at 128 (no spills) two programs fit an SM at once.
For each launch form, at each row count, the device time per call (``bench.timing.graph_time``,
``ROUNDS`` interleaved rounds, median) and whether its outputs equal the uncapped form's bit for bit
(the cap moves registers, not arithmetic). Also each build's registers, spills and programs an SM
(``kernels.builds``).

    python -m bench.register_cap --out bench/results/register_cap_h200.json
"""

from __future__ import annotations

import argparse

import torch

from bench.runner import write_result
from bench.timing import graph_variants

ROWS = (64, 132, 133, 256)
ROUNDS = 3
FORMS = {"uncapped": dict(num_warps=8), "maxnreg128": dict(num_warps=8, maxnreg=128)}


def _cases(M: int):
    """name -> a call of the fast-mode op that ends in the finish, at ``M`` rows of flash4's streams."""
    from v4stack.kernels import triton_wide as tw

    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, 4, 4096, device="cuda", generator=g).bfloat16()
    fn = torch.randn(24, 16384, device="cuda", generator=g) * 0.01
    scale, base = torch.rand(3, device="cuda", generator=g) + 0.5, torch.randn(24, device="cuda", generator=g)
    hfn = torch.randn(4, 16384, device="cuda", generator=g) / 64
    hscale, hbase = torch.rand(1, device="cuda", generator=g) + 0.5, torch.randn(4, device="cuda", generator=g)
    nw = (torch.rand(4096, device="cuda", generator=g) + 0.5).bfloat16()
    return {"read_norm": lambda: tw.hc_pre_read_norm(x, fn, scale, base, 4, 20, 1e-6, 1e-6, nw, 1e-6),
            "head_read_norm": lambda: (tw.hc_head_read_norm(x, hfn, hscale, hbase, 1e-6, 1e-6, nw, 1e-6),)}


def main(argv=None) -> None:
    from v4stack.kernels import builds
    from v4stack.kernels import triton_mhc as tm

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/register_cap_h200.json")
    a = ap.parse_args(argv)
    shipped = dict(tm.ROW_LAUNCH)

    def use(opts):
        tm.ROW_LAUNCH = opts

    out = []
    try:
        for M in ROWS:
            for name, call in _cases(M).items():
                rec = {"rows": M, "op": name, "forms": graph_variants(call, FORMS, use, rounds=ROUNDS)}
                print(rec, flush=True)
                out.append(rec)
    finally:
        tm.ROW_LAUNCH = shipped
    regs = {n: builds.registers(n) for n in ("finish_read_norm", "finish_read_norm_maxnreg128", "finish_head_read_norm")}
    for r in regs.values():
        r["programs_per_sm"] = builds.programs_per_sm(r["registers"], 8)
    write_result(a.out, {"bench": "register_cap", "device_name": torch.cuda.get_device_name(),
                         "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
                         "shipped": shipped, "forms": FORMS, "builds": regs, "cases": out})


if __name__ == "__main__":
    main()
