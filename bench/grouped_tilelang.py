"""The grouped expert GEMM at serving shapes: TileLang's bulk-copy pipeline against the Triton kernel
fast mode runs, bit for bit and in device time under a CUDA graph.

    python -m bench.grouped_tilelang --out bench/results/grouped_tilelang_h200.json

Shapes: flash4 (8 routed experts, top-6, plus the shared expert as a ninth group) and flash8 (64 + 1)
at 64 and 256 tokens, the gate / up projection (N 2048, K 4096) and the down one (N 4096, K 2048).
Routing: each token's 6 experts drawn uniformly without repeats (seeded). ``triton_s``: the call
fast mode's dispatch makes (``ops.grouped_linear``); each TileLang tile: its time, and whether its
rows equal the Triton kernel's bits.
"""

from __future__ import annotations

import argparse

import torch

from bench.decode_kernels import graph_time
from bench.runner import write_result

TILES = (dict(BM=64, BN=256, BK=64, stages=4, threads=128), dict(BM=64, BN=256, BK=64, stages=3, threads=128),
         dict(BM=64, BN=128, BK=64, stages=4, threads=128), dict(BM=64, BN=128, BK=64, stages=6, threads=128),
         dict(BM=128, BN=256, BK=64, stages=3, threads=256), dict(BM=128, BN=128, BK=64, stages=4, threads=256))
SHAPES = ((2048, 4096), (4096, 2048))


def routing(tokens: int, routed: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    picks = torch.stack([torch.randperm(routed, generator=g)[:k] for _ in range(tokens)])
    counts = torch.bincount(picks.flatten(), minlength=routed).tolist() + [tokens]  # the shared expert last
    off = torch.tensor([0] + counts).cumsum(0)
    return off


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="64,256")
    ap.add_argument("--experts", default="8,64")
    ap.add_argument("--out", default="bench/results/grouped_tilelang_h200.json")
    a = ap.parse_args(argv)
    from v4stack import ops
    from v4stack.kernels import tilelang_grouped as tlg

    res = []
    for routed in map(int, a.experts.split(",")):
        for T in map(int, a.tokens.split(",")):
            off = routing(T, routed, 6, seed=T + routed).cuda()
            rows = int(off[-1])
            for N, K in SHAPES:
                g = torch.Generator(device="cuda").manual_seed(N + K)
                x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
                w = (torch.randn(routed + 1, N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
                with ops.mode("fast"):
                    ops.reset_counters()
                    ref = ops.grouped_linear(x, w, off)
                    served = dict(ops.counters().get("grouped_linear", {}))
                    t_ref = graph_time(lambda: ops.grouped_linear(x, w, off))
                flops = 2 * rows * N * K
                row = {"experts": routed + 1, "tokens": T, "rows": rows, "N": N, "K": K, "triton_s": t_ref,
                       "triton_served": served, "triton_TFLOPs": flops / t_ref / 1e12, "tiles": []}
                print(f"E={routed + 1:3d} T={T:4d} rows={rows:5d} N={N} K={K}: triton {t_ref * 1e6:7.1f} us "
                      f"({flops / t_ref / 1e12:.0f} TFLOP/s)", flush=True)
                for tile in TILES:
                    try:
                        y = tlg.grouped_linear(x, w, off, tile=tile)
                        t = graph_time(lambda tile=tile: tlg.grouped_linear(x, w, off, tile=tile))
                        same = bool(torch.equal(y, ref))
                        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                        row["tiles"].append({"tile": tile, "s": t, "TFLOPs": flops / t / 1e12, "bits_equal_triton": same,
                                             "rel_diff": err})
                        print(f"    {tile}: {t * 1e6:7.1f} us ({flops / t / 1e12:.0f} TFLOP/s) bits equal {same} "
                              f"rel {err:.1e}", flush=True)
                    except Exception as e:  # noqa: BLE001
                        row["tiles"].append({"tile": tile, "error": repr(e)[:300]})
                        print(f"    {tile}: ERROR {repr(e)[:300]}", flush=True)
                res.append(row)
    write_result(a.out, {"shapes": res})


if __name__ == "__main__":
    main()
