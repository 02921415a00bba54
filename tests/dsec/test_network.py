"""Egress: none by default; with an allow-list, exactly the listed CIDRs. The far end is a test host
in a network namespace this test makes itself (nothing outside this machine is ever contacted)."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from v4stack.dsec.errors import BadRequest

SERVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.252.0.2", 8080)); s.listen(8); s.settimeout(1.0)
print("ready", flush=True)
end = time.time() + 60
while time.time() < end:
    try:
        c, a = s.accept()
    except OSError:
        continue
    c.settimeout(2)
    try:
        print("got", c.recv(100).decode().strip(), flush=True)
    except OSError:
        pass
    c.close()
"""


@pytest.fixture
def testhost(runtime):
    from v4stack.dsec.netns import UPLINK, ensure_uplink

    ensure_uplink()
    ns, veth = f"dsec-th-{uuid.uuid4().hex[:6]}", f"th{uuid.uuid4().hex[:6]}"
    ip = ["ip"]
    for args in (["netns", "add", ns], ["-n", ns, "link", "set", "lo", "up"],
                 ["-n", UPLINK, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns],
                 ["-n", UPLINK, "addr", "add", "10.252.0.1/30", "dev", veth], ["-n", UPLINK, "link", "set", veth, "up"],
                 ["-n", ns, "addr", "add", "10.252.0.2/30", "dev", "eth0"], ["-n", ns, "link", "set", "eth0", "up"],
                 ["-n", ns, "route", "add", "10.251.0.0/16", "via", "10.252.0.1"]):
        subprocess.run(ip + args, check=True, capture_output=True)
    srv = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    assert srv.stdout.readline().strip() == "ready"
    yield srv
    srv.kill()
    srv.wait()
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _hits(srv) -> list[str]:
    srv.kill()
    return [ln.split(" ", 1)[1].strip() for ln in srv.stdout.read().splitlines() if ln.startswith("got")]


def test_allow_list_reaches_only_listed_networks(runtime, testhost):
    allowed = runtime.create("busybox", "container", allow=["10.252.0.2/32"])
    other = runtime.create("busybox", "container", allow=["10.252.0.0/31"])
    closed = runtime.create("busybox", "container")
    try:
        send = "echo {} | nc -w 2 10.252.0.2 8080; echo nc=$?"
        a = allowed.exec(send.format("from-allowed"), timeout=15)
        o = other.exec(send.format("from-other"), timeout=15)
        c = closed.exec(send.format("from-closed"), timeout=15)
        r = allowed.exec("ip route; ip route add default via 10.251.0.1; echo add=$?")
        assert "nc=0" in a["stdout"], a
        assert "nc=0" not in o["stdout"] and "nc=0" not in c["stdout"]
        assert "default" not in r["stdout"].split("add=")[0] and "add=0" not in r["stdout"]
    finally:
        for s in (allowed, other, closed):
            runtime.kill(s.id)
    assert _hits(testhost) == ["from-allowed"]
    for s in (allowed, other):
        assert not subprocess.run(["ip", "netns", "pids", f"dsec-{s.id}"], capture_output=True).returncode == 0


def test_allow_list_input_is_checked(runtime):
    with pytest.raises(BadRequest) as e:
        runtime.create("busybox", "container", allow=["10.0.0.0/33"])
    assert e.value.field == "network.allow[0]"
    with pytest.raises(BadRequest) as e:
        runtime.create("busybox", "process", allow=["10.0.0.0/8"])
    assert e.value.field == "network.allow"
