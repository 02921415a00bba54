"""Multi-turn rollouts with tools in real DSec sandboxes: commit order, log-probs, crash recovery."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.rl.agent import AgentWorker
from v4stack.rl.sandboxes import ToolRunner
from v4stack.rollout.wal import TokenWAL, inspect
from v4stack.serve.engine import Engine
from v4stack.serve.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
# every single character is a stop string, so with random weights each turn is one sampled token
ONE_BYTE_TURNS = SamplingParams(temperature=1.0, max_tokens=24, seed=7,
                                stop=tuple(chr(i) for i in range(128)) + ("\ufffd",))
COMMAND = "expr 40 + 2"


def parse(context: str, turn: str) -> str | None:
    """The test protocol: the turn after the prompt's '$ ' asks for COMMAND; later turns answer."""
    return COMMAND if context.endswith("$ ") else None


def observe(stdout: str) -> str:
    return stdout.strip() + "\nA: "


def build(url: str, token: str, wal_dir: str, wrap=None):
    torch.manual_seed(0)
    model = V4Model(preset("tiny"), seed=3)
    tools = ToolRunner(url, token, slots=1)
    w = AgentWorker(Engine(model), TokenWAL(wal_dir), wrap(tools) if wrap else tools, parse=parse, observe=observe)
    return w, tools


def test_tool_turn_commit_order_and_logprobs(dsec, tmp_path):
    w, tools = build(dsec.url, dsec.token, str(tmp_path / "wal"))
    prompt = list(b"x\n$ ")
    w.submit("t0", prompt, ONE_BYTE_TURNS, group="g")
    w.run()
    tr = w.wal.trajectories["t0"]
    kinds = [k for k in _kinds(tmp_path / "wal")]
    # tokens of the tool turn are durable before the call, the call before its observation, and the
    # observation before the answer turn
    assert kinds == ["BEGIN", "TOKENS", "TOOL_CALL", "OBS", "TOKENS", "END"]
    assert tr.finished and tr.obs == [(1, len(b"42\nA: "))]
    assert bytes(tr.tokens[1:1 + tr.obs[0][1]]) == b"42\nA: "  # the sandbox's real output
    assert tr.calls[0]["cmd"] == COMMAND and tr.calls[0]["sandbox"].startswith("sbx-")
    # the recorded log-probabilities are the model's own: recompute them with a full forward
    full = torch.tensor([prompt + tr.tokens])
    with torch.no_grad():
        lp = torch.log_softmax(w.engine.model(full)[0].double(), -1)
    sampled = [i for i in range(len(tr.tokens)) if not (tr.obs[0][0] <= i < sum(tr.obs[0]))]
    for i in sampled:
        want = float(lp[len(prompt) + i - 1, tr.tokens[i]])
        assert abs(tr.logprobs[i] - want) < 1e-3, (i, tr.logprobs[i], want)
    assert all(tr.logprobs[i] == 0.0 for i in range(tr.obs[0][0], sum(tr.obs[0])))
    w.close()
    tools.close()


def test_kill_after_tool_ran_recovers_from_sandbox_log(dsec, tmp_path):
    """SIGKILL after the sandbox ran the command but before OBS: recovery asks the same sandbox with
    the logged sequence number and its log answers (fast_forward) - the command is not run twice."""
    wal = tmp_path / "wal"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    r = subprocess.run([sys.executable, "-m", "tests.rl.agent_child", dsec.url, dsec.token, str(wal)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == -9, r.stderr[-2000:]
    assert "RAN '42\\n'" in r.stdout
    before = inspect(wal)
    assert before["by_status"] == {"running": 1}
    w, tools = build(dsec.url, dsec.token, str(wal))
    tr = w.wal.trajectories["t0"]
    assert len(tr.calls) == 1 and not tr.obs  # asked, answer not logged
    from v4stack.dsec.client import Sandbox

    sbx = Sandbox.connect(tr.calls[0]["sandbox"], api_url=dsec.url, token=dsec.token)
    runs_before = len(sbx.log()["entries"])
    got = w.recover()
    assert got == {"t0": "fast_forward"}, (got, tools.stats.errors)
    w.run()
    assert tr.finished and bytes(tr.tokens[1:1 + tr.obs[0][1]]) == b"42\nA: "
    assert len(sbx.log()["entries"]) == runs_before  # nothing new ran in the sandbox
    assert _kinds(wal)[-4:] == ["RESUME", "OBS", "TOKENS", "END"]
    w.close()
    tools.close()


def _kinds(path) -> list[str]:
    import json

    from v4stack.journal import read_records

    return [json.loads(p)["t"] for _, p in read_records(path)]
