"""The crash, hang and amplification cases of issue 12 on a runtime: each must end in a clear
answer, leave the sandbox serving, and cost what the sandbox really uses."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from v4stack.dsec.cgroups import Limits
from v4stack.dsec.errors import BadRequest, DsecError
from v4stack.dsec.trajlog import query

from tests.dsec.sandboxes import SMALL, SUBSTRATES


def _bounded(fn, seconds: float = 30):
    """Run ``fn`` in a thread; a call that hangs fails the test instead of hanging it."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} hung"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_fifo_is_refused_by_the_files_api_and_survives_snapshots(sbx):
    sbx.exec("mkfifo /workspace/pipe")
    with pytest.raises(BadRequest, match="not a regular file"):
        _bounded(lambda: sbx.files.read("/workspace/pipe"))
    for _ in range(9):  # past MAX_CHAIN: the chain is flattened with the FIFO in it
        _bounded(sbx.snapshot, 60)
    assert sbx.exec("test -p /workspace/pipe && echo fifo")["stdout"] == "fifo\n"


@pytest.mark.parametrize("sub", [pytest.param(n, marks=pytest.mark.slow) if n != "process" else n for n in SUBSTRATES])
def test_long_and_deep_paths_are_answered(runtime, sub):
    sbx = runtime.create("busybox", sub, SMALL)
    try:
        _long_and_deep(sbx, runtime)
    finally:
        runtime.kill(sbx.id)


def _long_and_deep(sbx, runtime):
    name = "n" * 200
    r = sbx.exec(f"cd /workspace; i=0; while [ $i -lt 25 ]; do mkdir {name} && cd {name} || break; "
                 "i=$((i+1)); done; echo deep > f; while mkdir b 2>/dev/null && cd b 2>/dev/null; do :; done; pwd | wc -c; "
                 "cd /workspace; i=0; while [ $i -lt 990 ]; do mkdir a && cd a || break; i=$((i+1)); done; echo $i")
    depth, levels = map(int, r["stdout"].split())
    # on the host the upper's own path comes on top: these names are past PATH_MAX there
    assert r["exit_code"] == 0 and depth + len(str(sbx.rootfs.upper)) > 4096 and levels == 990
    nxt = sbx.exec("echo next")
    assert nxt["stdout"] == "next\n", nxt
    with pytest.raises(DsecError) as e:  # a clear refusal naming the sandbox, and it keeps serving
        sbx.snapshot()
    assert e.value.status == 409 and e.value.field == "sandbox_id"
    assert sbx.exec("cat /workspace/" + "/".join([name] * 20) + "/f")["stdout"] == "deep\n"
    log = runtime.log(sbx.id)
    assert log["unknown_outcome"] == [] and log["damaged"] is None


def test_non_utf8_names_are_answered(sbx, runtime):
    r = sbx.exec("touch \"$(printf '/workspace/\\377\\376name')\"; ls /workspace | wc -l")
    assert r["exit_code"] == 0
    names = [e["name"] for e in sbx.files.list("/workspace")]
    assert any("\udcff" in n for n in names)
    log = runtime.log(sbx.id)
    assert any("\udcff" in c for e in log["entries"] if e["result"] for c in e["result"]["changed"])


@pytest.mark.parametrize("sub", SUBSTRATES)
def test_sparse_file_costs_what_it_occupies(runtime, sub):
    s = runtime.create("busybox", sub, SMALL)
    try:
        blobs = runtime.home / "blobs"
        before = sum(f.stat().st_size for f in blobs.rglob("*") if f.is_file())
        r = _bounded(lambda: s.exec("truncate -s 2G /workspace/sparse && echo tail | "
                                    "dd of=/workspace/sparse bs=1 seek=1073741824 conv=notrunc 2>/dev/null; "
                                    "ls -l /workspace/sparse"), 120)
        assert r["exit_code"] == 0 and "2147483648" in r["stdout"], r
        grown = sum(f.stat().st_size for f in blobs.rglob("*") if f.is_file()) - before
        assert grown < 8 << 20, f"a sparse 2 GiB file stored {grown} bytes of blobs"
        with pytest.raises(BadRequest, match="read limit"):
            s.files.read("/workspace/sparse")
        snap = s.snapshot()
        s.exec("echo more >> /workspace/sparse")
        twin = runtime.create("busybox", sub, SMALL, snapshot=snap["id"], replay_from=s.id)
        try:
            assert twin.restore_info["state_matches"], twin.restore_info
            r = twin.exec("ls -l /workspace/sparse; dd if=/workspace/sparse bs=1 skip=1073741824 count=5 2>/dev/null")
            assert "2147483653" in r["stdout"] and "tail" in r["stdout"]
        finally:
            runtime.kill(twin.id)
    finally:
        runtime.kill(s.id)


def test_process_create_with_more_memory_and_no_leaked_worker(runtime):
    groups = lambda: {p.name for p in Path("/sys/fs/cgroup/pids").glob(f"dsec-w{os.getpid()}-*")}  # noqa: E731
    s = runtime.create("busybox", "process", Limits(memory_bytes=512 << 20))
    try:
        assert s.exec("echo big")["stdout"] == "big\n"
        assert int((s.handle.cgroup.dirs["memory"] / "memory.limit_in_bytes").read_text()) == 512 << 20 \
            if s.handle.cgroup.mode == "v1" else True
    finally:
        runtime.kill(s.id)
    s2 = runtime.create("busybox", "process", Limits(memory_bytes=32 << 20))  # and back down
    runtime.kill(s2.id)
    pool = runtime.substrate("process").pool_size
    assert len(groups()) <= pool + 1, groups()


def test_tampered_blob_is_reported_not_served(runtime):
    s = runtime.create("busybox", "process", SMALL)
    try:
        r = s.exec("echo the-real-output", idempotent=True)
        entry = runtime.log(s.id)["entries"][r["seq"]]
        d = entry["result"]["stdout"]
        p = runtime.blobs._path(d)
        p.write_bytes(b"the-fake-output\n")
        with pytest.raises(DsecError) as e:
            s.exec("echo the-real-output", idempotent=True, seq=r["seq"])  # answered from the log
        assert e.value.status == 500 and "damaged" in str(e.value) and e.value.field == "digest"
        p.write_bytes(b"the-real-output\n")  # the inverse control: the intact blob is served
        assert s.exec("echo the-real-output", idempotent=True, seq=r["seq"])["stdout"] == "the-real-output\n"
    finally:
        runtime.kill(s.id)


def test_flipped_byte_in_the_log_is_reported_by_sequence_number(runtime):
    s = runtime.create("busybox", "process", SMALL)
    try:
        for i in range(4):
            s.exec(f"echo {i} > /workspace/f{i}")
        logdir = runtime.home / "logs" / s.id
        assert query(logdir)["damaged"] is None  # inverse control: an intact log reports nothing
        seg = sorted(logdir.glob("seg-*.log"))[0]
        data = bytearray(seg.read_bytes())
        at = data.index(b'"seq":2')
        data[at + 5] ^= 0x01
        seg.write_bytes(bytes(data))
        out = query(logdir)
        # the journal names its first lost record (records: create, then intent / result per request)
        assert out["damaged"] is not None and 3 <= out["damaged"]["first_lost_record"] <= 6, out["damaged"]
        assert out["damaged"]["segment"].startswith("seg-") and out["damaged"]["reason"]
        assert out["damaged"]["after_seq"] in (None, 0, 1, 2)
    finally:
        runtime.kill(s.id)
