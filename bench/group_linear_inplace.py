"""Invariant mode's ``group_linear`` (V4's ``wo_a``: 8 groups, K 4096, N 1024) read in place
(``triton_grouped_tma.group_linear_tma``) against the gathered rows (``fused_gpu.group_linear_rows``:
the groups' rows copied into one grouped GEMM's layout, the result copied back): device time per call
in a CUDA graph (``bench.timing.graph_time``) and whether the bits are equal, at 256 and 64 rows, for
the shipped tile and the grouped table's others.

    python -m bench.group_linear_inplace --out bench/results/group_linear_inplace_h100.json

(The committed ``grouped_sk_h100_3dca66d.json`` is this bench's first form, which also timed a grouped
expert GEMM with a stream-K tail, since dropped: ``git show 3dca66d:bench/grouped_sk.py``.)
"""

from __future__ import annotations

import argparse

import torch

from bench.runner import write_result
from bench.timing import graph_time, time_tile
from v4stack import ops
from v4stack.kernels import triton_grouped_tma as tma
from v4stack.kernels.fused_gpu import GROUP_TILE, group_linear_rows

TILES = [GROUP_TILE, dict(GROUP_TILE, occ=1), dict(BM=64, BN=256, BK=64, num_warps=8, num_stages=4),
         dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3),
         dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=4, occ=2)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/group_linear_inplace_h100.json")
    a = ap.parse_args(argv)
    rows: list = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for T in (256, 64):
        x = torch.randn(T, 8, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(8, 1024, 4096, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        with ops.mode("invariant"):
            ref = group_linear_rows(x, w)
            r = {"rows": T, "kernel": "gathered_rows", "us": graph_time(lambda: group_linear_rows(x, w)) * 1e6}
        print(r, flush=True)
        rows.append(r)
        for t in TILES:
            rows.append(time_tile({"rows": T, "kernel": "in_place", "tile": t},
                                  lambda t=t: tma.group_linear_tma(x, w, t), ref, "bits_equal_gathered"))
    write_result(a.out, {"bench": "group_linear_inplace", "device_name": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
