"""The process substrate: a pre-warmed pool of namespaced workers - the fastest path.

Each worker is started ahead of need as ``unshare --pid --mount --net --ipc --uts`` (slave mount
propagation, so a sandbox root mounted later on the host under the shared ``run/`` directory
appears inside) and is already in its own cgroup. ``create`` takes a worker from the pool, sets the
sandbox's limits on that cgroup and refills the pool in the background.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from v4stack.dsec.cgroups import Cgroup, Limits
from v4stack.dsec.errors import DsecError, Unavailable
from v4stack.dsec.mounts import make_shared, need
from v4stack.dsec.substrates.base import Collector, ExecResult, Handle, OnOutput, Substrate


def home_tag(home: Path) -> str:
    """Six hex digits naming a dsec home in the cgroup names of its workers."""
    import hashlib

    return hashlib.sha256(str(Path(home).resolve()).encode()).hexdigest()[:6]


class Worker:
    def __init__(self, name: str, logdir: Path):
        self.name = name
        self.cgroup = Cgroup(f"dsec-{name}").create(Limits())
        unshare = need("unshare")
        # the worker itself stays outside the sandbox's cgroup (a memory or fork bomb inside must hit
        # the bomb, not the process that serves the sandbox); each command joins it before exec
        cmd = (f"exec {unshare} --pid --fork --kill-child --mount --propagation slave "
               f"--net --ipc --uts {sys.executable} -m v4stack.dsec.substrates.worker")
        self.proc = subprocess.Popen(["sh", "-c", cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                     stderr=open(logdir / f"{name}.log", "ab"), start_new_session=True)
        self.lock = threading.Lock()
        self._buf = b""

    def wait_ready(self, timeout: float = 30) -> None:
        line = self._readline(timeout)
        if not line or "ready" not in json.loads(line):
            raise Unavailable(f"process worker {self.name} did not start")

    def _readline(self, timeout: float) -> bytes:
        """One line from the worker, reading the raw pipe (a buffered reader would hide lines from select)."""
        import select

        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return b""
            data = os.read(fd, 65536)
            if not data:
                return b""
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return line + b"\n"

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.cgroup.destroy()


class ProcessSubstrate(Substrate):
    name = "process"

    def __init__(self, home: Path, pool_size: int = 2):
        self.home = home
        make_shared(home / "run")
        self.logdir = home / "workers"
        self.logdir.mkdir(exist_ok=True)
        self.pool: queue.Queue[Worker] = queue.Queue()
        self.pool_size = pool_size
        self._n = 0
        self._nlock = threading.Lock()
        self._closed = False
        self._refill_lock = threading.Lock()
        threading.Thread(target=self._refill, daemon=True).start()

    def _spawn(self) -> Worker:
        with self._nlock:  # one spawn at a time: concurrent spawns lost their stdin pipes' requests
            self._n += 1
            # the pid and the home's tag say whose it is (orphan reclaim looks at its own home's
            # only); the random part keeps two runtimes of one process from sharing a cgroup name
            w = Worker(f"w{os.getpid()}-{home_tag(self.home)}{self._n}{os.urandom(3).hex()}", self.logdir)
            w.wait_ready()
            return w

    def _refill(self) -> None:
        with self._refill_lock:
            while not self._closed and self.pool.qsize() < self.pool_size:
                try:
                    w = self._spawn()
                except DsecError:
                    return
                if self._closed:  # closed while it started: never leave it behind
                    w.kill()
                    return
                self.pool.put(w)

    def create(self, handle: Handle) -> None:
        try:
            w = self.pool.get_nowait()
        except queue.Empty:
            w = self._spawn()
        threading.Thread(target=self._refill, daemon=True).start()
        try:
            w.cgroup.ensure(handle.limits)
            w.cgroup.set_limits(handle.limits)
        except BaseException:
            w.kill()
            raise
        handle.cgroup = w.cgroup
        handle.state["worker"] = w

    def exec(self, handle: Handle, argv, cwd, env, timeout, on_output: OnOutput | None = None) -> ExecResult:
        w: Worker = handle.state["worker"]
        col = Collector(on_output)
        w.cgroup.ensure(handle.limits)
        oom0 = w.cgroup.oom_kills()
        with w.lock:
            if w.proc.poll() is not None:
                raise Unavailable(f"sandbox {handle.sandbox}: its worker has exited", "sandbox_id")
            req = {"op": "exec", "root": str(handle.rootfs.root), "argv": argv, "cwd": cwd, "env": env,
                   "timeout": timeout, "cgroups": [str(d / "cgroup.procs") for d in w.cgroup.dirs.values()]}
            w.proc.stdin.write((json.dumps(req) + "\n").encode())
            w.proc.stdin.flush()
            while True:
                line = w._readline(timeout + 30)
                if not line:
                    w.kill()
                    raise Unavailable(f"sandbox {handle.sandbox}: worker stopped answering", "sandbox_id")
                msg = json.loads(line)
                if "fd" in msg:
                    col.add(msg["fd"], base64.b64decode(msg["data"]))
                    continue
                break
        if "error" in msg:
            col.add("stderr", msg["error"].encode())
        return ExecResult(msg["exit"], bytes(col.buf["stdout"]), bytes(col.buf["stderr"]), msg.get("duration", 0.0),
                          msg.get("timed_out", False), w.cgroup.oom_kills() > oom0, col.truncated)

    def unmounting(self, handle: Handle) -> None:
        w: Worker = handle.state["worker"]
        with w.lock:
            if w.proc.poll() is not None:
                return
            w.proc.stdin.write((json.dumps({"op": "release", "root": str(handle.rootfs.root)}) + "\n").encode())
            w.proc.stdin.flush()
            w._readline(30)

    def destroy(self, handle: Handle) -> None:
        w = handle.state.pop("worker", None)
        if w is not None:
            w.kill()

    def close(self) -> None:
        self._closed = True
        with self._refill_lock:  # a refill in progress finishes (and sees _closed) first
            pass
        while True:
            try:
                self.pool.get_nowait().kill()
            except queue.Empty:
                break
