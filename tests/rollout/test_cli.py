"""The rollout commands, mounted on a fresh app the way v4stack.cli mounts them."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from v4stack.journal import Journal
from v4stack.rollout import TokenWAL
from v4stack.rollout import records as R
from v4stack.rollout.cli import app as rollout_app
from v4stack.serve.sampling import SamplingParams


def app() -> typer.Typer:
    a = typer.Typer()
    a.add_typer(rollout_app, name="rollout")
    return a


def test_inspect(tmp_path):
    sp = SamplingParams(max_tokens=4)
    with TokenWAL(tmp_path / "w") as w:
        w.append([R.begin("a", [1], sp), R.begin("b", [2], sp), R.tokens("a", 0, [3, 4]), R.end("a", 2, "stop")])
        w.append([R.preempt("b", 0, "drain", None), R.resume("b", 0, "h:1", 0, "reprefilled", "no saved cache")])
        w.append([R.consumed("a", 9)])
        # inspect reads while the writer holds the lock
        res = CliRunner().invoke(app(), ["rollout", "inspect", str(tmp_path / "w")])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert got == {"records": 7, "trajectories": 2, "tokens": 2, "by_status": {"ended": 1, "running": 1},
                   "preemptions": 1, "resumed": {"reused": 0, "reprefilled": 1}, "consumed": 1}


def test_inspect_names_a_bad_record(tmp_path):
    with Journal(tmp_path / "w") as j:
        j.append(R.encode(R.begin("a", [1], SamplingParams())))
        j.append(R.encode(R.tokens("a", 5, [1])))
    res = CliRunner().invoke(app(), ["rollout", "inspect", str(tmp_path / "w")])
    assert res.exit_code == 1 and "field 'off' is 5" in res.output
