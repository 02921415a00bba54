"""Two grouped GEMMs of a decode step on Hopper, each against what the engine ran before:

- fast mode's grouped expert GEMM (``kernels/triton_grouped_sk.py``: whole rounds of wide tiles and
  a stream-K tail) against the shipped persistent TMA tile, at flash4's shapes (9 experts with the
  joined shared one; gate / up N 2048 K 4096, down N 4096 K 2048) for batch 128 and 256: device
  time per call in a CUDA graph (``bench.timing.graph_time``), the largest difference from the
  shipped tile relative to its largest value, and the share of rows with the shipped tile's bits;
- invariant mode's ``group_linear`` (``wo_a``: 8 groups, K 4096, N 1024) read in place
  (``triton_grouped_tma.group_linear_tma``) against the gathered rows (``group_linear_rows``):
  time per call and whether the bits are equal, at batch 64 / 256.

    python -m bench.grouped_sk --out bench/results/grouped_sk_h100.json
"""

from __future__ import annotations

import argparse

import torch

from bench.grouped_tiles import routed
from bench.runner import write_result
from bench.timing import graph_time
from v4stack import ops
from v4stack.kernels import triton_grouped_sk as sk
from v4stack.kernels import triton_grouped_tma as tma
from v4stack.kernels.fused_gpu import group_linear_rows

SHIPPED = dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4, occ=2)
SK = [dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, RC=16),
      dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=4, RC=16),
      dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=4, RC=32),
      dict(BM=128, BN=128, BK=64, num_warps=4, num_stages=4, RC=32),
      dict(BM=64, BN=256, BK=64, num_warps=4, num_stages=4, RC=16)]
GROUP = [SHIPPED, dict(SHIPPED, occ=1), dict(BM=64, BN=256, BK=64, num_warps=8, num_stages=4),
         dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3), dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=4,
                                                                      occ=2)]


def _grouped(rows: list, batches=(256, 128), tiles=None) -> None:
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        for name, N, K in (("gate_up", 2048, 4096), ("down", 4096, 2048)):
            x, off, _ = routed(batch, 9, K, "cuda", gen, shared=True)
            w = (torch.randn(9, N, K, device="cuda") * 0.02).to(torch.bfloat16)
            out = torch.empty(x.shape[0], N, device="cuda", dtype=x.dtype)
            ref = tma.grouped_linear_tma(x, w, off, out.clone(), SHIPPED)
            base = {"part": "grouped", "batch": batch, "projection": name, "N": N, "K": K, "rows": x.shape[0],
                    "experts_rows": torch.diff(off).tolist()}
            r = dict(base, kernel="tma", tile=SHIPPED,
                     us=graph_time(lambda: tma.grouped_linear_tma(x, w, off, out, SHIPPED)) * 1e6)
            print(r, flush=True)
            rows.append(r)
            for t in (tiles or SK):
                r = dict(base, kernel="sk", tile=t)
                try:
                    y = sk.grouped_linear_sk(x, w, off, out.clone(), t)
                    torch.cuda.synchronize()
                    r["max_rel_diff"] = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
                    r["rows_bit_equal"] = float((y == ref).all(dim=1).float().mean())
                    r["same_again"] = bool(torch.equal(sk.grouped_linear_sk(x, w, off, out.clone(), t), y))
                    r["us"] = graph_time(lambda: sk.grouped_linear_sk(x, w, off, out, t)) * 1e6
                except Exception as e:  # noqa: BLE001  (a tile this GPU cannot build: recorded)
                    r["error"] = repr(e)[:300]
                print(r, flush=True)
                rows.append(r)


def _group(rows: list) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    for T in (256, 64):
        x = torch.randn(T, 8, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(8, 1024, 4096, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        with ops.mode("invariant"):
            ref = group_linear_rows(x, w)
            r = {"part": "group_linear", "rows": T, "kernel": "gathered_rows",
                 "us": graph_time(lambda: group_linear_rows(x, w)) * 1e6}
        print(r, flush=True)
        rows.append(r)
        for t in GROUP:
            r = {"part": "group_linear", "rows": T, "kernel": "in_place", "tile": t}
            try:
                y = tma.group_linear_tma(x, w, t)
                torch.cuda.synchronize()
                r["bits_equal_gathered"] = bool(torch.equal(y, ref))
                r["us"] = graph_time(lambda: tma.group_linear_tma(x, w, t)) * 1e6
            except Exception as e:  # noqa: BLE001
                r["error"] = repr(e)[:300]
            print(r, flush=True)
            rows.append(r)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/grouped_sk_h100.json")
    ap.add_argument("--parts", default="grouped,group_linear")
    ap.add_argument("--batches", default="256,128")
    ap.add_argument("--sk", default="", help="indices into SK to time (default: all)")
    a = ap.parse_args(argv)
    rows: list = []
    if "grouped" in a.parts:
        _grouped(rows, tuple(int(b) for b in a.batches.split(",")),
                 [SK[int(i)] for i in a.sk.split(",")] if a.sk else None)
    if "group_linear" in a.parts:
        _group(rows)
    write_result(a.out, {"bench": "grouped_sk", "device_name": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
