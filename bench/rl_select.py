"""Batch selection over the RL metadata table: time and memory at 10^4, 10^5 and 10^6 trajectories.

    python -m bench.rl_select [--sizes 10000 100000 1000000] [--repeats 5]

Each table holds synthetic trajectory records (metadata only: group of 8, lengths, reward, policy
version, state; a fifth of them already consumed) - the selector never touches heavy fields. One
selection asks for the oldest 64 complete groups at or above a minimum version under a token
budget. Reports the median selection time, the table's bytes per row, and the peak extra memory
one selection allocates (tracemalloc, numpy allocations included). Writes
bench/results/rl_select.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from pathlib import Path

import numpy as np

from bench.runner import write_result
from v4stack.rl.store import CONSUMED, MetaTable

RESULTS = Path(__file__).resolve().parent / "results"


def build(n: int, group_size: int = 8, seed: int = 0) -> MetaTable:
    rng = np.random.default_rng(seed)
    t = MetaTable(capacity=n)
    groups = np.arange(n) // group_size
    t.add_columns(n, group=groups, worker=(groups % 4).astype(np.int16),
                  prompt_len=rng.integers(10, 20, n, dtype=np.int32), gen_len=rng.integers(8, 64, n, dtype=np.int32),
                  reward=rng.integers(0, 2, n).astype(np.float32), version=(groups // 64).astype(np.int32),
                  round=(groups // 64).astype(np.int32),
                  state=np.where(groups < n // group_size // 5, CONSUMED, 0).astype(np.uint8))
    return t


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "rl_select.json"))
    args = ap.parse_args(argv)
    rows = []
    for n in args.sizes:
        t = build(n)
        min_version = int(t.col("version").max()) // 4
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            b = t.select(64, 8, min_version=min_version, max_tokens=64 * 8 * 80)
            times.append(time.perf_counter() - t0)
        tracemalloc.start()
        t.select(64, 8, min_version=min_version, max_tokens=64 * 8 * 80)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        table_bytes = sum(a[:n].nbytes for a in t.cols.values())
        rows.append({"records": n, "select_s_median": statistics.median(times), "select_s_max": max(times),
                     "selected_rows": int(len(b.rows) + len(b.flat)), "table_bytes": table_bytes,
                     "table_bytes_per_record": table_bytes / n, "select_peak_bytes": peak})
        print(f"{n:>9,} records: select {statistics.median(times) * 1e3:8.2f} ms (max {max(times) * 1e3:.2f}), "
              f"table {table_bytes / 2**20:6.1f} MiB, select peak {peak / 2**20:6.1f} MiB, "
              f"{len(b.rows) + len(b.flat)} rows picked", flush=True)
    doc = {"bench": "rl_select", "group_size": 8, "groups_per_batch": 64, "rows": rows,
           "goal": "10^6 records selected in under 1 s",
           "met": all(r["select_s_median"] < 1.0 for r in rows if r["records"] >= 1_000_000)}
    write_result(Path(args.out), doc)
    return doc


if __name__ == "__main__":
    main()
