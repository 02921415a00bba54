"""The decode step's coefficient finishes in each of their forms (``triton_mhc.FINISH_FORMS``).

``finish_read_norm`` (each sublayer) and ``finish_head_read_norm`` (the head) take one program of
8 warps a row: the sum of the projection's 64 slice partials, the split (20 Sinkhorn rounds on the
row's 4 x 4 comb) and the read with its norm. Their time is the program's chain, not the bytes
(``bench/register_cap.py``). Forms: 0, the partials' tree sum (``_add_in_order``: 16 layout changes
and 31 barriers in the sm_90a build) and the split on the comb's tensor (two lane shuffles a sum);
1, the partials added in an unrolled loop (4 barriers); 2, the split in scalars (register sums,
every warp doing all 16 entries); 3, both. For each form and row count: the launch's device time
(``bench.timing.graph_time``, ``ROUNDS`` interleaved rounds, median) on partials made once, and
whether every output equals form 0's bit for bit.

    python -m bench.finish_forms --out bench/results/finish_forms_h200.json

``--device cpu`` (with ``TRITON_INTERPRET=1``) runs the same calls and checks without timing them.
"""

from __future__ import annotations

import argparse

import torch

from bench.runner import write_result
from bench.timing import graph_variants

ROWS = (1, 64, 256)
ROUNDS = 3


def _inputs(M: int, dev: str, D: int):
    from v4stack.kernels import triton_wide as tw

    g = torch.Generator(device=dev).manual_seed(M)
    x = torch.randn(M, 4, D, device=dev, generator=g).bfloat16()
    fn = torch.randn(24, 4 * D, device=dev, generator=g) * 0.01
    scale, base = torch.rand(3, device=dev, generator=g) + 0.5, torch.randn(24, device=dev, generator=g)
    nw = (torch.rand(D, device=dev, generator=g) + 0.5).bfloat16()
    p, pss, S = tw.partials(x.reshape(M, -1), fn, True)
    hp, hpss, _ = tw.partials(x.reshape(M, -1), fn[:4].contiguous(), True)
    return x, scale, base, nw, (p, pss, S), (hp, hpss)


def main(argv=None) -> None:
    from v4stack.kernels import builds
    from v4stack.kernels import triton_mhc as tm

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/finish_forms_h200.json")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    dev = a.device
    D = 4096 if dev == "cuda" else 128  # flash4's streams; a small row for the CPU check
    shipped = tm.FINISH_FORM

    def use(f):
        tm.FINISH_FORM = f

    cases = []
    try:
        for M in ROWS:
            x, scale, base, nw, (p, pss, S), (hp, hpss) = _inputs(M, dev, D)
            mix, y = torch.empty(M, 24, device=dev), torch.empty(M, D, device=dev, dtype=x.dtype)
            hmix, hy = torch.empty(M, 4, device=dev), torch.empty(M, D, device=dev, dtype=x.dtype)
            out = tm._outputs(M, 4, x.device)

            def sub():
                return tm.finish_read_norm(p, pss, S, 4 * D, mix, scale, base, out, 20, 1e-6, 1e-6, x, nw, 1e-6, y)

            def head():
                return tm.finish_head_read_norm(hp, hpss, S, 4 * D, hmix, scale[:1], base[:4], 1e-6, 1e-6, x, nw,
                                                1e-6, hy)

            for op, call, forms, outs in (("finish_read_norm", sub, tm.FINISH_FORMS, (y, mix, *out)),
                                          ("finish_head_read_norm", head, (0, 1), (hy, hmix))):
                rec = {"rows": M, "op": op,  # each form's bits_equal_first: against form 0's
                       "forms": graph_variants(call, {f: f for f in forms}, use, lambda outs=outs: outs, ROUNDS,
                                               dev == "cuda")}
                print(rec, flush=True)
                cases.append(rec)
    finally:
        tm.FINISH_FORM = shipped
    regs = {f"finish_read_norm_form{f}": builds.registers(f"finish_read_norm_form{f}") for f in tm.FINISH_FORMS} \
        if dev == "cuda" else {}
    write_result(a.out, {"bench": "finish_forms", "device_name": torch.cuda.get_device_name() if dev == "cuda" else dev,
                         "shipped": shipped, "rounds": ROUNDS, "builds": regs, "cases": cases})


if __name__ == "__main__":
    main()
