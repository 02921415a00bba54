"""The indexer's scores and its top-k at a decode step's widths (one H200 call).

A CSA layer at 16k tokens (ratio 4: 4096 entries a query), V4-Flash's indexer (64 heads of 128,
top-512), ``T`` queries each reading its own request's keys from the pool by row index (bf16, as
the engine holds them). ``indexer``: ``triton_gemm.indexer_scores`` for every candidate tile, its
scores compared bit for bit with the current tile's and timed under CUDA graphs, beside the
bytes the call must read over the measured copy bandwidth. ``topk``: ``triton_select.topk_rows``,
its rows compared with the torch composition in every form (one or two bits a pass, a row in
one block or two). (A radix-select form of the top-k, a 256-bin
histogram a byte, measured 40 / 21 us against the bitwise search's 18 / 14 at 8509bec:
``bench/results/indexer_select_h200.json``. A software-pipelined chunk loop - the query loaded once
a program, each chunk's key rows requested by ``cp.async`` while earlier chunks were scored, no
branch a chunk - measured 100-117 us against the shipped launch's 102 / 105 at 4096 / 4608
entries (``bench/results/indexer_select_h200_b171000.json``) and was taken back out.)

    python -m bench.indexer_select --out bench/results/indexer_select_h200.json
"""

from __future__ import annotations

import argparse
import traceback

import torch

from bench.runner import write_result
from bench.timing import graph_time

H, D, TOPK = 64, 128, 512
ENTRIES = 4096
TILES = [
    {"BS": 64, "CH": 1, "num_warps": 4, "num_stages": 3},
    {"BS": 128, "CH": 1, "num_warps": 4, "num_stages": 3},
    {"BS": 128, "CH": 1, "num_warps": 8, "num_stages": 3},
    {"BS": 256, "CH": 1, "num_warps": 8, "num_stages": 3},
    {"BS": 64, "CH": 4, "num_warps": 4, "num_stages": 3},
    {"BS": 64, "CH": 8, "num_warps": 4, "num_stages": 4},
    {"BS": 128, "CH": 2, "num_warps": 4, "num_stages": 3},
    {"BS": 128, "CH": 4, "num_warps": 8, "num_stages": 3},
    {"BS": 128, "CH": 4, "num_warps": 4, "num_stages": 2},
    {"BS": 64, "CH": 2, "num_warps": 4, "num_stages": 2},
]


def copy_bandwidth() -> float:
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / graph_time(lambda: b.copy_(a), reps=10)


def indexer_case(T: int, width: int):
    """``T`` queries, their head weights, a bf16 pool of ``T * ENTRIES`` keys and each query's table
    of ``width`` columns: its own ``ENTRIES`` rows (the last three not yet closed: -1), then -1."""
    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(T, H, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(T, H, device="cuda", generator=g) / 64).bfloat16()
    pool = torch.randn(T * ENTRIES, D, device="cuda", generator=g).bfloat16()
    rows = torch.full((T, width), -1, dtype=torch.long, device="cuda")
    rows[:, :ENTRIES] = torch.arange(T * ENTRIES, device="cuda").view(T, ENTRIES)
    rows[:, ENTRIES - 3:] = -1  # entries not yet closed
    return q, w, pool, rows


def indexer_cases(bw: float) -> list:
    from v4stack.kernels import triton_gemm as tg

    out = []
    # (a 16k step's table is 4608 entries wide: its last 512 are padding, whole programs of no entry)
    for T, width in ((256, ENTRIES), (256, 4608), (64, ENTRIES)):
        q, w, pool, rows = indexer_case(T, width)
        ref = tg.indexer_scores(q, w, pool, rows, tile=TILES[0])
        need = pool.numel() * 2 + rows.numel() * 8 + ref.numel() * 2 + q.numel() * 2
        case = {"queries": T, "entries": ENTRIES, "table_width": width, "bytes": need, "floor_s": need / bw,
                "tiles": []}
        for t in TILES:
            rec = {"tile": t}
            try:
                y = tg.indexer_scores(q, w, pool, rows, tile=t)
                rec["bits_equal_first"] = bool(torch.equal(y, ref))
                rec["max_abs_diff_first"] = float((y.float() - ref.float()).abs().max())
                rec["graph_s"] = graph_time(lambda: tg.indexer_scores(q, w, pool, rows, tile=t))
                rec["fraction_of_floor"] = case["floor_s"] / rec["graph_s"]
            except Exception:  # noqa: BLE001
                rec["error"] = traceback.format_exc()[-800:]
            print("indexer", T, t, {k: v for k, v in rec.items() if k != "tile"}, flush=True)
            case["tiles"].append(rec)
        out.append(case)
    return out


# the shipped form first (its bf16 keys without their 16 constant low bits: 16 passes), then the
# same search over all 32 bits (the form shipped before) and the others
TOPK_FORMS = [{"BITS": 1, "SPLIT": True, "SHIFT": True}, {"BITS": 1, "SPLIT": True},
              {"BITS": 2, "SPLIT": True, "SHIFT": True}, {"BITS": 1}, {"BITS": 2}, {"BITS": 2, "SPLIT": True},
              {"BITS": 1, "SPLIT": True, "num_warps": 4}, {"BITS": 1, "SPLIT": True, "num_warps": 16},
              {"BITS": 1, "num_warps": 8}, {"BITS": 2, "num_warps": 8}, {"BITS": 2, "num_warps": 16}]


def topk_cases() -> list:
    """The shipped search (one bit a pass over the scores' significant bits, a row past a power of
    two in two blocks) against all 32 bits of the widened scores, the row in one block, two bits a
    pass and other warps, at 4096 entries and at a 16k step's table width (4608: 144 blocks of 32
    entries, the last 512 padding)."""
    from v4stack.kernels import triton_select as ts
    from v4stack.ops import fused

    out = []
    for T, E, live in ((256, 4096, 4093), (256, 4608, 4100), (64, 4096, 4093)):
        g = torch.Generator(device="cuda").manual_seed(T + E)
        s = torch.randn(T, E, device="cuda", generator=g).bfloat16()  # the indexer's scores: ties
        rows = torch.arange(T * E, device="cuda").view(T, E)
        rows[:, live:] = -1
        want = fused.topk_rows_reference(s.cpu(), rows.cpu(), TOPK).cuda()
        case = {"queries": T, "entries": E, "live_entries": live, "k": TOPK, "scores": "bfloat16", "forms": []}
        for form in TOPK_FORMS:
            rec = {"form": form}
            try:
                got = ts.topk_rows(s, rows, TOPK, tile=form)
                rec["equal_composition"] = bool(torch.equal(got, want))
                rec["graph_s"] = graph_time(lambda: ts.topk_rows(s, rows, TOPK, tile=form))
            except Exception:  # noqa: BLE001
                rec["error"] = traceback.format_exc()[-800:]
            print("topk", T, E, rec, flush=True)
            case["forms"].append(rec)
        out.append(case)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--topk-only", action="store_true", help="only the top-k's forms (the indexer's tiles skipped)")
    a = ap.parse_args(argv)
    bw = copy_bandwidth()
    write_result(a.out, {"device_name": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw,
                         "widths": {"heads": H, "dim": D, "topk": TOPK, "entries": ENTRIES},
                         "indexer": [] if a.topk_only else indexer_cases(bw), "topk": topk_cases()})


if __name__ == "__main__":
    main()
