"""The host escapes of issue 12, each reproduced as an attack that must now fail.

Every test runs the attack for real (code inside a sandbox, or a caller of the runtime / edge
API holding a token) and asserts two things: the attack's own step failed, and the host marker it
aims at is absent (or unchanged). Tests are parametrised over every registered substrate the attack
applies to, so a substrate added later is attacked the same way.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import threading
import uuid
from pathlib import Path

import pytest

from v4stack.dsec import substrates
from v4stack.dsec.errors import DsecError

from tests.dsec.sandboxes import SMALL, SUBSTRATES
NET_SUBSTRATES = [n for n in SUBSTRATES if substrates.supports_allow(n)]


# -- code inside the sandbox ------------------------------------------------------------------
def test_proc_sys_is_read_only(sbx):
    """kernel.core_pattern written from inside = a host root command on the next crash."""
    path = Path("/proc/sys/kernel/core_pattern")
    before = path.read_text()
    try:
        r = sbx.exec(f"echo 'core-dsec-{uuid.uuid4().hex[:8]}' > /proc/sys/kernel/core_pattern; echo rc=$?; "
                     "echo 1 > /proc/sys/vm/drop_caches; echo rc2=$?")
        after = path.read_text()
    finally:
        if path.read_text() != before:
            path.write_text(before)
    assert after == before, "the sandbox changed the host's kernel.core_pattern"
    assert "rc=0" not in r["stdout"] and "rc2=0" not in r["stdout"]


def test_proc_sensitive_files_are_masked(sbx, runtime):
    other = runtime.create("busybox", "process" if sbx.substrate.name != "process" else "container", SMALL)
    try:
        r = sbx.exec("cat /proc/keys /proc/key-users; echo keys=$?; head -c 16 /proc/kcore | wc -c; "
                     "echo h > /proc/sysrq-trigger; echo sysrq=$?; cat /proc/1/mountinfo /proc/self/mountinfo")
        out = r["stdout"]
        assert "sysrq=0" not in out
        assert str(other.rootfs.base) not in out, "another sandbox's mounts are listed"
        points = [ln.split()[4] for ln in out.splitlines() if len(ln.split()) > 6 and ln.split()[4].startswith("/")]
        host = [p for p in points if p.startswith((str(runtime.home), "/work", "/tmp/"))]
        assert not host, f"the host's mount table is listed: {host[:3]}"
        lines = out.splitlines()
        assert lines[lines.index(next(x for x in lines if x.startswith("keys="))) + 1].strip() == "0"  # kcore empty
    finally:
        runtime.kill(other.id)


_KEYREAD = r"""
#include <stdio.h>
#include <unistd.h>
#include <sys/syscall.h>
int main(int c, char **v) {
    long id = syscall(SYS_keyctl, 10 /*SEARCH*/, -4 /*@u*/, "user", v[1], 0);
    if (id < 0) { perror("search"); return 1; }
    char buf[256] = {0};
    long n = syscall(SYS_keyctl, 11 /*READ*/, id, buf, sizeof buf - 1);
    if (n < 0) { perror("read"); return 2; }
    printf("payload=%s\n", buf);
    return 0;
}
"""


@pytest.fixture(scope="module")
def keyread(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the static keyring reader")
    d = tmp_path_factory.mktemp("keyread")
    (d / "k.c").write_text(_KEYREAD)
    r = subprocess.run(["gcc", "-static", "-O1", "-o", str(d / "keyread"), str(d / "k.c")], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"no static libc to build the keyring reader: {r.stderr[-200:]!r}")
    return (d / "keyread").read_bytes()


def test_host_keyring_is_unreadable(sbx, keyread):
    libc = ctypes.CDLL(None, use_errno=True)
    desc, payload = f"dsec-test-{uuid.uuid4().hex[:8]}", f"host-secret-{uuid.uuid4().hex}"
    key = libc.syscall(248, b"user", desc.encode(), payload.encode(), len(payload), ctypes.c_int(-4))  # add_key @u
    assert key > 0, os.strerror(ctypes.get_errno())
    try:
        sbx.write_files([("/workspace/keyread", keyread, 0o755)])
        r = sbx.exec(f"/workspace/keyread {desc}; cat /proc/keys 2>&1")
        assert payload not in r["stdout"], "the sandbox read a key from the host's root user keyring"
        assert desc not in r["stdout"], "the host's keyrings are listed in the sandbox"
    finally:
        libc.syscall(250, 21, key)  # KEYCTL_INVALIDATE


def test_worker_is_out_of_reach(sbx):
    """Signals to PID 1, a NUL in argv, odd env: the sandbox keeps serving, the next exec works."""
    sbx.exec("kill -INT 1; kill -TERM 1; kill -9 1; true")
    for bad in (dict(cmd=["/bin/echo", "a\x00b"]), dict(cmd="true", env={"A=B": "1"}), dict(cmd="true", env={"A": 1})):
        try:
            sbx.exec(**bad)
        except DsecError as e:
            assert e.status == 400, e
    assert sbx.exec("echo alive")["stdout"] == "alive\n"


@pytest.mark.parametrize("cwd", [".", "..", "../../..", "/../../.."])
def test_cwd_cannot_leave_the_root(sbx, tmp_path, cwd):
    secret = tmp_path / "secret"
    secret.write_text("host-0600-secret")
    secret.chmod(0o600)
    marker = tmp_path / f"marker-{uuid.uuid4().hex[:8]}"
    cmd = (f"ls; cat {secret} .{secret}; cd ../../../../../../../../../../..; cat .{secret}; "
           f"echo pwned > .{marker}; ls /")
    try:
        r = sbx.exec(cmd, cwd=cwd)
        assert "host-0600-secret" not in r["stdout"], "the command read a host file"
        assert "workspace" in r["stdout"].split()  # it ran, and `ls /` listed the sandbox's root
    except DsecError as e:
        assert e.status == 400 and e.field == "cwd"
    assert not marker.exists(), "the command wrote a host file"


# -- setuid files under host directories ------------------------------------------------------
@pytest.fixture(scope="module")
def open_runtime(dsec_home, unmount):
    """A runtime whose home sits in a world-traversable place (as /var/lib is), unlike pytest's tmp."""
    from v4stack.dsec.runtime import Runtime

    home = Path(f"/tmp/dsec-open-{uuid.uuid4().hex[:8]}")
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    rt = Runtime(home, pool_size=1)
    rt.images.build("busybox")
    yield rt
    rt.close()
    unmount(home)
    shutil.rmtree(home, ignore_errors=True)


