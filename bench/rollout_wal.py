"""``bench wal``: what the token WAL costs per decode step.

The same trajectories (seeded sampling) are decoded three ways - the bare engine, the rollout
worker with the fsync inline (``pipeline=False``), and with the fsync overlapped with the next
decode step (``pipeline=True``) - and each step's wall time is recorded, split into the engine step
and the WAL's time on the critical path (record building, write, and the wait for the fsync).
The rounds interleave the modes so load from other work on the machine falls on all of them. A
plain journal microbench gives the fsync latency of the disk for a batch of TOKENS records. The
tokens of all modes must be equal; the JSON says so.

The WAL's cost is ``wal_on_critical_path`` (measured directly, per step). The difference of step
medians against the bare engine is reported too, but on a shared machine it is mostly the noise
of other work, not the WAL.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.runner import write_result

from v4stack.config import preset
from v4stack.journal import Journal
from v4stack.model import V4Model
from v4stack.rollout import records as R
from v4stack.rollout.wal import TokenWAL
from v4stack.rollout.worker import RolloutWorker
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _summary(xs: list[float]) -> dict:
    return {"mean_ms": 1e3 * statistics.fmean(xs), "p50_ms": 1e3 * _pct(xs, 0.5), "p99_ms": 1e3 * _pct(xs, 0.99),
            "n": len(xs)}


def _workload(n: int, prompt_len: int, max_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(f"t{i}", torch.randint(1, 256, (prompt_len,), generator=g).tolist(),
             SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed + i)) for i in range(n)]


def _run(model, work, mode: str, root: Path, engine_cfg: EngineConfig):
    engine = Engine(model, engine_cfg)
    toks: dict[str, list[int]] = {}
    steps, wal_s = [], []
    if mode == "none":
        for tid, p, sp in work:
            engine.add_request(p, sp, tid, lambda r, t, f: toks.setdefault(r.id, []).extend(t))
        while engine.has_work():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        return toks, steps, [0.0] * len(steps), {}
    w = RolloutWorker(engine, TokenWAL(root / mode), lambda e: toks.setdefault(e.traj, []).extend(e.ids),
                      pipeline=mode == "pipeline")
    for tid, p, sp in work:
        w.submit(tid, p, sp)
    w.run()
    w.close()
    s = w.stats
    steps = [a + b for a, b in zip(s.step_s, s.wal_s)]
    wal_bytes = sum(p.stat().st_size for p in (root / mode).glob("seg-*.log"))
    return toks, steps, s.wal_s, {"records": s.records, "wal_bytes": wal_bytes}


def _fsync_micro(root: Path, batch: int, n: int = 200) -> dict:
    recs = [R.encode(R.tokens(f"t{i}", 100, [17])) for i in range(batch)]
    lat = []
    with Journal(root / "micro") as j:
        for _ in range(n):
            t0 = time.perf_counter()
            j.append_batch(recs)
            lat.append(time.perf_counter() - t0)
    return {"batch_records": batch, **_summary(lat)}


def bench_wal(preset_name: str = "tiny", trajectories: int = 8, prompt_len: int = 32, max_tokens: int = 32,
              rounds: int = 2, seed: int = 0, out: str | None = "bench/results/rollout_wal.json",
              wal_dir: str | None = None) -> dict:
    """Decode-step time with and without the WAL; writes JSON to ``out`` (``None``: don't)."""
    for name, v, lo in (("trajectories", trajectories, 1), ("prompt_len", prompt_len, 1),
                        ("max_tokens", max_tokens, 2), ("rounds", rounds, 1)):
        if v < lo:
            raise ValueError(f"bench wal: '{name}' must be >= {lo}, got {v}")
    cfg = preset(preset_name)
    model = V4Model(cfg, seed=0).cast(torch.float32).eval()
    work = _workload(trajectories, prompt_len, max_tokens, seed)
    ecfg = EngineConfig(n_blocks=max(64, trajectories * (-(-(prompt_len + max_tokens) // 16) + 1)),
                        n_slots=trajectories, token_budget=max(256, trajectories * prompt_len))
    modes = ("none", "inline", "pipeline")
    per: dict[str, dict] = {m: {"steps": [], "wal": [], "extra": {}} for m in modes}
    tokens = {}
    with tempfile.TemporaryDirectory(dir=wal_dir) as tmp:
        for r in range(rounds):
            for m in modes:
                toks, steps, wal_s, extra = _run(model, work, m, Path(tmp) / f"r{r}", ecfg)
                tokens.setdefault(m, toks)
                # decode steps only: the first step prefills every prompt
                per[m]["steps"] += steps[1:]
                per[m]["wal"] += wal_s[1:]
                per[m]["extra"] = extra
        micro = _fsync_micro(Path(tmp), trajectories)
    base = statistics.median(per["none"]["steps"])
    res = {
        "what": "decode-step wall time of the same seeded trajectories: bare engine vs rollout worker with the "
                "token WAL (fsync inline, or overlapped with the next decode step)",
        "preset": preset_name, "trajectories": trajectories, "prompt_len": prompt_len, "max_tokens": max_tokens,
        "rounds": rounds, "host": platform.node(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "tokens_identical": tokens["none"] == tokens["inline"] == tokens["pipeline"],
        "fsync_append_batch": micro,
        "modes": {},
    }
    for m in modes:
        st, wl = per[m]["steps"], per[m]["wal"]
        res["modes"][m] = {
            "step": _summary(st),
            "wal_on_critical_path": _summary(wl),
            "wal_fraction_of_step": statistics.fmean(wl) / statistics.fmean(st),
            "p50_step_minus_bare_p50_ms": 1e3 * (statistics.median(st) - base),
            **per[m]["extra"],
        }
    if out:
        write_result(out, res)
    return res


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="bench wal", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/rollout_wal.json")
    a = ap.parse_args(argv)
    try:
        res = bench_wal(a.preset, a.trajectories, a.prompt_len, a.max_tokens, a.rounds, out=a.out)
    except ValueError as e:
        ap.error(str(e))
    for m, d in res["modes"].items():
        print(f"{m:<9} step p50 {d['step']['p50_ms']:8.2f} ms   WAL on critical path mean "
              f"{d['wal_on_critical_path']['mean_ms']:6.3f} ms ({100 * d['wal_fraction_of_step']:.2f}% of a step)")
    print(f"fsync of one batch p50 {res['fsync_append_batch']['p50_ms']:.3f} ms; "
          f"tokens identical across modes: {res['tokens_identical']}; JSON in {a.out}")


if __name__ == "__main__":
    main()
