"""Token WAL overhead per decode step: bare engine vs rollout worker (inline / pipelined fsync).

    python bench/rollout_wal.py [--trajectories 8] [--max-tokens 32] [--rounds 2]

Writes bench/results/rollout_wal.json (see v4stack/rollout/bench.py for what is measured).
"""

import argparse
import json

from v4stack.rollout.bench import bench_wal

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/rollout_wal.json")
    a = ap.parse_args()
    res = bench_wal(a.preset, a.trajectories, a.prompt_len, a.max_tokens, a.rounds, out=a.out)
    print(json.dumps({m: {k: v for k, v in d.items() if k != "step"} | {"step_mean_ms": d["step"]["mean_ms"]}
                      for m, d in res["modes"].items()}, indent=1))
    print("tokens identical:", res["tokens_identical"], " fsync batch p50 ms:", res["fsync_append_batch"]["p50_ms"])
