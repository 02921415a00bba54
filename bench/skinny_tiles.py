"""fp32 GEMMs with a narrow output (the MoE gate's logits: N = experts) on one GPU, writing stamped
JSON: every fp32 candidate tile at M x N x 4096 (N = 8 and 64 - flash4's and flash8's experts; M =
1..4096 rows), its device time under CUDA graphs and whether its output equals, bit for bit, the
tile that M's ``F32_TILES`` bucket holds; beside it the ``F32_SKINNY_TILES`` pick that ``linear``
now takes, and torch's fp32 GEMM (TF32 off).

    python -m bench.skinny_tiles --out bench/results/skinny_tiles_h200.json
"""

from __future__ import annotations

import argparse

import torch

from bench.runner import write_result
from bench.timing import graph_time
from v4stack.kernels import triton_gemm as tg
from v4stack.kernels.tiles import F32_CANDIDATES, F32_SKINNY_TILES, F32_TILES, pick


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench skinny-tiles", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/skinny_tiles_h200.json")
    ap.add_argument("--ms", default="1,16,64,256,1024,4096")
    ap.add_argument("--ns", default="8,64")
    ap.add_argument("--k", type=int, default=4096)
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for N in map(int, a.ns.split(",")):
        for M in map(int, a.ms.split(",")):
            x = torch.randn(M, a.k, device="cuda")
            w = torch.randn(N, a.k, device="cuda")
            own = pick(F32_TILES, M)
            ref = tg.linear(x, w, tile=own)
            cands = []
            for i, c in enumerate(F32_CANDIDATES):
                y = tg.linear(x, w, tile=c)
                cands.append(dict(i=i, tile=c, graph_us=graph_time(lambda: tg.linear(x, w, tile=c)) * 1e6,
                                  bits_equal_bucket_tile=bool(torch.equal(y, ref))))
            row = dict(M=M, N=N, K=a.k, bucket_tile=own, candidates=cands,
                       bucket_tile_us=graph_time(lambda: tg.linear(x, w, tile=own)) * 1e6,
                       skinny_tile=pick(F32_SKINNY_TILES, M),
                       linear_us=graph_time(lambda: tg.linear(x, w)) * 1e6,
                       linear_bits_equal=bool(torch.equal(tg.linear(x, w), ref)),
                       torch_us=graph_time(lambda: x @ w.T) * 1e6)
            best = min(cands, key=lambda c: c["graph_us"])
            row["best"] = dict(i=best["i"], graph_us=best["graph_us"])
            rows.append(row)
            print(f"M {M:>5} N {N:>3}: bucket tile {row['bucket_tile_us']:7.2f} us, linear {row['linear_us']:7.2f} us "
                  f"(bits equal {row['linear_bits_equal']}), best candidate {best['i']} {best['graph_us']:7.2f} us, "
                  f"torch {row['torch_us']:7.2f} us", flush=True)
            write_result(a.out, {"rows": rows, "device_name": torch.cuda.get_device_name()})


if __name__ == "__main__":
    main()
