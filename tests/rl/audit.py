"""The loop's exactly-once audit: the rollout WALs against the trainer's committed checkpoints.

Run with ``GRPOConfig(keep=0)`` so every committed step's checkpoint is still there. A committed
step's meta names the trajectories it consumed; the audit asks that

- every trajectory in the WALs ended (nothing left half-done);
- the committed steps are 1..N and their consumed sets are disjoint (nothing trained twice);
- their union is every ended trajectory (nothing lost);
- each trajectory's durable CONSUMED mark names the committed step that consumed it;
- the step that consumed a trajectory trained on data one policy version older (sampled by
  version round-1, every TOKENS record of it too).
"""

from __future__ import annotations

import json
from pathlib import Path

from v4stack.journal import read_records
from v4stack.rollout.wal import TokenWAL


def trajectories(out: Path) -> dict:
    trajs = {}
    for wal_dir in sorted((out / "rollouts").glob("w*/wal")):
        with TokenWAL(wal_dir) as wal:
            trajs.update(wal.trajectories)
    return trajs


def committed_steps(out: Path) -> dict[int, set[str]]:
    steps = {}
    for d in sorted((out / "trainer" / "ckpt").glob("step_*")):
        if d.suffix == ".tmp":
            continue
        meta = json.loads((d / "meta.json").read_text())
        steps[int(meta["step"])] = {t for ts in meta["consumed"].values() for t in ts}
    return steps


def audit(out: Path, steps: int) -> dict:
    trajs = trajectories(out)
    ended = {k: t for k, t in trajs.items() if t.finished}
    assert ended and len(ended) == len(trajs), f"unfinished: {sorted(set(trajs) - set(ended))}"
    done = committed_steps(out)
    assert sorted(done) == list(range(1, steps + 1)), f"committed steps {sorted(done)}, keep=0 expected"
    seen: dict[str, int] = {}
    for s, ts in sorted(done.items()):
        twice = sorted(t for t in ts if t in seen)
        assert not twice, f"trained twice: {twice} (steps {[seen[t] for t in twice]} and {s})"
        seen.update((t, s) for t in ts)
    lost = sorted(set(ended) - set(seen))
    assert not lost, f"lost: {lost} (marks {[ended[t].consumed for t in lost]}, no committed step names them)"
    unknown = sorted(set(seen) - set(ended))
    assert not unknown, f"committed steps name trajectories the WALs do not hold: {unknown}"
    wrong = sorted((t, ended[t].consumed, s) for t, s in seen.items() if ended[t].consumed != s)
    assert not wrong, f"CONSUMED marks disagree with the committed steps (traj, mark, step): {wrong}"
    for t in ended.values():
        round_ = int(t.traj.split("-")[0][1:])
        assert t.consumed == round_ and t.version == round_ - 1, (t.traj, t.consumed, t.version)
        assert all(v == t.version for _, v in t.token_versions)
    return {"trajectories": len(ended), "steps": done, "doc": json.loads((out / "loop.json").read_text())}


def tool_calls(out: Path) -> list[dict]:
    """Every TOOL_CALL in the WALs with the OBS that answered it (``how``: ran / fast_forward / rerun)."""
    calls = []
    for wal_dir in sorted((out / "rollouts").glob("w*/wal")):
        pending: dict[str, dict] = {}
        for _, p in read_records(wal_dir):
            rec = json.loads(p)
            if rec["t"] == "TOOL_CALL":
                pending[rec["traj"]] = {"traj": rec["traj"], "sandbox": rec["sandbox"], "cmd": rec["cmd"],
                                        "worker": wal_dir.parent.name, "how": None}
                calls.append(pending[rec["traj"]])
            elif rec["t"] == "OBS" and rec["traj"] in pending:
                pending.pop(rec["traj"])["how"] = rec["how"]
    return calls
