"""Sandboxes on both substrates: exec, files, the trajectory log, snapshots, fast-forward, replay."""

from __future__ import annotations

import pytest

from v4stack.dsec.cgroups import Limits
from v4stack.dsec.errors import BadRequest, Conflict, NotFound

SUBSTRATES = ["process", "container"]


@pytest.mark.parametrize("sub", SUBSTRATES)
def test_exec_files_log_snapshot_restore(runtime, sub):
    s = runtime.create("busybox", sub)
    try:
        r = s.exec("echo hello > /workspace/a; echo out; echo err >&2; exit 3")
        assert (r["exit_code"], r["stdout"], r["stderr"]) == (3, "out\n", "err\n")
        assert "workspace/a" in r["changed"] and not r["fast_forward"]
        s.write_files([("/workspace/deep/x/y.txt", b"data", 0o600)])
        assert s.files.read("workspace/deep/x/y.txt") == b"data"
        assert s.exec("cat /workspace/deep/x/y.txt")["stdout"] == "data"
        names = [e["name"] for e in s.files.list("/workspace")]
        assert names == ["a", "deep"]

        snap = s.snapshot()
        assert snap["seq"] == 2 and len(snap["layers"]) == 1
        after = s.exec("rm /workspace/a; echo b > /workspace/b", idempotent=True)
        assert after["seq"] == 3
        assert s.exec("ls /workspace")["stdout"] == "b\ndeep\n"

        # fast-forward: a re-issued logged request is answered from the log, not run again
        again = s.exec("rm /workspace/a; echo b > /workspace/b", idempotent=True, seq=3)
        assert again["fast_forward"] and again["stdout"] == after["stdout"] and again["exit_code"] == 0
        with pytest.raises(Conflict, match="different request"):
            s.exec("echo other", seq=3)
        with pytest.raises(Conflict, match="next sequence number"):
            s.exec("echo gap", seq=99)

        res = s.restore(snap["id"])
        assert res["seq"] == 2
        assert s.exec("ls /workspace")["stdout"] == "a\ndeep\n"

        log = runtime.log(s.id, path="workspace/b")
        assert log["provenance"] == [3] and log["unknown_outcome"] == []
        assert [e["seq"] for e in log["entries"]][:4] == [0, 1, 2, 3]
    finally:
        runtime.kill(s.id)
    with pytest.raises(NotFound):
        runtime.get(s.id)


@pytest.mark.parametrize("sub", SUBSTRATES)
def test_fork_with_replay_reaches_the_same_state_without_rerunning(runtime, sub):
    s = runtime.create("busybox", sub)
    try:
        s.exec("echo 1 > /workspace/one")
        snap = s.snapshot()
        s.exec("echo $$ > /workspace/pid; rm /workspace/one")  # not idempotent: a pid differs per run
        s.exec("mkdir -p /workspace/d && echo z > /workspace/d/z")
        want = s.exec("cat /workspace/pid; ls -R /workspace")["stdout"]
        f = runtime.create(snapshot=snap["id"], substrate=sub, replay_from=s.id)
        try:
            info = f.restore_info
            assert info["replayed"] == [1, 2, 3] and info["unknown_outcome"] == []
            assert info["state_matches"]
            assert f.exec("cat /workspace/pid; ls -R /workspace")["stdout"] == want
            assert f.log.next_seq == 5  # 1..3 copied, 4 ran here
        finally:
            runtime.kill(f.id)
    finally:
        runtime.kill(s.id)


def test_chain_flattens_and_keeps_deletions(runtime):
    from v4stack.dsec import runtime as rtmod

    s = runtime.create("busybox", "process")
    try:
        s.exec("rm /etc/hostname")
        for i in range(rtmod.MAX_CHAIN + 1):
            s.exec(f"echo {i} > /workspace/f{i % 3}; rm -f /workspace/f{(i + 1) % 3}")
            snap = s.snapshot()
        assert len(snap["layers"]) <= rtmod.MAX_CHAIN
        want = s.exec("ls /workspace; cat /workspace/*; ls /etc")["stdout"]
        f = runtime.create(snapshot=snap["id"], substrate="process")
        try:
            assert f.exec("ls /workspace; cat /workspace/*; ls /etc")["stdout"] == want
            assert "hostname" not in want
        finally:
            runtime.kill(f.id)
    finally:
        runtime.kill(s.id)


