"""Derive fast mode's kernel picks from a committed ops measurement.

``python -m bench.fast_picks [--source bench/results/ops_h200.json] [--out src/v4stack/kernels/fast_picks.json]``

For every op and measured batch M where the ops bench's invariant mode ran a project kernel, the
pick is the one with the lower device time (20 calls in one CUDA graph): ``invariant_graph_s``
against the framework's own ``framework_graph_s`` (or, in measurements without it, ``fast_graph_s``
where fast mode ran the framework); such a project kernel is row-local and usable in either mode. Each bucket keeps both times and the source's commit, so the table says
which measurement it came from. Buckets are by the rows the op's call sees; the grouped GEMM's
by routed rows per expert (tokens x routed experts per token / experts, rounded up: what fills its
row tiles), so a bucket measured over 256 experts also serves a layer of 9.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from v4stack.atomic import atomic_write

FRAMEWORK = {"torch", "torch_grouped_mm"}
# results' case name -> (dispatch op, project kernel name, rows per measured M; "k/E": rows per expert)
CASES = {
    "grouped_linear": ("grouped_linear", "triton_grouped_gemm", "k/E"),
    "log_softmax_vocab": ("log_softmax", "triton_log_softmax", 1),
    "softmax": ("softmax", "triton_softmax", 1),
    "weighted_pool": ("weighted_pool", "triton_weighted_pool", 1),
    "moe_combine": ("moe_combine", "triton_moe_combine", 1),
    "hc_mix": ("hc_mix", "triton_hc_mix", 1),
    "attention_with_sink": ("attention_with_sink", "triton_sparse_attention", 1),
}
# cases of one dispatch op told apart by dtype: their table key (``gpu.py`` looks ``linear.<dtype>`` up)
CASES.update({"linear_bf16": ("linear", "triton_gemm", 1), "linear_fp32": ("linear", "triton_fp32_gemm", 1)})
TABLE_KEY = {"linear_bf16": "linear.bfloat16", "linear_fp32": "linear.float32"}
OWN_FRAMEWORK = {"grouped_linear"}  # cases whose ``framework`` is not fast mode's (a torch loop, not _grouped_mm)
ROUTED_PER_TOKEN = {"flash": 6, "quarter": 6}  # bench/ops.py WIDTHS[...]["k"]
EXPERTS = {"flash": 256, "quarter": 256}  # bench/ops_gpu_cases.py FLASH["E"]: the grouped case's experts


def bucket_rows(unit, M: int, widths: str) -> int:
    """The lookup key of a bucket measured at batch ``M`` (``gpu.py`` computes the same from a call)."""
    if unit == "k/E":
        return -(-M * ROUTED_PER_TOKEN[widths] // EXPERTS[widths])
    return M * unit


def serving_grouped(sweep: dict, source: str) -> list:
    """Grouped-GEMM buckets from a ``bench.grouped_tiles --serving`` sweep (the engine's decode
    calls, 9 / 65 experts): per rows-per-expert value, the best bit-identical tile against
    ``torch._grouped_mm``, device time under graphs of one MoE layer's calls."""
    from bench.grouped_tiles import best_tiles, serving_costs

    fw = serving_costs(sweep)
    out = []
    for r, (tile, s) in best_tiles(sweep, fw).items():
        f = fw[r]["framework"]
        out.append({"rows": r, "pick": "project" if s < f else "framework", "project_graph_s": s,
                    "framework_graph_s": f, "framework": "torch_grouped_mm", "tile": tile, "from": source,
                    "from_commit": sweep.get("stamp", {}).get("commit")})
    return out


