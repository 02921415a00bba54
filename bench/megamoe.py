"""MegaMoE vs the all_to_all_single baseline: latency, throughput, link bandwidth, uniform vs Zipf.

    python bench/megamoe.py [--world 2] [--tokens 1 16 128 512] [--iters 20]
    torchrun --nproc-per-node 2 bench/megamoe.py --device cuda      (one GPU per rank)

Writes bench/results/megamoe.json and bench/results/megamoe.png (CPU runs: ratios only).
"""

from __future__ import annotations

import argparse
import json

from v4stack.megamoe.bench import DEFAULTS, bench_megamoe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("world", "hidden", "inner", "experts", "topk", "iters", "warmup", "tile", "ring_tiles", "seed"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=DEFAULTS[name])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULTS["tokens"]))
    ap.add_argument("--routings", nargs="+", default=list(DEFAULTS["routings"]))
    ap.add_argument("--gemm", default=DEFAULTS["gemm"], choices=["row", "tile"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="bench/results/megamoe.json")
    a = vars(ap.parse_args())
    out = a.pop("out")
    report = bench_megamoe(out=out, **a)
    if report:
        print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
