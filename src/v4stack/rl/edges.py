"""Sandbox edges as fleet members: each DSec edge process is owned by an ``EdgeHost``.

An ``EdgeHost`` starts one DSec edge (``v4stack dsec edge``) as its child on the host it runs on,
reports its health and address, SIGKILLs it on request (fault injection) and, through ``ensure``,
starts a new incarnation (a new edge id, so the apiserver never mistakes it for the dead one)
when the last one died. The edge dies with its owner (parent-death signal), so a SIGKILLed owner
leaves no edge serving behind it.

``RayEdges`` makes every ``EdgeHost`` a Ray actor, spread over the cluster's nodes
(``SPREAD``; ``resource`` pins them to nodes that advertise a custom resource, e.g. the hosts
allowed to run sandboxes), so sandboxes run on other hosts than the driver. Off the loopback the
edge binds its node's address. DSec keeps sandbox state on shared storage: ``home`` must name the
same directory on every node (the apiserver reads trajectory logs from it); an owner that does not
find the home's credentials says so. ``LocalEdges`` keeps the owners in this process (the edges
are its children): the ``--no-ray`` fleet and the tests' embedded DSec.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx


def _loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def node_address() -> str:
    """This host's address as the cluster sees it (Ray's own answer when Ray is running)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
        return s.getsockname()[0]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


class EdgeHost:
    """The owner of one DSec edge process (the body of an edge actor)."""

    def __init__(self, name: str, home: str, apiserver: str, pool: int = 2, heartbeat: float = 0.3,
                 start_timeout: float = 60.0):
        self.name, self.home, self.api = name, Path(home), apiserver.rstrip("/")
        self.pool, self.heartbeat, self.start_timeout = pool, heartbeat, start_timeout
        creds = self.home / "credentials.json"
        if not creds.exists():
            raise RuntimeError(f"edge {name}: DSec home {self.home} has no credentials.json on host "
                               f"{socket.gethostname()}: edges need the apiserver's home on shared storage")
        self.tenant_token = next(iter(json.loads(creds.read_text())["tenants"].values()))
        self.host = "127.0.0.1" if _loopback(self.api) else node_address()
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0
        self.edge_id = self.url = ""
        self.start()

    def start(self) -> dict:
        """Start a new edge incarnation and wait until the apiserver lists it alive."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"edge {self.edge_id} is still running")
        self.incarnation += 1
        self.edge_id = f"{self.name}-{os.getpid()}-{self.incarnation}"
        port = _free_port(self.host)
        self.url = f"http://{self.host}:{port}"
        log = open(self.home / f"{self.edge_id}.out", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "v4stack.dsec.cli", "edge", "--home", str(self.home), "--apiserver", self.api,
             "--id", self.edge_id, "--host", self.host, "--port", str(port), "--pool", str(self.pool),
             "--heartbeat", str(self.heartbeat)], stdout=log, stderr=log, preexec_fn=_die_with_parent)
        log.close()
        deadline = time.time() + self.start_timeout
        while time.time() < deadline:
            h = self.health()
            if not h["alive"]:
                break
            if h["registered"]:
                return h
            time.sleep(0.1)
        tail = (self.home / f"{self.edge_id}.out").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"edge {self.edge_id} did not register with {self.api}: {tail}")

    def health(self) -> dict:
        """Process alive, its HTTP endpoint answering, and the apiserver listing it alive."""
        alive = self.proc is not None and self.proc.poll() is None
        serving = registered = False
        if alive:
            try:
                serving = httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
                rows = httpx.get(f"{self.api}/v1/edges", timeout=5,
                                 headers={"Authorization": f"Bearer {self.tenant_token}"}).json()
                registered = any(r["id"] == self.edge_id and r["state"] == "alive" for r in rows)
            except httpx.HTTPError:
                pass
        return {"name": self.name, "id": self.edge_id, "pid": self.proc.pid if self.proc else None, "alive": alive,
                "serving": serving, "registered": registered, "url": self.url, "host": socket.gethostname(),
                "incarnation": self.incarnation}

    def address(self) -> str:
        return self.url

    def node(self) -> str | None:
        """The Ray node this owner runs on (None outside Ray)."""
        try:
            import ray

            return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        except Exception:
            return None

    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def owner_pid(self) -> int:
        return os.getpid()

    def kill(self) -> dict:
        """SIGKILL the edge process (fault injection); -> the killed edge's id and pid."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        return {"id": self.edge_id, "pid": self.proc.pid}

    def ensure(self) -> dict:
        """A serving edge: the current one, or a new incarnation when it died."""
        if self.proc is None or self.proc.poll() is not None:
            return self.start()
        return self.health()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        from v4stack.rl.sandboxes import _cleanup

        _cleanup(self.home)  # what a killed incarnation left on this host


class LocalEdges:
    """Edge owners in this process."""

    def __init__(self, names: list[str], home: str, apiserver: str, pool: int = 2):
        self.hosts = {n: EdgeHost(n, home, apiserver, pool) for n in names}
        self.names = list(names)

    def call(self, name: str, method: str, *args):
        return getattr(self.hosts[name], method)(*args)

    def close(self) -> None:
        for h in self.hosts.values():
            h.stop()


class RayEdges:
    """Edge owners as Ray actors, spread over the cluster (a restarted actor starts a new edge)."""

    def __init__(self, names: list[str], home: str, apiserver: str, pool: int = 2, resource: str | None = None):
        import ray

        self.ray = ray
        opts = {"num_cpus": 0, "max_restarts": -1, "scheduling_strategy": "SPREAD"}
        if resource:
            opts["resources"] = {resource: 1}
        E = ray.remote(EdgeHost).options(**opts)
        self.actors = {n: E.remote(n, home, apiserver, pool) for n in names}
        self.names = list(names)
        ray.get([a.health.remote() for a in self.actors.values()])  # each registered (or raise)

    def call(self, name: str, method: str, *args):
        return self.ray.get(getattr(self.actors[name], method).remote(*args))

    def close(self) -> None:
        try:
            self.ray.get([a.stop.remote() for a in self.actors.values()], timeout=60)
        except Exception:
            pass
        for a in self.actors.values():
            try:
                self.ray.kill(a)
            except Exception:
                pass