def _as_nobody(path: str) -> str:
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "sh", "-c",
                        'exec "$0" -u', path],
                       capture_output=True, text=True, timeout=10)
    return r.stdout.strip()


@pytest.mark.parametrize("sub", SUBSTRATES)
def test_setuid_files_never_give_host_root(open_runtime, sub):
    rt = open_runtime
    s = rt.create("busybox", sub, SMALL)
    try:
        ident = Path("/usr/bin/id").read_bytes()
        s.write_files([("/workspace/id", ident, 0o755)])
        s.exec("chmod 4755 /workspace/id")
        try:
            s.write_files([("/workspace/id2", ident, 0o4755)])
        except DsecError as e:
            assert e.status == 400 and e.field == "mode"
        listing = {e["name"]: e["mode"] for e in s.files.list("/workspace")}
        assert not listing.get("id2", 0) & 0o6000, "an upload set a setuid/setgid bit"
        paths = [s.rootfs.upper / "workspace/id", s.rootfs.root / "workspace/id",
                 s.rootfs.upper / "workspace/id2", s.rootfs.root / "workspace/id2"]
        snap = s.snapshot()
        paths += [rt.layers.dir / lid / "workspace/id" for lid in snap["layers"]]
        for p in paths:
            if os.path.exists(p):
                assert _as_nobody(str(p)) != "0", f"host user got euid 0 from {p}"
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            parts = line.split()
            if parts[4].startswith(str(rt.home) + "/"):
                opts = set(parts[5].split(","))
                assert {"nosuid", "nodev"} <= opts, f"mount without nosuid,nodev: {parts[4]} {parts[5]}"
        assert os.stat(rt.home).st_mode & 0o077 == 0, "the dsec home is open to other users"
    finally:
        rt.kill(s.id)


# -- a caller holding a token -------------------------------------------------------------------
def _evil_erofs(where: Path) -> Path:
    tree = where / "tree"
    (tree / "bin").mkdir(parents=True)
    (tree / "marker").write_text("attacker image")
    out = where / "evil.erofs"
    subprocess.run(["mkfs.erofs", "--quiet", str(out), str(tree)], check=True, capture_output=True)
    return out


def _mounted_under(prefix: str) -> list[str]:
    return [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()
            if ln.split()[4].startswith(prefix)]


@pytest.mark.parametrize("sub", SUBSTRATES)
def test_image_is_an_identifier_not_a_path(runtime, sub, tmp_path):
    evil = _evil_erofs(tmp_path)
    names = [str(evil)[: -len(".erofs")], os.path.relpath(str(evil)[: -len(".erofs")], runtime.images.dir),
             "busybox/../busybox", "", "a" * 500, "busybox\x00"]
    for name in names:
        try:
            s = runtime.create(name, sub, SMALL)
        except DsecError as e:
            assert e.status in (400, 404) and e.field == "image", (name, e)
            continue
        runtime.kill(s.id)
        pytest.fail(f"image={name!r} was accepted")
    assert not _mounted_under(str(tmp_path)), "the attacker's image was mounted at a host path"


