"""Real attacks inside real sandboxes; each asserts the host is untouched and the attack failed."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import uuid

import pytest

from v4stack.dsec.cgroups import Limits
from v4stack.dsec.errors import NotFound

SUBSTRATES = ["process", "container"]


@pytest.fixture(params=SUBSTRATES)
def sbx(runtime, request):
    s = runtime.create("busybox", request.param, Limits(memory_bytes=64 << 20, pids=64, disk_bytes=16 << 20))
    yield s
    runtime.kill(s.id)


def test_host_files_are_out_of_reach(sbx, tmp_path):
    secret = tmp_path / f"secret-{uuid.uuid4().hex}"
    secret.write_text("host secret")
    marker = f"/tmp/dsec-escape-{uuid.uuid4().hex}"
    r = sbx.exec(f"cat {secret}; ls /work /root/.cache 2>&1; echo pwned > {marker}; cat /proc/1/root{secret} 2>&1; "
                 "ls /")
    assert "host secret" not in r["stdout"]
    assert not os.path.exists(marker)  # the write landed in the sandbox's own /tmp
    assert sbx.files.read(marker) == b"pwned\n"
    assert set(r["stdout"].split()) >= {"bin", "etc", "workspace"} and "work" not in r["stdout"].split()


def test_host_processes_are_invisible_and_unkillable(sbx):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        r = sbx.exec(f"ls /proc | grep -c '^[0-9]'; kill -9 {victim.pid}; echo rc=$?; kill -9 1; echo rc1=$?")
        assert int(r["stdout"].split()[0]) <= 4  # only the sandbox's own few processes
        assert victim.poll() is None, "a host process was killed from inside"
        assert str(victim.pid) not in sbx.exec("ps -o pid")["stdout"].split()
    finally:
        victim.kill()
        victim.wait()


def test_no_privileges_mount_modules_raw_sockets(sbx):
    r = sbx.exec("grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status; "
                 "mount -t tmpfs none /tmp; echo mount=$?; "
                 "head -c 64 /dev/zero > /tmp/x.ko; insmod /tmp/x.ko; echo insmod=$?; "
                 "ping -c 1 -W 1 127.0.0.1; echo ping=$?; "
                 "echo 1 > /proc/sys/kernel/sysrq; echo sysrq=$?; "
                 "unshare -U true; echo userns=$?; unshare -r -m true; echo userns_mnt=$?")
    out = r["stdout"]
    for line in out.splitlines():
        if line.startswith("Cap"):
            assert line.split()[1] == "0000000000000000", line
    for verb in ("mount", "insmod", "ping", "sysrq", "userns", "userns_mnt"):
        assert f"{verb}=0" not in out, f"{verb} succeeded inside the sandbox:\n{out}\n{r['stderr']}"
    assert "tmpfs on /tmp" not in sbx.exec("mount")["stdout"]


def test_no_egress_to_a_host_listener(sbx):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    hits = []

    def accept():
        try:
            hits.append(srv.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    try:
        r = sbx.exec(f"echo hi | nc -w 1 127.0.0.1 {port}; echo nc=$?; ip route; ip -o link | wc -l", timeout=10)
        t.join()
        assert not hits, "the sandbox reached a listener on the host's loopback"
        assert "nc=0" not in r["stdout"] and "default" not in r["stdout"]
        assert r["stdout"].strip().splitlines()[-1] == "1"  # loopback only
    finally:
        srv.close()


def test_fork_bomb_hits_the_pids_limit(sbx):
    sbx.exec("bomb() { bomb | bomb & }; bomb; sleep 2; echo done", timeout=8)
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork
    after = sbx.exec("echo alive")
    assert after["stdout"] == "alive\n"
    assert sbx.handle.cgroup.pids() == []  # nothing of the bomb outlives its command


def test_memory_bomb_is_killed_inside(sbx):
    r = sbx.exec("awk 'BEGIN { s = \"xxxxxxxxxxxxxxxx\"; while (1) s = s s }'", timeout=20)
    assert r["oom_killed"] and r["exit_code"] != 0
    assert sbx.exec("echo alive")["stdout"] == "alive\n"
    # many mid-sized hogs at once: the OOM killer must take hogs, not the sandbox's own machinery
    r = sbx.exec("for i in 1 2 3 4 5 6; do awk 'BEGIN { s = \"x\"; for (i = 0; i < 24; i++) s = s s; "
                 "for (j = 0; j < 300000; j++) {} }' & done; wait", timeout=20)
    assert not r["timed_out"]
    assert sbx.exec("echo alive")["stdout"] == "alive\n"


def test_disk_quota(sbx):
    r = sbx.exec("dd if=/dev/zero of=/workspace/big bs=1M count=64 2>&1; echo dd=$?")
    assert "No space left" in r["stdout"] and "dd=0" not in r["stdout"]
    assert os.statvfs(sbx.rootfs.rw).f_blocks * os.statvfs(sbx.rootfs.rw).f_frsize <= 16 << 20
    sbx.exec("rm /workspace/big")
    assert sbx.exec("echo ok > /workspace/small && cat /workspace/small")["stdout"] == "ok\n"


def test_files_api_path_traversal_stays_in_root(sbx, tmp_path):
    host = tmp_path / f"host-{uuid.uuid4().hex}"
    host.write_text("host data")
    sbx.exec(f"ln -s / /workspace/rootlink; ln -s {host} /workspace/hostfile; ln -s ../../../../.. /workspace/up")
    assert sbx.files.read("../../../../etc/hostname") == b"sandbox\n"
    assert sbx.files.read("/workspace/up/etc/hostname") == b"sandbox\n"
    with pytest.raises(NotFound):
        sbx.files.read("/workspace/hostfile")  # names the sandbox's own (absent) path
    name = f"pwned-{uuid.uuid4().hex}"
    sbx.files.write(f"/workspace/rootlink/tmp/{name}", b"x")
    sbx.files.write(f"/workspace/up/workspace/up/tmp/{name}.2", b"x")
    assert not os.path.exists(f"/tmp/{name}") and not os.path.exists(f"/tmp/{name}.2")
    assert sbx.exec(f"ls /tmp/{name} /tmp/{name}.2")["exit_code"] == 0
    assert host.read_text() == "host data"


def test_cpu_quota_throttles(runtime):
    s = runtime.create("busybox", "process", Limits(cpu_quota=0.05))
    try:
        s.exec("i=0; while [ $i -lt 60000 ]; do i=$((i+1)); done", timeout=60)
        cg = s.handle.cgroup
        if cg.mode == "v1":
            stat = dict(line.split() for line in (cg.dirs["cpu"] / "cpu.stat").read_text().splitlines())
        else:
            stat = dict(line.split() for line in (cg.dirs["unified"] / "cpu.stat").read_text().splitlines())
        assert int(stat["nr_throttled"]) > 0, stat
    finally:
        runtime.kill(s.id)
