"""The persistent TMA grouped GEMM at the serving engine's decode shapes under more launch shapes
than ``tiles.GROUPED_CANDIDATES`` holds: the proved tile shapes with other stage counts and more
programs an SM (``occ``), on one GPU, writing stamped JSON.

A batch-256 flash4 step's grouped calls (9 experts: 8 routed and the joined shared one, 1792 rows)
move about 0.77 GB between L2 and the SMs at the chosen 64 x 128 tile (every tile reads its rows'
and its columns' K extent), so a tile that reads fewer bytes a product, or more programs in flight
on an SM, may run nearer the matrix rate. Each variant's output is compared bit for bit with the
shipped tile's; times are device seconds per call under CUDA graphs (interleaved rounds, median).

    python -m bench.grouped_occupancy --out bench/results/grouped_occupancy_h100.json
"""

from __future__ import annotations

import argparse

import torch

from bench.grouped_tiles import routed
from bench.runner import write_result
from bench.timing import graph_variants
from v4stack.kernels import triton_grouped_tma as tma


def _t(bm, bn, bk=64, w=4, s=4, occ=1):
    return dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=s, tma=True, occ=occ)


VARIANTS = {
    "shipped_64x128_s4_o2": _t(64, 128, s=4, occ=2),
    "64x128_s3_o3": _t(64, 128, s=3, occ=3),
    "64x128_s2_o4": _t(64, 128, s=2, occ=4),
    "64x256_w8_s2_o2": _t(64, 256, w=8, s=2, occ=2),
    "64x256_w8_s3_o1": _t(64, 256, w=8, s=3, occ=1),
    "64x256_w8_s4_o1": _t(64, 256, w=8, s=4, occ=1),
    "128x128_w8_s3_o2": _t(128, 128, w=8, s=3, occ=2),
    "128x128_w8_s4_o1": _t(128, 128, w=8, s=4, occ=1),
    "64x64_s4_o3": _t(64, 64, s=4, occ=3),
}
SHAPES = (("gate_up", 2048, 4096), ("down", 4096, 2048))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/grouped_occupancy_h100.json")
    ap.add_argument("--tokens", default="256,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="", help="comma-separated names (default: all)")
    a = ap.parse_args(argv)
    names = [n for n in a.variants.split(",") if n] or list(VARIANTS)
    dev = "cuda"
    rows = []
    for tokens in map(int, a.tokens.split(",")):
        for proj, N, K in SHAPES:
            gen = torch.Generator().manual_seed(tokens * 31 + N)
            x, off, _ = routed(tokens, 9, K, dev, gen, shared=True)
            w = (torch.randn(9, N, K, device=dev) * K ** -0.5).to(torch.bfloat16)
            y = torch.empty(x.shape[0], N, dtype=x.dtype, device=dev)
            tile = {}

            def use(name):
                tile["t"] = VARIANTS[name]

            def call():
                return tma.grouped_linear_tma(x, w, off, y, tile["t"])

            ok, failed = [], {}
            for n in names:  # a launch shape the card cannot hold (shared memory) is named, not timed
                try:
                    use(n)
                    call()
                    torch.cuda.synchronize()
                    ok.append(n)
                except Exception as e:
                    failed[n] = f"{type(e).__name__}: {e}"[:300]
            rec = graph_variants(call, {n: n for n in ok}, use, rounds=a.rounds)
            flops = 2 * x.shape[0] * N * K
            row = {"tokens": tokens, "projection": proj, "N": N, "K": K, "rows": x.shape[0], "flops": flops,
                   "variants": rec, "failed": failed}
            rows.append(row)
            for n, err in failed.items():
                print(tokens, proj, n, "failed:", err, flush=True)
            for n in ok:
                r = rec[n]
                print(f"{tokens:4d} {proj:8s} {n:22s} {r['us']:7.1f} us  {flops / r['us'] / 1e6:6.1f} TFLOP/s  "
                      f"bits equal {r['bits_equal_first']}", flush=True)
    write_result(a.out, {"bench": "grouped_occupancy", "device_name": torch.cuda.get_device_name(),
                         "variants": {n: VARIANTS[n] for n in names}, "rows": rows})


if __name__ == "__main__":
    main()
