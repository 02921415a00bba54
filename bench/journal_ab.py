"""``bench journal-ab``: the journal's cost per decode step, this code against a baseline tree.

    git archive <commit> src | tar -x -C /tmp/base
    python -m bench.journal_ab --baseline /tmp/base/src [--steps 400] [--records 8]

One decode step of the rollout worker hands the journal one batch: a TOKENS record per trajectory
(JSON, ~70 bytes each). Both implementations append the same batches to journals in the same
directory, alternating step by step, so load from other work on the machine and the disk's state
fall on both alike. Two numbers per implementation: ``append`` (write + fsync, what an inline
worker waits for) and ``write`` (the batch handed to the kernel, no fsync: the journal's own CPU
cost, which is what the format changes). The baseline module is loaded from
``<baseline>/v4stack/journal.py``; the current one is ``v4stack.journal``.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.runner import write_result

import v4stack.journal as current


def _load(src: Path):
    path = src / "v4stack" / "journal.py"
    spec = importlib.util.spec_from_file_location("baseline_journal", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["baseline_journal"] = mod
    spec.loader.exec_module(mod)
    return mod


def _summary(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"mean_ms": 1e3 * statistics.fmean(s), "p50_ms": 1e3 * s[len(s) // 2],
            "p99_ms": 1e3 * s[min(len(s) - 1, int(0.99 * len(s)))], "n": len(s)}


def _batch(step: int, records: int) -> list[bytes]:
    return [json.dumps({"t": "TOKENS", "traj": f"t{i}", "off": step, "ids": [(step * 7 + i) % 256],
                        "version": 0}, separators=(",", ":"), sort_keys=True).encode() for i in range(records)]


def run(baseline: Path, steps: int = 400, records: int = 8, out: str | None = None, where: str | None = None) -> dict:
    if steps < 10 or records < 1:
        raise ValueError(f"bench journal-ab: steps must be >= 10 and records >= 1, got {steps}, {records}")
    impls = {"baseline": _load(baseline), "current": current}
    times = {k: {"append": [], "write": []} for k in impls}
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        js = {k: m.Journal(Path(tmp) / k) for k, m in impls.items()}
        for step in range(steps):
            for k in (("baseline", "current") if step % 2 == 0 else ("current", "baseline")):
                j, batch = js[k], _batch(step, records)
                t0 = time.perf_counter()
                _, end = j.write(batch)
                t1 = time.perf_counter()
                j.sync(end)
                t2 = time.perf_counter()
                times[k]["write"].append(t1 - t0)
                times[k]["append"].append(t2 - t0)
        for j in js.values():
            j.close()
    res = {"what": "journal cost of one decode step's batch (TOKENS records), baseline vs current, alternating",
           "baseline": str(baseline), "steps": steps, "records_per_step": records,
           "impls": {k: {m: _summary(v) for m, v in t.items()} for k, t in times.items()}}
    b, c = res["impls"]["baseline"], res["impls"]["current"]
    res["current_over_baseline"] = {m: {q: c[m][q] / b[m][q] for q in ("mean_ms", "p50_ms")} for m in ("append", "write")}
    if out:
        write_result(out, res)
    return res


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="bench journal-ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a src/ directory holding the baseline v4stack/journal.py")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--records", type=int, default=8)
    ap.add_argument("--dir", default=None, help="where the journals are written (default: the temp dir)")
    ap.add_argument("--out", default="bench/results/journal_ab.json")
    a = ap.parse_args(argv)
    try:
        res = run(Path(a.baseline), a.steps, a.records, a.out, a.dir)
    except ValueError as e:
        ap.error(str(e))
    for k, d in res["impls"].items():
        print(f"{k:<9} append p50 {d['append']['p50_ms']:7.3f} ms mean {d['append']['mean_ms']:7.3f}   "
              f"write p50 {d['write']['p50_ms']:7.3f} ms mean {d['write']['mean_ms']:7.3f}")
    print("current / baseline:", json.dumps(res["current_over_baseline"]), f"JSON in {a.out}")


if __name__ == "__main__":
    main()
