"""The closed loop on a local Ray: 2 rollout workers, the trainer, sandboxes; faults mid-loop.

After every run the WALs and the checkpoints must agree: every trajectory that ended is consumed
exactly once (never twice, none lost), the steps' consumed sets are disjoint, and every
trajectory carries the policy version it was sampled with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from v4stack.rl.loop import LoopConfig, run
from v4stack.rl.policy import SFTConfig
from v4stack.rollout.wal import TokenWAL

ROOT = Path(__file__).resolve().parents[2]


def _cfg(out, steps: int, faults: list[str]) -> LoopConfig:
    return LoopConfig(out=str(out), ray=True, workers=2, groups=2, group_size=2, steps=steps, minutes=0,
                      eval_n=2, max_tokens=16, faults=faults, progress=False,
                      sft=SFTConfig(steps=2, batch_size=2, seq_len=32, corpus_bytes=20_000, threads=1))


def _audit(out: Path, steps: int) -> dict:
    """Cross-check the WALs against the trainer's checkpoints."""
    trajs = {}
    for wal_dir in sorted((out / "rollouts").glob("w*/wal")):
        with TokenWAL(wal_dir) as wal:
            for t in wal.trajectories.values():
                trajs[t.traj] = t
    ended = {k: t for k, t in trajs.items() if t.finished}
    assert ended and len(ended) == len(trajs)  # nothing left half-done
    unconsumed = [k for k, t in ended.items() if t.consumed is None]
    assert not unconsumed, f"lost: {unconsumed}"
    doc = json.loads((out / "loop.json").read_text())
    assert [r["step"] for r in doc["records"]] == list(range(1, steps + 1))
    from v4stack.train.checkpoint import latest

    meta = json.loads((latest(out / "trainer" / "ckpt") / "meta.json").read_text())
    assert meta["step"] == steps
    # the step that consumed each trajectory trained on data from the policy one version older
    for t in ended.values():
        round_ = int(t.traj.split("-")[0][1:])
        assert t.consumed == round_ and t.version == round_ - 1, (t.traj, t.consumed, t.version)
        assert all(v == t.version for _, v in t.token_versions)
    return {"trajectories": len(ended), "doc": doc}


def test_loop_on_ray_with_a_rollout_worker_killed(tmp_path):
    """Default run: 2 Ray rollout workers, 2 steps; rollout worker w0 is SIGKILLed mid-rollout in
    step 2, restarts, recovers its WAL, and the step completes with nothing lost or trained twice."""
    pytest.importorskip("ray")
    from tests.rl.conftest import dsec_missing

    if dsec_missing():
        pytest.skip(dsec_missing())
    out = tmp_path / "run"
    summary = run(_cfg(out, 2, ["worker@2"]))
    assert summary["steps"] == 2
    a = _audit(out, 2)
    assert a["trajectories"] == 2 * 2 * 2
    assert [f["kind"] for f in a["doc"]["faults"]] == ["worker"]
    assert summary["consumed"] == summary["trajectories"] == 8
    # w0's WAL shows the kill: trajectories of round 2 resumed by the restarted server
    with TokenWAL(out / "rollouts" / "w0" / "wal") as wal:
        resumed = [t for t in wal.trajectories.values() if t.resumes]
    assert resumed and all(t.traj.startswith("r2-") for t in resumed)
    assert (out / "loop.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("faults", [["trainer@1", "trainer@2"], ["edge@1"]])
def test_loop_survives_trainer_and_edge_kills(tmp_path, faults):
    pytest.importorskip("ray")
    out = tmp_path / "run"
    summary = run(_cfg(out, 3, faults))
    a = _audit(out, 3)
    assert sorted(f["kind"] for f in a["doc"]["faults"]) == sorted(f.split("@")[0] for f in faults)
    assert summary["consumed"] == a["trajectories"] == 3 * 2 * 2


def test_fault_injection_needs_separate_processes(tmp_path):
    with pytest.raises(ValueError, match="faults"):
        LoopConfig(out=str(tmp_path), ray=False, faults=["worker@1"]).validate()
    with pytest.raises(ValueError, match="faults"):
        LoopConfig(out=str(tmp_path), faults=["disk@1"]).validate()
