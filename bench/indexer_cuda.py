"""The indexer's scores over key rows read by index: the CUDA C++ kernel's forms
(``kernels/cuda_indexer.cu``) against the shipped Triton launch, on one Hopper GPU, writing
stamped JSON.

A CSA layer at 16k tokens (ratio 4: 4096 entries a query), V4-Flash's indexer (64 heads of 128),
``T`` queries each reading its own request's bf16 keys from the pool by row index: 256 queries of
4096 entries, 256 of a 16k step's 4608-wide table (its last 512 columns padding), 64 of 4096.
Each variant's device time under CUDA graphs (interleaved rounds, median), the bytes the call
must read over the measured copy bandwidth, and each form's largest difference from the Triton
scores and from the float64 reference (relative to the row set's largest score).

    python -m bench.indexer_cuda --out bench/results/indexer_cuda_h100.json
"""

from __future__ import annotations

import argparse

import torch

from bench.indexer_select import D, ENTRIES, H, copy_bandwidth, indexer_case
from bench.runner import write_result
from bench.timing import graph_variants


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return float("inf")
    return float((a.double()[fin] - b.double()[fin]).abs().max() / b.double()[fin].abs().max())


def cases(bw: float, rounds: int) -> list:
    from v4stack.kernels import cuda_indexer as ci
    from v4stack.kernels import triton_gemm as tg

    out = []
    for T, width in ((256, ENTRIES), (256, 4608), (64, ENTRIES)):
        q, w, pool, rows = indexer_case(T, width)
        need = pool.numel() * 2 + rows.numel() * 8 + T * width * 2 + q.numel() * 2
        ref64 = torch.einsum("ths,th->ts", torch.einsum("thd,tsd->ths", q.double(),
                                                        pool.double().view(T, ENTRIES, D)).clamp(min=0), w.double())
        ref64 = torch.cat([ref64, ref64.new_full((T, width - ENTRIES), float("-inf"))], 1)
        ref64[:, ENTRIES - 3:] = float("-inf")
        variants = {"triton": None, **{f: f for f in ci.FORMS}}
        chosen = {}

        rec = graph_variants(lambda: call_form(ci, tg, q, w, pool, rows, chosen["v"]), variants,
                             lambda v: chosen.__setitem__("v", v), rounds=rounds)
        tri = tg.indexer_scores(q, w, pool, rows)
        for name, f in variants.items():
            y = call_form(ci, tg, q, w, pool, rows, f)
            rec[name]["rel_vs_triton"] = _rel(y, tri)
            rec[name]["rel_vs_float64"] = _rel(y, ref64)
            rec[name]["fraction_of_floor"] = need / bw / (rec[name]["us"] * 1e-6)
            print("indexer", T, width, name, {k: v for k, v in rec[name].items() if k != "us_rounds"}, flush=True)
        out.append({"queries": T, "entries": ENTRIES, "table_width": width, "bytes": need, "floor_us": need / bw * 1e6,
                    "variants": rec})
    return out


def call_form(ci, tg, q, w, pool, rows, form):
    return tg.indexer_scores(q, w, pool, rows) if form is None else ci.indexer_scores_rows(q, w, pool, rows, form=form)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    bw = copy_bandwidth()
    write_result(a.out, {"device_name": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw,
                         "widths": {"heads": H, "dim": D, "entries": ENTRIES}, "cases": cases(bw, a.rounds)})


if __name__ == "__main__":
    main()