def derive(result: dict, source: str, previous: dict | None = None, grouped: list | None = None) -> dict:
    """The picks from ``result``; a bucket it cannot re-derive (fast mode already ran the kernel and the
    framework could not be timed alone, or the op was not measured) is kept from ``previous``, marked
    ``carried_from`` with the commit it was measured at."""
    widths = result.get("widths", "flash")
    units = {TABLE_KEY.get(name, c[0]): c[2] for name, c in CASES.items()}
    ops: dict[str, dict] = {}
    for r in result["results"]:
        case = CASES.get(r["op"])
        if case is None or r.get("fast_graph_s") is None or r.get("invariant_graph_s") is None:
            continue
        op, kernel, unit = case
        fast_by = set(r["fast_served"].get(op, {}))
        inv_by = set(r["invariant_served"].get(op, {}))
        if fast_by <= FRAMEWORK and fast_by:
            fw_s = r["fast_graph_s"]  # fast mode ran the framework
        else:  # fast mode ran the kernel (an earlier pick): the framework timed by itself, where it is fast's
            fw_s = r.get("framework_graph_s") if r["op"] not in OWN_FRAMEWORK else None
        if fw_s is None or inv_by != {kernel}:
            continue  # this bucket did not time the framework against the kernel
        entry = ops.setdefault(TABLE_KEY.get(r["op"], op), {"kernel": kernel, "buckets": []})
        pick = "project" if r["invariant_graph_s"] < fw_s else "framework"
        entry["buckets"].append({"M": r["M"], "rows": bucket_rows(unit, r["M"], widths), "pick": pick,
                                 "project_graph_s": r["invariant_graph_s"], "framework_graph_s": fw_s,
                                 "framework": sorted(fast_by)[0] if fast_by <= FRAMEWORK and fast_by else "torch"})
    for key, e in (previous or {}).get("ops", {}).items():  # what this measurement could not re-derive
        have = {b["M"] for b in ops.get(key, {}).get("buckets", [])}
        kept = [{**b, "rows": bucket_rows(units.get(key, 1), b["M"], widths),  # in this table's units
                 "carried_from": b.get("carried_from") or previous.get("source_commit")}
                for b in e["buckets"] if "M" in b and b["M"] not in have]  # (no M: a serving-sweep bucket)
        if kept:
            ops.setdefault(key, {"kernel": e["kernel"], "buckets": []})["buckets"].extend(kept)
    if grouped:  # the serving sweep's rows-per-expert values; a value both measured: the sweep's
        e = ops.setdefault("grouped_linear", {"kernel": "triton_grouped_gemm", "buckets": []})
        mine = {b["rows"] for b in grouped}
        e["buckets"] = [b for b in e["buckets"] if b["rows"] not in mine] + grouped
    for e in ops.values():
        e["buckets"].sort(key=lambda b: b["rows"])
    stamp = result.get("stamp", {})
    return {"source": source, "source_commit": stamp.get("commit"), "source_dirty": stamp.get("dirty"),
            "device": result.get("device_name"), "widths": result.get("widths"),
            "metric": "device time of 20 calls in one CUDA graph: invariant_graph_s (project kernel) vs "
                      "fast_graph_s (framework); the lower wins",
            "lookup": "a call with R rows takes the first bucket with rows >= R (grouped_linear: R is routed "
                      "rows per expert, rounded up); an op without buckets, or R past its last bucket, keeps "
                      "its registered rule",
            "ops": ops}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.fast_picks", description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="bench/results/ops_h200.json")
    ap.add_argument("--out", default="src/v4stack/kernels/fast_picks.json")
    ap.add_argument("--previous", default="src/v4stack/kernels/fast_picks.json",
                    help="the table whose buckets are kept where the source cannot re-derive them ('' for none)")
    ap.add_argument("--grouped-source", default="bench/results/grouped_serving_h200.json",
                    help="a bench.grouped_tiles --serving sweep whose decode calls add grouped buckets ('' for none)")
    a = ap.parse_args(argv)
    prev = json.loads(Path(a.previous).read_text()) if a.previous and Path(a.previous).exists() else None
    gs = a.grouped_source
    grouped = serving_grouped(json.loads(Path(gs).read_text()), gs) if gs and Path(gs).exists() else None
    table = derive(json.loads(Path(a.source).read_text()), a.source, prev, grouped)
    atomic_write(a.out, (json.dumps(table, indent=1) + "\n").encode())
    for op, e in table["ops"].items():
        print(op, " ".join(f"{b['rows']}:{b['pick'][0]}" for b in e["buckets"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
