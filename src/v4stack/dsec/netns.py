"""Sandbox networking for the container substrate: no egress by default, a CIDR allow-list option.

Without an allow-list a sandbox's commands get a fresh network namespace with loopback only.
With one, the sandbox gets a persistent namespace ``dsec-<id>`` whose ``eth0`` is a veth into the
edge's uplink namespace ``dsec-uplink`` (made here, forwarding on inside it only), and one route
per allowed CIDR - no default route, and no capability inside to add one. The host's own network
configuration is never changed: connecting the uplink namespace to the outside (a veth to the
host plus NAT) is a deployment step of the edge host.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import subprocess
from pathlib import Path

from v4stack.dsec.errors import BadRequest
from v4stack.dsec.mounts import need

UPLINK = "dsec-uplink"
POOL = ipaddress.ip_network("10.251.0.0/16")  # only ever inside namespaces made here


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([need("ip"), *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def parse_allow(raw) -> list[str]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > 64:
        raise BadRequest("network.allow: a list of at most 64 CIDRs", "network.allow")
    out = []
    for i, c in enumerate(raw):
        try:
            net = ipaddress.ip_network(str(c), strict=False)
        except ValueError:
            raise BadRequest(f"network.allow[{i}]={c!r}: not a CIDR (like 192.0.2.0/24)", f"network.allow[{i}]") from None
        if net.version != 4:
            raise BadRequest(f"network.allow[{i}]={c!r}: only IPv4 CIDRs are supported", f"network.allow[{i}]")
        out.append(str(net))
    return out


ISOLATION_PREF = "100"


def ensure_uplink() -> None:
    """The uplink namespace, forwarding on, and one policy rule that drops every packet from a
    sandbox address to a sandbox address: sandboxes never reach each other, whatever their
    allow-lists (the rule sits before the routing tables, so no allowed route can override it)."""
    if not Path(f"/run/netns/{UPLINK}").exists():
        _ip("netns", "add", UPLINK, check=False)
        _ip("-n", UPLINK, "link", "set", "lo", "up")
    rule = ["from", str(POOL), "to", str(POOL)]
    if f"from {POOL} to {POOL}" not in _ip("-n", UPLINK, "rule", "show").stdout:
        _ip("-n", UPLINK, "rule", "add", "pref", ISOLATION_PREF, *rule, "prohibit")
    subprocess.run([need("ip"), "netns", "exec", UPLINK, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"],
                   capture_output=True, check=True)


class Allocator:
    """Hands out /30 subnets of POOL to sandboxes, in a locked JSON file on the edge host."""

    def __init__(self, home: Path):
        self.path = home / "net" / "alloc.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _edit(self, fn):
        fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            table = json.loads(self.path.read_text()) if self.path.exists() else {}
            out = fn(table)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(table))
            os.rename(tmp, self.path)
            return out
        finally:
            os.close(fd)

    def take(self, sid: str) -> int:
        def fn(t):
            used = set(t.values())
            for i in range(POOL.num_addresses // 4):
                if i not in used:
                    t[sid] = i
                    return i
            raise BadRequest("network: no free sandbox subnet on this edge", "network")

        return self._edit(fn)

    def give_back(self, sid: str) -> None:
        self._edit(lambda t: t.pop(sid, None))


class SandboxNet:
    def __init__(self, home: Path, sid: str):
        self.home, self.sid = home, sid
        self.ns = f"dsec-{sid}"[:40]
        self.path = f"/run/netns/{self.ns}"

    def create(self, allow: list[str]) -> None:
        ensure_uplink()
        idx = Allocator(self.home).take(self.sid)
        base = int(POOL.network_address) + 4 * idx
        up_addr, sbx_addr = ipaddress.ip_address(base + 1), ipaddress.ip_address(base + 2)
        veth = f"du{idx:05x}"
        try:
            _ip("netns", "add", self.ns)
            _ip("-n", self.ns, "link", "set", "lo", "up")
            _ip("-n", UPLINK, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
            _ip("-n", UPLINK, "addr", "add", f"{up_addr}/30", "dev", veth)
            _ip("-n", UPLINK, "link", "set", veth, "up")
            _ip("-n", self.ns, "addr", "add", f"{sbx_addr}/30", "dev", "eth0")
            _ip("-n", self.ns, "link", "set", "eth0", "up")
            for cidr in allow:
                _ip("-n", self.ns, "route", "add", cidr, "via", str(up_addr))
        except OSError:
            self.destroy()
            raise

    def destroy(self) -> None:
        _ip("netns", "del", self.ns, check=False)  # the veth pair goes with it
        Allocator(self.home).give_back(self.sid)
