"""The MoE combine (``triton_route.unsort_kernel``) against its former loop form, device time per
call under a CUDA graph, and whether the two give the same bits.

    python -m bench.unsort_rows --out bench/results/unsort_rows_h100.json

The former form loaded each slot's sorted row inside a loop over ``k`` (one row load after
another); the kernel now loads every slot's row index at once and unrolls the slots, so the row
loads are in flight together, with the same adds in the same order. Each point: ``T`` tokens of
``k = 6`` routed slots of 8 experts plus the joined shared expert, 4096 columns (flash4's decode
step).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import launch, next_pow2
from v4stack.kernels.triton_route import combine_ranks


@triton.jit
def unsort_loop_kernel(O, RANK, IDX, Y, k, D, s_o, s_y, BK: tl.constexpr, BD: tl.constexpr):
    """The former form (joined shared expert, no separate shared rows): a slot's row loaded in turn."""
    pdl_enter()
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = d < D
    j = tl.arange(0, BK)
    srt, k = combine_ranks(IDX, n, k, j, True)
    acc = tl.zeros([BD], tl.float32)
    for r in range(0, k):
        slot = tl.sum(tl.where((srt == r) & (j < k), j, 0), 0)
        row = tl.load(RANK + n * k + slot)
        acc += tl.load(O + row * s_o + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(Y + n * s_y + d, acc.to(Y.dtype.element_ty, fp_downcast_rounding="rtne"), mask=dm)


def unsort_loop(out, rank, indices):
    T, k = indices.shape
    D = out.shape[1]
    y = torch.empty(T, D, dtype=out.dtype, device=out.device)
    bd = min(1024, next_pow2(D))
    launch(unsort_loop_kernel, (T, -(-D // bd)), out, rank, indices, y, k, D, out.stride(0), y.stride(0),
           BK=max(2, next_pow2(k + 1)), BD=bd, num_warps=4)
    return y


def main(argv=None) -> None:
    from bench.runner import write_result
    from bench.timing import graph_time
    from v4stack.kernels import triton_route as tr

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/unsort_rows_h100.json")
    a = ap.parse_args(argv)
    rows = []
    for T in (256, 64, 16):
        k, E, D = 6, 8, 4096
        g = torch.Generator(device="cuda").manual_seed(T)
        idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)])
        w = torch.rand(T, k, device="cuda", generator=g)
        _, _, rank, _, _ = tr.moe_route(idx, w, E, joined=True)
        o = torch.randn(T * (k + 1), D, device="cuda", generator=g).bfloat16()
        now = tr.moe_unsort_combine(o, rank, idx, None, torch.bfloat16, joined=True)
        old = unsort_loop(o, rank, idx)
        r = {"tokens": T, "k": k, "columns": D, "bits_equal": bool(torch.equal(now, old)),
             "loop_us": graph_time(lambda: unsort_loop(o, rank, idx)) * 1e6,
             "unrolled_us": graph_time(lambda: tr.moe_unsort_combine(o, rank, idx, None, torch.bfloat16,
                                                                     joined=True)) * 1e6}
        print(r, flush=True)
        rows.append(r)
    write_result(a.out, {"bench": "unsort_rows", "device_name": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
