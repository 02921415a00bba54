"""A result file's stamp says where its commit came from and which tree's ``v4stack`` ran."""

import sys
from pathlib import Path

from bench import runner


def test_stamp_names_the_commit_source_and_the_package_tree(monkeypatch, tmp_path):
    import v4stack

    monkeypatch.setenv("V4STACK_COMMIT", "abc1234")
    monkeypatch.setenv("V4STACK_DIRTY", "0")
    st = runner.stamp()
    assert st["commit"] == "abc1234" and st["commit_from"] == "env" and st["dirty"] is False
    assert st["package"] == str(Path(v4stack.__file__).resolve().parents[1].relative_to(runner.ROOT))
    # control: without the variable the commit is git's (or none), and says so
    monkeypatch.delenv("V4STACK_COMMIT")
    st = runner.stamp()
    assert st["commit_from"] in ("git", None) and st["commit"] != "abc1234"
    # another tree's package (an A/B's older side) is named as that tree
    fake = tmp_path / "old" / "src" / "v4stack"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    monkeypatch.setitem(sys.modules, "v4stack", type(sys)("v4stack"))
    sys.modules["v4stack"].__file__ = str(fake / "__init__.py")
    assert runner.stamp()["package"] == str((tmp_path / "old" / "src").resolve())