@pytest.mark.parametrize("sub", SUBSTRATES)
def test_replay_from_and_snapshot_id_are_identifiers(runtime, sub, tmp_path):
    """A forged log (outside the home) plus blobs the attacker uploaded: replaying it wrote a
    setuid host file outside the home."""
    from v4stack.journal import Journal

    s = runtime.create("busybox", sub, SMALL)
    target = tmp_path / "pwned"
    try:
        snap = s.snapshot()
        data = b"#!/bin/sh\necho owned\n"
        rel = os.path.relpath(target, s.rootfs.upper)
        import hashlib

        file_sha = "sha256:" + hashlib.sha256(data).hexdigest()
        entry = {"t": "file", "mode": 0o4755, "uid": 0, "gid": 0, "size": len(data), "sha": file_sha}
        delta = json.dumps([[rel, entry]], separators=(",", ":")).encode()
        s.write_files([("/workspace/a", data, 0o644), ("/workspace/b", delta, 0o644)])  # blobs via upload
        delta_digest = "sha256:" + hashlib.sha256(delta).hexdigest()
        forged = tmp_path / "forged-log"
        j = Journal(forged)
        for rec in ({"t": "create"}, {"t": "snapshot", "id": snap["id"], "seq": snap["seq"]},
                    {"t": "intent", "seq": snap["seq"] + 1, "req": "x", "idem": True, "parent": None,
                     "request": {"op": "remove", "path": "/x"}},
                    {"t": "result", "seq": snap["seq"] + 1, "exit": 0, "stdout": file_sha, "stderr": file_sha,
                     "duration": 0, "fs": "x", "delta": delta_digest, "changed": []}):
            j.append(json.dumps(rec).encode())
        j.close()
        for replay_from in (str(forged), os.path.relpath(forged, runtime.home / "logs")):
            for attempt in (lambda: s.restore(snap["id"], replay_from),
                            lambda: runtime.kill(runtime.create("busybox", sub, SMALL, snapshot=snap["id"],
                                                                replay_from=replay_from).id)):
                try:
                    attempt()
                except DsecError as e:
                    assert e.status in (400, 404, 409) and e.field == "replay_from", e
                assert not target.exists(), f"replaying a forged log ({replay_from}) wrote a host file"
        for snap_id in (str(runtime.home / "snapshots" / snap["id"]), f"../snapshots/{snap['id']}", "snap-\x00"):
            with pytest.raises(DsecError) as e:
                s.restore(snap_id)
            assert e.value.status in (400, 404) and e.value.field == "snapshot_id"
    finally:
        runtime.kill(s.id)
    assert not target.exists(), "replaying a forged log wrote a host file"


def test_sandbox_id_is_an_identifier(runtime, tmp_path):
    victim = tmp_path / "victim"
    (victim / "keep").mkdir(parents=True)
    (victim / "keep" / "file").write_text("host data")
    sid = os.path.relpath(victim, runtime.home / "run")
    for bad in (f"sbx-000000000000/rw/{'../' * 3}{os.path.relpath(victim, runtime.home)}", sid, "sbx-\x00", "."):
        try:
            s = runtime.create("busybox", "process", SMALL, sid=bad)
            runtime.kill(s.id)
        except DsecError as e:
            assert e.status == 400 and e.field == "sandbox_id"
        assert (victim / "keep" / "file").read_text() == "host data", f"sandbox_id={bad!r} deleted a host directory"
        assert not _mounted_under(str(victim))


# -- network ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sub", NET_SUBSTRATES)
def test_sandboxes_cannot_reach_each_other(runtime, sub):
    a = runtime.create("busybox", sub, SMALL, allow=["0.0.0.0/0"])
    b = runtime.create("busybox", sub, SMALL, allow=["0.0.0.0/0"])
    try:
        addr = b.exec("ip -4 -o addr show eth0")["stdout"].split()[3].split("/")[0]
        got = {}
        listener = threading.Thread(target=lambda: got.update(b.exec("nc -l -p 9000 -w 6 & sleep 5; kill %1", timeout=15)))
        listener.start()
        import time

        time.sleep(1.0)
        r = a.exec(f"echo from-a | nc -w 2 {addr} 9000; echo nc=$?; ping -c 1 -W 1 {addr}; echo ping=$?", timeout=15)
        listener.join()
        assert "from-a" not in got.get("stdout", ""), "one sandbox reached another's listener"
        assert "nc=0" not in r["stdout"]
    finally:
        runtime.kill(a.id)
        runtime.kill(b.id)