def test_timeouts_and_bad_input_name_the_field(runtime):
    s = runtime.create("busybox", "process")
    try:
        r = s.exec("echo start; sleep 30", timeout=0.5)
        assert r["timed_out"] and r["stdout"] == "start\n" and r["duration"] < 5
        assert s.exec("echo alive")["stdout"] == "alive\n"
        with pytest.raises(BadRequest) as e:
            s.exec("true", timeout=0)
        assert e.value.field == "timeout"
        with pytest.raises(BadRequest) as e:
            s.exec(["ok", 3])
        assert e.value.field == "cmd"
    finally:
        runtime.kill(s.id)
    with pytest.raises(BadRequest) as e:
        runtime.create("busybox", "process", Limits(memory_bytes=1))
    assert e.value.field == "memory_bytes"
    with pytest.raises(BadRequest) as e:
        runtime.create("busybox", "vm")
    assert e.value.field == "substrate"
    with pytest.raises(NotFound) as e:
        runtime.create("no-such-image", "process")
    assert e.value.field == "image"


_CRASH = r"""
import os, sys
from v4stack.dsec.runtime import Runtime
rt = Runtime(sys.argv[1], pool_size=0)
s = rt.create("busybox", "container", allow=[])
s.exec("echo x > /workspace/x")
print(s.id, flush=True)
os._exit(0)  # an edge that dies without cleaning up
"""


def test_orphans_of_a_crashed_edge_are_reclaimed_and_live_ones_kept(runtime, dsec_home):
    import subprocess
    import sys
    from pathlib import Path

    from v4stack.dsec.runtime import reclaim_orphans

    live = runtime.create("busybox", "container")
    try:
        sid = subprocess.run([sys.executable, "-c", _CRASH, str(dsec_home)], capture_output=True, text=True,
                             check=True).stdout.strip()
        assert (dsec_home / "run" / sid / "root").is_dir() and Path(f"/run/netns/dsec-{sid}").exists()
        gone = reclaim_orphans(dsec_home)
        assert sid in gone and live.id not in gone
        assert not (dsec_home / "run" / sid).exists() and not Path(f"/run/netns/dsec-{sid}").exists()
        assert runtime.log(sid)["entries"][0]["status"] == "done"  # the log stays for recovery
        assert live.exec("echo still")["stdout"] == "still\n"
    finally:
        runtime.kill(live.id)


_DIE_AFTER_INTENT = r"""
import os, sys
from v4stack.dsec.runtime import Runtime, DEFAULT_ENV
rt = Runtime(sys.argv[1], pool_size=0)
s = rt.create("busybox", "process")
s.exec("echo base > /workspace/base")
snap = s.snapshot()
s.exec("echo one > /workspace/one")
idem = sys.argv[2] == "1"
request = {"op": "exec", "argv": ["/bin/sh", "-c", "echo two >> /workspace/two"], "cwd": "/",
           "env": dict(DEFAULT_ENV), "timeout": 60.0}
s.log.intent(request, idem, snap["id"])  # durable, then the edge dies before running it
print(s.id, snap["id"], flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("idempotent", [True, False])
def test_unknown_outcome_is_rerun_only_if_idempotent_and_asked(runtime, dsec_home, idempotent):
    import subprocess
    import sys

    from v4stack.dsec.runtime import reclaim_orphans

    out = subprocess.run([sys.executable, "-c", _DIE_AFTER_INTENT, str(dsec_home), "1" if idempotent else "0"],
                         capture_output=True, text=True, check=True).stdout.split()
    dead, snap = out
    reclaim_orphans(dsec_home)
    assert runtime.log(dead)["unknown_outcome"] == [2]
    plain = runtime.create(snapshot=snap, substrate="process", replay_from=dead)
    again = runtime.create(snapshot=snap, substrate="process", replay_from=dead, rerun_idempotent=True)
    try:
        assert plain.restore_info["unknown_outcome"] == [2] and "rerun" not in plain.restore_info
        assert plain.exec("ls /workspace")["stdout"] == "base\none\n"  # never re-run silently
        if idempotent:
            assert again.restore_info["rerun"]["exit_code"] == 0
            assert again.files.read("/workspace/two") == b"two\n"
            assert runtime.log(again.id)["entries"][-1]["status"] == "done"
        else:
            assert "rerun" not in again.restore_info
            assert again.exec("ls /workspace")["stdout"] == "base\none\n"
    finally:
        runtime.kill(plain.id)
        runtime.kill(again.id)
