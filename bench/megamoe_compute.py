"""Per-rank compute side of MegaMoE on one GPU (V4-Flash expert shapes, one rank of EP8):
wave-grouped GEMMs vs the same GEMMs expert by expert, and the fraction of the bf16 matmul peak.

    python bench/megamoe_compute.py [--out bench/results/megamoe_compute_h200.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from v4stack.atomic import atomic_write
from v4stack.megamoe.compute_bench import bench_compute


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512, 4096, 8192])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="bench/results/megamoe_compute_h200.json")
    a = ap.parse_args()
    report = bench_compute(tokens=a.tokens, reps=a.reps)
    atomic_write(Path(a.out), (json.dumps(report, indent=2) + "\n").encode())
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
