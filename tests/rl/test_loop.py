"""The closed loop on a local Ray: 2 rollout workers, the trainer, sandbox edges as actors; faults
mid-loop. After every run ``audit`` checks the WALs against every committed checkpoint: nothing
trained twice, nothing lost, marks agreeing with the steps (its inverse control is in
test_faults.py)."""

from __future__ import annotations

import os

import pytest

from tests.rl.audit import audit
from tests.rl.conftest import QUICK_SFT, dsec_missing
from v4stack.rl.grpo import GRPOConfig
from v4stack.rl.loop import LoopConfig, run
from v4stack.rollout.wal import TokenWAL


def loop_cfg(out, policy, steps: int, faults: list[str], sft=QUICK_SFT, **kw) -> LoopConfig:
    base = dict(out=str(out), ray=True, workers=2, groups=2, group_size=2, steps=steps, minutes=0, eval_n=2,
                max_tokens=16, faults=faults, progress=False, sft=sft, policy=str(policy), grpo=GRPOConfig(keep=0))
    return LoopConfig(**{**base, **kw})


def need_ray_and_dsec():
    pytest.importorskip("ray")
    if dsec_missing():
        pytest.skip(dsec_missing())


def test_loop_on_ray_with_a_rollout_worker_killed(tmp_path, policy_root):
    """Default run: a local Ray with 2 rollout actors, the trainer actor (rank 0 of 2 trainer
    processes) and an edge actor, 2 steps;
    rollout worker w0 SIGKILLs itself 4 engine steps into round 2, restarts, recovers its WAL, and
    the step completes with nothing lost or trained twice."""
    need_ray_and_dsec()
    out = tmp_path / "run"
    summary = run(loop_cfg(out, policy_root, 2, ["worker@2"], trainer_procs=2))
    assert summary["steps"] == 2
    a = audit(out, 2)
    # the trainer ran as 2 processes (a gloo group launched by the trainer actor): a shard per rank
    ck = out / "trainer" / "ckpt" / "step_000002"
    assert sorted(p.name for p in ck.glob("optim.rank*.pt")) == ["optim.rank0.pt", "optim.rank1.pt"]
    assert a["trajectories"] == 2 * 2 * 2
    assert [f["kind"] for f in a["doc"]["faults"]] == ["worker"]
    assert summary["consumed"] == summary["trajectories"] == 8
    # w0's WAL shows the kill: trajectories of round 2 resumed by the restarted server
    with TokenWAL(out / "rollouts" / "w0" / "wal") as wal:
        resumed = [t for t in wal.trajectories.values() if t.resumes]
    assert resumed and all(t.traj.startswith("r2-") for t in resumed)
    # the edge ran as a child of its Ray actor, not of this process; its log is in the DSec home
    logs = list((out / "dsec").glob("edge-0-*-1.out"))
    assert len(logs) == 1 and int(logs[0].name.split("-")[2]) != os.getpid()
    assert (out / "loop.png").stat().st_size > 0


@pytest.mark.slow
def test_loop_survives_trainer_kills(tmp_path, policy_root):
    """The trainer actor (rank 0 of 2 trainer processes) SIGKILLed in step 1 before its checkpoint
    commit and in step 2 after it; its group goes down with it and the restarted actor's new group
    resumes from the checkpoint."""
    need_ray_and_dsec()
    out = tmp_path / "run"
    summary = run(loop_cfg(out, policy_root, 3, ["trainer@1", "trainer@2"], trainer_procs=2))
    a = audit(out, 3)
    assert [(f["kind"], f["when"]) for f in a["doc"]["faults"]] == [("trainer", "before_commit"),
                                                                    ("trainer", "after_commit")]
    assert summary["consumed"] == a["trajectories"] == 3 * 2 * 2


def test_fault_injection_needs_separate_processes(tmp_path):
    with pytest.raises(ValueError, match="faults"):
        LoopConfig(out=str(tmp_path), ray=False, faults=["worker@1"]).validate()
    with pytest.raises(ValueError, match="faults"):
        LoopConfig(out=str(tmp_path), faults=["disk@1"]).validate()
    LoopConfig(out=str(tmp_path), ray=False, faults=["edge@1"]).validate()  # edges are processes either way
