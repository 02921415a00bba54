"""Sandbox latency and density benchmark; writes bench/results/dsec.json.

    python bench/dsec.py [--iters 30] [--density 64] [--out bench/results/dsec.json]

Needs root and the OS packages from scripts/dsec-system-deps.sh. The same run is
``v4stack bench dsec``.
"""

from __future__ import annotations

import argparse
import json

from v4stack.dsec.bench import bench_dsec

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--density", type=int, default=64)
    ap.add_argument("--out", default="bench/results/dsec.json")
    a = ap.parse_args()
    r = bench_dsec(out=a.out, iters=a.iters, density=a.density)
    for sub, v in r["substrates"].items():
        print(sub, {k: (x["p50_ms"], x["p99_ms"]) for k, x in v.items() if "p50_ms" in x}, v["density"])
    print(f"wrote {a.out}")
