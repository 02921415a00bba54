"""Wider and one-warpgroup tiles of the persistent TMA grouped GEMM at flash4's batch-256 decode
shapes (9 experts - the joined shared one included - 1792 routed rows; gate / up N 2048 K 4096,
down N 4096 K 2048), outside the tile table (these tiles have no proved contract, so the dispatch
cannot take them; this measures whether one is worth proving). Each tile: its output against the
shipped tile's, bit for bit, and its time per call replayed in a CUDA graph (``bench.timing.graph_time``;
the committed H100 result, ``grouped_wide_tiles_h100_883b485.json``, is 883b485's own timer: the
fastest of five replays of a 20-call graph).

    python -m bench.grouped_wide_tiles --out bench/results/grouped_wide_tiles_h100.json
"""

from __future__ import annotations

import argparse

import torch

from bench.grouped_tiles import routed
from bench.runner import write_result
from bench.timing import time_tile
from v4stack.kernels.triton_grouped_tma import grouped_linear_tma

SHIPPED = dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4, occ=2)
TILES = [SHIPPED,
         dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=3, occ=2),
         dict(BM=64, BN=128, BK=128, num_warps=4, num_stages=2, occ=2),
         dict(BM=64, BN=256, BK=64, num_warps=4, num_stages=3, occ=1),
         dict(BM=64, BN=256, BK=64, num_warps=4, num_stages=4, occ=1),
         dict(BM=64, BN=256, BK=64, num_warps=8, num_stages=4, occ=1),
         dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, occ=1)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/grouped_wide_tiles_h100.json")
    a = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, N, K in (("gate_up", 2048, 4096), ("down", 4096, 2048)):
        x, off, _ = routed(256, 9, K, "cuda", gen, shared=True)
        w = (torch.randn(9, N, K, device="cuda") * 0.02).to(torch.bfloat16)
        ref = grouped_linear_tma(x, w, off, torch.empty(x.shape[0], N, device="cuda", dtype=x.dtype), SHIPPED)
        for t in TILES:
            y = torch.empty_like(ref)
            r = time_tile({"projection": name, "N": N, "K": K, "rows": x.shape[0], "tile": t},
                          lambda t=t: grouped_linear_tma(x, w, off, y, t), ref, "bits_equal_shipped")
            if "us" in r:
                r["tflops"] = 2 * x.shape[0] * N * K / r["us"] / 1e6
            rows.append(r)
    write_result(a.out, {"bench": "grouped_wide_tiles", "device_name": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
