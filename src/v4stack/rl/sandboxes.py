"""The sandbox side of the loop: a local DSec (apiserver and watcher in this process, edges owned
by fleet members: ``edges.py``) and a tool runner that executes a trajectory's commands in DSec
sandboxes.

``LocalDsec`` is the embedded default; with ``DSEC_API_URL`` set the loop uses that apiserver
instead and starts nothing. ``ToolRunner`` keeps one process-substrate sandbox per rollout slot
and runs every command through the client SDK (``v4stack.dsec.client.Sandbox``); a call that
fails because its edge died is re-run on a fresh sandbox (the tasks' commands are pure, so a
re-run gives the same observation), and the failure is counted.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


class LocalDsec:
    """apiserver and watcher (threads of this process) over one home, and ``edges`` edges: Ray
    actors spread over the cluster when ``ray_edges``, else children of this process. ``host``:
    the address the apiserver binds (a cluster's edges and rollout actors must reach it)."""

    def __init__(self, home: str | os.PathLike, edges: int = 1, pool: int = 2, host: str = "127.0.0.1",
                 ray_edges: bool = False, edge_resource: str | None = None):
        import uvicorn

        from v4stack.dsec.apiserver import make_app
        from v4stack.dsec.auth import Credentials
        from v4stack.dsec.images import ImageStore
        from v4stack.rl.edges import LocalEdges, RayEdges

        self.home = Path(home).resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        creds = Credentials.ensure(self.home)  # <home>/credentials.json: the edges read it too
        self.token = next(iter(creds.tenants.values()))  # the loop is one tenant's client
        self.pool = pool
        ImageStore(self.home).build("busybox")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(make_app(self.home, creds), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        from v4stack.dsec.watcher import Watcher

        self.watcher = Watcher(self.home, creds.control, dead_after=1.5, layer_grace=0)
        threading.Thread(target=self.watcher.run, args=(0.5,), daemon=True).start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)
        names = [f"edge-{i}" for i in range(edges)]
        self.edges = (RayEdges(names, str(self.home), self.url, pool, edge_resource) if ray_edges
                      else LocalEdges(names, str(self.home), self.url, pool))

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {self.token}"})

    def kill_edge(self, name: str) -> dict:
        """SIGKILL edge ``name``'s process (fault injection); -> the dead edge's id and pid."""
        return self.edges.call(name, "kill")

    def ensure_edge(self, name: str) -> dict:
        """Edge ``name`` serving again (a new incarnation when it died); -> its health."""
        return self.edges.call(name, "ensure")

    def close(self) -> None:
        self.edges.close()
        self.watcher.stop.set()
        self.server.should_exit = True
        self.thread.join(10)
        _cleanup(self.home)


def _cleanup(home: Path) -> None:
    """What a SIGKILLed edge leaves behind: this home's sandboxes' cgroups, crun state, network
    namespaces and mounts (DSec's own orphan reclaim; other DSec homes on the host are not touched)."""
    try:
        from v4stack.dsec.runtime import reclaim_orphans

        reclaim_orphans(Path(home))
    except Exception:
        pass
    prefix = str(Path(home).resolve()) + "/"
    for _ in range(4):
        with open("/proc/self/mountinfo") as f:
            points = {line.split()[4] for line in f if line.split()[4].startswith(prefix)}
        if not points:
            return
        for p in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", p], capture_output=True)


@dataclass
class ToolStats:
    calls: int = 0
    retried: int = 0
    failed: int = 0
    seconds: float = 0.0
    sandboxes: int = 0
    errors: list[str] = field(default_factory=list)


class ToolRunner:
    """Runs commands in process-substrate sandboxes through the client SDK.

    ``reserve`` hands out a sandbox and the sequence number its log will give the next call (the
    caller writes that into its TOOL_CALL record first); ``run`` executes with that number;
    ``replay`` asks a sandbox again for a logged call (its log answers without re-running), or
    re-runs on a fresh sandbox when that one is gone.
    """

    def __init__(self, api_url: str, token: str, slots: int = 4, timeout: float = 10.0):
        self.api_url, self.token, self.timeout = api_url, token, timeout
        self._free: list = []
        self._next: dict[str, int] = {}
        self._lock = threading.Lock()
        self.slots = slots
        self.stats = ToolStats()

    def _new(self, attempts: int = 6):
        """A fresh sandbox. A 503 (the apiserver placed it on an edge that just died and that the
        watcher has not marked dead yet) is retried with a growing pause (7.5 s in all)."""
        from v4stack.dsec.client import Sandbox, SandboxError

        for i in range(attempts):
            try:
                sbx = Sandbox.create(substrate="process", api_url=self.api_url, token=self.token, timeout=3600,
                                     idle_timeout=600, request_timeout=30)
                break
            except SandboxError as e:
                if e.status != 503 or i == attempts - 1:
                    raise
                self.stats.errors.append(str(e)[:200])
                time.sleep(0.5 * (i + 1))
        self.stats.sandboxes += 1
        self._next[sbx.id] = 0
        return sbx

    def reserve(self):
        with self._lock:
            sbx = self._free.pop() if self._free else None
        if sbx is None:
            sbx = self._new()
        return sbx, sbx.id, self._next[sbx.id]

    def _give(self, sbx) -> None:
        with self._lock:
            if len(self._free) < self.slots:
                self._free.append(sbx)
                return
        self._drop(sbx)

    @staticmethod
    def _drop(sbx) -> None:
        try:
            sbx.kill()
        except Exception:
            pass

    def _exec(self, sbx, cmd: str, seq: int | None):
        r = sbx.commands.run(["sh", "-c", cmd], timeout=self.timeout, idempotent=True, seq=seq)
        self._next[sbx.id] = max(self._next.get(sbx.id, 0), r.seq + 1)
        return r

    def _fresh(self, cmd: str) -> tuple[str, str]:
        from v4stack.dsec.client import SandboxError

        self.stats.retried += 1
        for attempt in range(3):  # placement may pick a dead edge until the watcher has marked it
            sbx = None
            try:
                sbx = self._new()
                r = self._exec(sbx, cmd, None)
            except SandboxError as e:
                self.stats.errors.append(str(e)[:200])
                if sbx is not None:
                    self._drop(sbx)
                time.sleep(0.5 * (attempt + 1))
                continue
            self._give(sbx)
            return r.stdout, "rerun"
        self.stats.failed += 1
        return "", "rerun"

    def run(self, sbx, seq: int, cmd: str) -> tuple[str, str]:
        """-> (stdout, how): 'ran', or 'rerun' on a fresh sandbox when ``sbx`` failed."""
        from v4stack.dsec.client import SandboxError

        t0 = time.perf_counter()
        self.stats.calls += 1
        try:
            r = self._exec(sbx, cmd, seq)
            self._give(sbx)
            out = (r.stdout, "fast_forward" if r.fast_forward else "ran")
        except SandboxError as e:  # its edge died or it was reclaimed: never handed out again
            self.stats.errors.append(str(e)[:200])
            out = self._fresh(cmd)
        self.stats.seconds += time.perf_counter() - t0
        return out

    def replay(self, sandbox: str, seq: int, cmd: str) -> tuple[str, str]:
        """A logged call whose answer the caller lost: from the sandbox's log, else re-run."""
        from v4stack.dsec.client import Sandbox, SandboxError

        self.stats.calls += 1
        try:
            sbx = Sandbox.connect(sandbox, api_url=self.api_url, token=self.token)
            self._next.setdefault(sbx.id, seq)
            r = self._exec(sbx, cmd, seq)
            return r.stdout, "fast_forward" if r.fast_forward else "ran"
        except SandboxError as e:
            self.stats.errors.append(str(e)[:200])
            return self._fresh(cmd)

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for s in free:
            try:
                s.kill()
            except Exception:
                pass
