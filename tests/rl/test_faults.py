"""Faults that need a policy that certainly calls tools, or a driver that dies mid-protocol.

- A sandbox edge SIGKILLed in the middle of the loop: the tool calls addressed to its sandboxes
  (counted from DSec's own placement table) are re-run on fresh sandboxes of its replacement, and
  their trajectories are trained on exactly once.
- The loop driver SIGKILLed inside step K's consumption protocol and restarted from the WALs and
  checkpoints passes the exactly-once audit; the same kill under a broken protocol (CONSUMED marks
  durable before the update is committed) fails the same audit: the inverse control.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rl.audit import audit, tool_calls
from tests.rl.conftest import TOOL_SFT, dsec_missing
from tests.rl.test_loop import loop_cfg, need_ray_and_dsec
from v4stack.rl.loop import run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_edge_killed_mid_loop_its_tool_calls_are_rerun_and_trained_once(tmp_path, policy_root):
    need_ray_and_dsec()
    out = tmp_path / "run"
    summary = run(loop_cfg(out, policy_root, 3, ["edge@2"], sft=TOOL_SFT, max_tokens=24))
    a = audit(out, 3)
    (fault,) = a["doc"]["faults"]
    assert fault["kind"] == "edge" and fault["step"] == 2 and fault["replacement"] != fault["edge"]
    with sqlite3.connect(out / "dsec" / "dsec.sqlite") as db:
        edge_of = dict(db.execute("SELECT id, edge FROM sandboxes"))
        verdict = {sid: (state, reason) for sid, state, reason in db.execute("SELECT id, state, reason FROM sandboxes")}
    calls = tool_calls(out)
    assert {c["how"] for c in calls} <= {"ran", "rerun"} and all(c["how"] for c in calls)
    by_round = {r: [c for c in calls if c["traj"].startswith(f"r{r}-")] for r in (1, 2, 3)}
    assert all(by_round.values()), {r: len(c) for r, c in by_round.items()}  # every round called tools
    dead = [c for c in calls if edge_of[c["sandbox"]] == fault["edge"]]
    hit = [c for c in dead if c["traj"].startswith(("r2-", "r3-"))]  # addressed to the edge after its death
    assert hit, "no tool call reached the dead edge"
    assert all(c["how"] == "rerun" for c in hit), hit
    # DSec's own verdict on those sandboxes: lost with their edge
    assert all(verdict[c["sandbox"]] == ("lost", f"edge {fault['edge']} stopped heartbeating") for c in hit), \
        [verdict[c["sandbox"]] for c in hit]
    assert all(c["how"] == "ran" for c in calls if c not in hit)  # nothing else needed a rerun
    # each rerun trajectory is consumed exactly once (the audit), by the step of its round
    steps = a["steps"]
    for c in hit:
        assert sum(c["traj"] in ts for ts in steps.values()) == 1
    tools = a["doc"]["records"][-1]["tools"]
    assert tools["tool_retried"] == len(hit) and tools["tool_failed"] == 0
    assert summary["consumed"] == a["trajectories"] == 3 * 2 * 2
    print(f"tool calls {len(calls)} (rounds 1-3: {[len(by_round[r]) for r in (1, 2, 3)]}); on the killed edge's "
          f"sandboxes {len(dead)}, after its death {len(hit)}, all re-run")


def _child(out: Path, policy: Path, protocol: str, kill: str, k: int = 2, steps: int = 3) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    return subprocess.run([sys.executable, "-m", "tests.rl.loop_child", str(out), str(policy), str(steps), protocol,
                           kill, str(k)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _killed_then_resumed(out: Path, policy: Path, protocol: str, kill: str) -> None:
    r = _child(out, policy, protocol, kill)
    assert r.returncode == -9, r.stderr[-3000:]
    r = _child(out, policy, protocol, "none")
    assert r.returncode == 0 and "STEPS 3" in r.stdout, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["in_step", "after_commit"])
def test_driver_killed_inside_the_consumption_protocol_resumes_exactly_once(tmp_path, policy_root, kill):
    if dsec_missing():
        pytest.skip(dsec_missing())
    out = tmp_path / "run"
    _killed_then_resumed(out, policy_root, "commit_then_mark", kill)
    a = audit(out, 3)
    assert a["trajectories"] == 3 * 2 * 2


@pytest.mark.slow
def test_inverse_control_marks_before_commit_fail_the_audit(tmp_path, policy_root):
    """The broken order: CONSUMED marks durable before the update commits. The driver dies after the
    marks of step 2, before the trainer commits it; the restarted loop reads the marks, skips those
    trajectories, and the audit finds them lost."""
    if dsec_missing():
        pytest.skip(dsec_missing())
    out = tmp_path / "run"
    _killed_then_resumed(out, policy_root, "mark_then_commit", "in_step")
    with pytest.raises(AssertionError, match="lost") as e:
        audit(out, 3)
    print(str(e.value).splitlines()[0][:300])
