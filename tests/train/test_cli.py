"""The command functions, registered on a Typer app the way v4stack.cli registers them."""

import json

import typer
from typer.testing import CliRunner

from v4stack.train.cli import muon_plan_command, train_command


def _app():
    app = typer.Typer()
    plan = typer.Typer()
    plan.command("muon")(muon_plan_command)
    app.add_typer(plan, name="plan")
    app.command("train")(train_command)
    return app


def test_plan_muon_json_and_errors():
    runner = CliRunner()
    res = runner.invoke(_app(), ["plan", "muon", "--preset", "flash", "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    for key in ("padding", "max_matrices_per_rank", "zero_group_size", "replicated_groups"):
        assert key in plan
    assert plan["padding"] < 0.10 and plan["max_matrices_per_rank"] <= 5
    res = runner.invoke(_app(), ["plan", "muon", "--preset", "flash", "--dp", "96", "--ep", "64"])
    assert res.exit_code == 2 and "'ep' must divide 'dp'" in res.output


def test_train_rejects_bad_fields(tmp_path):
    res = CliRunner().invoke(_app(), ["train", "--out", str(tmp_path), "--optimizer", "sgd"])
    assert res.exit_code == 2 and "'optimizer' must be one of" in res.output
    res = CliRunner().invoke(_app(), ["train", "--out", str(tmp_path), "--data", str(tmp_path / "none.txt")])
    assert res.exit_code == 2 and "no file or directory" in res.output
