"""Derive fast mode's kernel picks from a committed ops measurement.

``python -m bench.fast_picks [--source bench/results/ops_h200.json] [--out src/v4stack/kernels/fast_picks.json]``

For every op and measured batch M where the ops bench's fast mode ran the framework and its
invariant mode ran a project kernel, the pick is the one with the lower device time (20 calls in
one CUDA graph, ``fast_graph_s`` vs ``invariant_graph_s``): such a project kernel is row-local and
usable in either mode. Each bucket keeps both times and the source's commit, so the table says
which measurement it came from. Buckets are by the rows the op's call sees (the grouped GEMM's
rows are tokens x routed experts per token).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from v4stack.atomic import atomic_write

FRAMEWORK = {"torch", "torch_grouped_mm"}
# results' case name -> (dispatch op, project kernel name, rows per measured M)
CASES = {
    "grouped_linear": ("grouped_linear", "triton_grouped_gemm", "k"),
    "log_softmax_vocab": ("log_softmax", "triton_log_softmax", 1),
    "softmax": ("softmax", "triton_softmax", 1),
    "weighted_pool": ("weighted_pool", "triton_weighted_pool", 1),
    "moe_combine": ("moe_combine", "triton_moe_combine", 1),
    "hc_mix": ("hc_mix", "triton_hc_mix", 1),
    "attention_with_sink": ("attention_with_sink", "triton_sparse_attention", 1),
}
ROUTED_PER_TOKEN = {"flash": 6, "quarter": 6}  # bench/ops.py WIDTHS[...]["k"]


def derive(result: dict, source: str) -> dict:
    k = ROUTED_PER_TOKEN[result.get("widths", "flash")]
    ops: dict[str, dict] = {}
    for r in result["results"]:
        case = CASES.get(r["op"])
        if case is None or r.get("fast_graph_s") is None or r.get("invariant_graph_s") is None:
            continue
        op, kernel, unit = case
        fast_by = set(r["fast_served"].get(op, {}))
        inv_by = set(r["invariant_served"].get(op, {}))
        if not (fast_by <= FRAMEWORK and fast_by) or inv_by != {kernel}:
            continue  # this bucket did not time the framework against the kernel
        entry = ops.setdefault(op, {"kernel": kernel, "buckets": []})
        pick = "project" if r["invariant_graph_s"] < r["fast_graph_s"] else "framework"
        entry["buckets"].append({"M": r["M"], "rows": r["M"] * (k if unit == "k" else 1), "pick": pick,
                                 "project_graph_s": r["invariant_graph_s"], "framework_graph_s": r["fast_graph_s"],
                                 "framework": sorted(fast_by)[0]})
    for e in ops.values():
        e["buckets"].sort(key=lambda b: b["rows"])
    stamp = result.get("stamp", {})
    return {"source": source, "source_commit": stamp.get("commit"), "source_dirty": stamp.get("dirty"),
            "device": result.get("device_name"), "widths": result.get("widths"),
            "metric": "device time of 20 calls in one CUDA graph: invariant_graph_s (project kernel) vs "
                      "fast_graph_s (framework); the lower wins",
            "lookup": "a call with R rows takes the first bucket with rows >= R; "
                      "an op without buckets, or R past its last bucket, keeps its registered rule",
            "ops": ops}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.fast_picks", description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="bench/results/ops_h200.json")
    ap.add_argument("--out", default="src/v4stack/kernels/fast_picks.json")
    a = ap.parse_args(argv)
    table = derive(json.loads(Path(a.source).read_text()), a.source)
    atomic_write(a.out, (json.dumps(table, indent=1) + "\n").encode())
    for op, e in table["ops"].items():
        print(op, " ".join(f"{b['rows']}:{b['pick'][0]}" for b in e["buckets"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
