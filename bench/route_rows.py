"""The MoE's routing and its rows' gather in one launch (``triton_route.moe_route_rows``) against
the two launches it replaces (``moe_route``'s kernel, then torch's ``x[tok]``), device time per call
under a CUDA graph, for each candidate tile, and whether every output is the same.

    python -m bench.route_rows --out bench/results/route_rows_h100.json

Each point: ``T`` tokens of ``k = 6`` routed slots of 8 experts plus the joined shared expert, rows
of 4096 bf16 columns (flash4's decode step).
"""

from __future__ import annotations

import argparse

import torch

# no spills in their sm_90a builds (the 64-bit addresses of a tile's loads and stores take the registers:
# 64 x 256 and 128 x 128 at 8 warps spill); the first is the shipped tile (triton_route.ROWS_TILE): 148
# registers, one 8-warp program an SM (capped at 128 it spills 88 bytes); 16 x 256 takes 108 (two an SM)
TILES = [dict(BR=32, BC=256, num_warps=8), dict(BR=16, BC=256, num_warps=8),
         dict(BR=32, BC=256, num_warps=8, maxnreg=128), dict(BR=16, BC=256, num_warps=16),
         dict(BR=16, BC=512, num_warps=8), dict(BR=64, BC=128, num_warps=8), dict(BR=128, BC=64, num_warps=8),
         dict(BR=256, BC=64, num_warps=8), dict(BR=128, BC=64, num_warps=4), dict(BR=32, BC=128, num_warps=4)]


def main(argv=None) -> None:
    from bench.runner import write_result
    from bench.timing import graph_time
    from v4stack.kernels import triton_route as tr

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/route_rows_h100.json")
    a = ap.parse_args(argv)
    rows = []
    for T in (256, 64):
        k, E, D = 6, 8, 4096
        g = torch.Generator(device="cuda").manual_seed(T)
        idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)])
        w = torch.rand(T, k, device="cuda", generator=g)
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16()

        def two():
            r = tr.moe_route(idx, w, E, joined=True)
            return (*r, x[r[3]].to(torch.bfloat16))

        want = two()
        r = {"tokens": T, "k": k, "columns": D,
             "route_us": graph_time(lambda: tr.moe_route(idx, w, E, joined=True)) * 1e6,
             "route_and_gather_us": graph_time(two) * 1e6, "tiles": []}
        for t in TILES:
            got = tr.moe_route_rows(x, idx, w, E, True, torch.bfloat16, tile=t)
            r["tiles"].append({"tile": t, "equal": all(torch.equal(p, q) for p, q in zip(got, want)),
                               "us": graph_time(lambda: tr.moe_route_rows(x, idx, w, E, True, torch.bfloat16,
                                                                          tile=t)) * 1e6})
        print(r, flush=True)
        rows.append(r)
    write_result(a.out, {"bench": "route_rows", "device_name": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
