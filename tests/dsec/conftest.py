"""Shared fixtures: a dsec home in a temp dir, a built busybox image, a runtime; skips name why."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

import pytest

from tests.dsec.sandboxes import SMALL, SUBSTRATES


def missing_capability() -> str | None:
    if os.geteuid() != 0:
        return "dsec sandboxes need root (mounts, namespaces, cgroups)"
    for cmd in ("unshare", "mkfs.erofs", "crun", "mount"):
        if shutil.which(cmd) is None and not os.path.exists(f"/usr/sbin/{cmd}"):
            return f"{cmd} is not installed (scripts/dsec-system-deps.sh installs it)"
    fs = open("/proc/filesystems").read()
    for name in ("overlay", "erofs"):
        if name not in fs:
            r = subprocess.run(["modprobe", name], capture_output=True)
            if r.returncode != 0:
                return f"the kernel has no {name} filesystem"
    if not os.path.exists("/sys/fs/cgroup/memory/memory.limit_in_bytes") and not os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return "no cgroup hierarchy with a memory controller"
    return None


@pytest.fixture(scope="session")
def unmount():
    """The ``unmount_all`` helper, as a fixture (test modules need no import path to reach it)."""
    return unmount_all


@pytest.fixture(scope="session")
def dsec_home(tmp_path_factory):
    why = missing_capability()
    if why:
        pytest.skip(why)
    home = tmp_path_factory.mktemp("dsec-home")
    yield home
    unmount_all(home)


def unmount_all(home) -> None:
    """Lazily unmount everything mounted under ``home``, deepest first."""
    prefix = str(home) + "/"
    for _ in range(4):  # stacked mounts need one pass each
        with open("/proc/self/mountinfo") as f:
            points = {line.split()[4] for line in f if line.split()[4].startswith(prefix)}
        if not points:
            return
        for p in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", p], capture_output=True)


@pytest.fixture(scope="session")
def runtime(dsec_home):
    from v4stack.dsec.runtime import Runtime

    rt = Runtime(dsec_home, pool_size=1)
    rt.images.build("busybox")
    yield rt
    rt.close()


TOKEN = "test-token-" + "x" * 16
EDGE_TOKEN, CONTROL_TOKEN = "edge-token-" + "e" * 16, "control-token-" + "c" * 16


def _free_sock():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


class Cluster:
    def __init__(self, home: Path, unmount_all):
        from v4stack.dsec.auth import Credentials
        from v4stack.dsec.images import ImageStore
        from v4stack.dsec.watcher import Watcher

        self.home = home
        self.unmount_all = unmount_all
        self.creds = Credentials({"default": TOKEN, "other": "other-tenant-" + "o" * 16}, EDGE_TOKEN, CONTROL_TOKEN)
        self.creds.save(home / "credentials.json")
        ImageStore(home).build("busybox")
        sock = _free_sock()
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_apiserver(sock)
        self.watcher = Watcher(home, CONTROL_TOKEN, dead_after=1.0, layer_grace=0)
        self.edges: list[subprocess.Popen] = []
        self.start_edge("edge-a")
        self._env = {k: os.environ.get(k) for k in ("DSEC_API_URL", "DSEC_TOKEN")}
        os.environ["DSEC_API_URL"], os.environ["DSEC_TOKEN"] = self.url, TOKEN

    def start_edge(self, name: str) -> subprocess.Popen:
        log = open(self.home / f"{name}.out", "ab")
        p = subprocess.Popen([sys.executable, "-m", "v4stack.dsec.cli", "edge", "--home", str(self.home),
                              "--apiserver", self.url, "--id", name, "--pool", "1", "--heartbeat", "0.2"],
                             env=os.environ, stdout=log, stderr=log)
        self.edges.append(p)
        deadline = time.time() + 60
        while time.time() < deadline:
            rows = self.api().get("/v1/edges").json() if self.server.started else []
            if any(r["id"] == name and r["state"] == "alive" for r in rows):
                return p
            time.sleep(0.1)
        raise RuntimeError(f"edge {name} did not register: {(self.home / f'{name}.out').read_text()[-2000:]}")

    def start_apiserver(self, sock=None) -> None:
        """(Re)start the apiserver on the same port and database, as a restarted process would."""
        import uvicorn

        from v4stack.dsec.apiserver import make_app

        if sock is None:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self.port))
        self.server = uvicorn.Server(uvicorn.Config(make_app(self.home, self.creds), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)

    def stop_apiserver(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    def store_edge_url(self, name: str = "edge-a") -> str:
        return self.server.config.app.state.store.edge(name)["url"]

    def api(self, token: str = TOKEN) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {token}"})

    def close(self) -> None:
        from v4stack.dsec.cgroups import Cgroup

        for p in self.edges:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.server.should_exit = True
        self.thread.join(10)
        for name in self.own_groups():  # a SIGKILLed edge leaves its groups behind
            Cgroup(name).destroy()
        self.unmount_all(self.home)
        for k, v in self._env.items():  # the cluster's address must not outlive it (later tests read it)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def own_groups(self) -> list[str]:
        """This cluster's cgroups only: its edges' workers and its sandboxes (never anyone else's)."""
        mine = {f"dsec-{r['id']}" for r in self.server.config.app.state.store.sandboxes()}
        pids = tuple(f"dsec-w{p.pid}-" for p in self.edges)
        return [d.name for d in Path("/sys/fs/cgroup/pids").glob("dsec-*") if d.name in mine or d.name.startswith(pids)]


@pytest.fixture(scope="module")
def cluster(dsec_home, tmp_path_factory):
    """apiserver (in-process, real HTTP) + one edge subprocess + a watcher, on a fresh home."""
    c = Cluster(tmp_path_factory.mktemp("dsec-cluster"), unmount_all)
    yield c
    c.close()


@pytest.fixture(params=SUBSTRATES)
def sbx(runtime, request):
    s = runtime.create("busybox", request.param, SMALL)
    yield s
    runtime.kill(s.id)
