"""On-disk prefix restore under the SWA strategies: disk bytes per token, restore latency,
recomputed tokens, end-to-end TTFT, against recomputing the prefix.

    python bench/prefix.py [--prefixes 3] [--prefix-len 232] [--strategies full,periodic:64,periodic:128,none]

Writes bench/results/prefix_cpu_tiny.json and .png (see v4stack/rollout/prefix_bench.py).
"""

import argparse
import json

from v4stack.rollout.prefix_bench import bench_prefix

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prefixes", type=int, default=3)
    ap.add_argument("--prefix-len", type=int, default=232)
    ap.add_argument("--suffix-len", type=int, default=8)
    ap.add_argument("--requests-per-prefix", type=int, default=2)
    ap.add_argument("--strategies", default="full,periodic:64,periodic:128,none")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/prefix_cpu_tiny.json")
    a = ap.parse_args()
    res = bench_prefix(a.preset, a.prefixes, a.prefix_len, a.suffix_len, a.requests_per_prefix,
                       tuple(a.strategies.split(",")), rounds=a.rounds, out=a.out)
    print(json.dumps(res["strategies"], indent=1))
