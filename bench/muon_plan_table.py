"""The Muon ownership plan of V4-Flash and V4-Pro over a grid of (dp, pp), ep fixed per preset.

    python -m bench.muon_plan_table [--markdown]

Writes bench/results/muon_plan_table.json; ``--markdown`` also prints the table used in
docs/training.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.runner import write_result
from v4stack.config import preset
from v4stack.optim.plan import DEFAULTS, model_items, plan_from_items

RESULTS = Path(__file__).resolve().parent / "results"
GRID = {"dp": [32, 64, 96, 128, 144, 192, 256], "pp": [4, 8, 16]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    rows = []
    for name in ("flash", "pro"):
        cfg = preset(name)
        items = model_items(cfg)
        ep = DEFAULTS[name]["ep"]
        for pp in GRID["pp"]:
            for dp in GRID["dp"]:
                if dp % ep:
                    continue
                p = plan_from_items(items, cfg, dp, pp, ep)
                rows.append({
                    "preset": name, "dp": dp, "pp": pp, "ep": ep, "feasible": p["feasible"],
                    "padding": p["padding"], "max_matrices_per_rank": p["max_matrices_per_rank"],
                    "dense_padding": p["dense"].get("padding"), "expert_padding": p["expert"].get("padding"),
                    "dense_groups": sorted(set(p["dense"].get("zero_group_size") or [])),
                    "expert_groups": sorted(set(p["expert"].get("zero_group_size") or [])),
                    "dense_items_per_stage": p["dense"]["max_items_per_stage"],
                    "meets_claim": p["meets_claim"],
                    "why_not": None if p["feasible"] else (p["dense"].get("reason") or p["expert"].get("reason")),
                })
    doc = {"bench": "muon_plan_table", "cap": 5, "target_padding": 0.10, "defaults": DEFAULTS, "rows": rows,
           "command": "python -m bench.muon_plan_table"}
    write_result(Path(args.out) / "muon_plan_table.json", doc)
    if args.markdown:
        print("| preset | dp | pp | ep | padding (dense / expert) | max per rank | dense group sizes | meets |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            if not r["feasible"]:
                pad = "infeasible (cap)"
                per = "-"
            else:
                pad = f"{100 * r['padding']:.1f}% ({100 * r['dense_padding']:.1f} / {100 * r['expert_padding']:.1f})"
                per = str(r["max_matrices_per_rank"])
            groups = "/".join(map(str, r["dense_groups"])) or "-"
            print(f"| {r['preset']} | {r['dp']} | {r['pp']} | {r['ep']} | {pad} | {per} | {groups} | "
                  f"{'yes' if r['meets_claim'] else 'no'} |")


if __name__ == "__main__":
    main()
