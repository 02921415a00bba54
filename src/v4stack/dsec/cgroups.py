"""Per-sandbox cgroup limits: memory, cpu, pids (cgroup v1 hierarchies, or the v2 unified tree).

Each sandbox gets a group named ``dsec-<id>`` under the cgroup this process already lives in,
so the sandboxes are charged inside whatever budget the service itself runs under. Processes join
by writing their pid into ``cgroup.procs`` (``join_script`` gives the shell line that does it, so
a child joins before it execs, with no ``preexec_fn`` in a threaded server).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from v4stack.dsec.errors import Unsupported

ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 256 << 20
    pids: int = 128
    cpu_quota: float = 1.0  # in cores
    disk_bytes: int = 256 << 20

    def validate(self) -> "Limits":
        from v4stack.dsec.errors import BadRequest

        if not (16 << 20) <= self.memory_bytes <= (64 << 30):
            raise BadRequest(f"memory_bytes={self.memory_bytes}: allowed 16 MiB .. 64 GiB", "memory_bytes")
        if not 8 <= self.pids <= 65536:
            raise BadRequest(f"pids={self.pids}: allowed 8 .. 65536", "pids")
        if not 0.01 <= self.cpu_quota <= 64:
            raise BadRequest(f"cpu_quota={self.cpu_quota}: allowed 0.01 .. 64 cores", "cpu_quota")
        if not (1 << 20) <= self.disk_bytes <= (64 << 30):
            raise BadRequest(f"disk_bytes={self.disk_bytes}: allowed 1 MiB .. 64 GiB", "disk_bytes")
        return self


def _own_path(controller: str) -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(",") or (controller == "" and ctrls == ""):
            return path
    return "/"


def mode() -> str:
    """'v1', 'v2' or 'none' for this host."""
    if (ROOT / "memory" / "memory.limit_in_bytes").exists() and (ROOT / "pids").is_dir():
        return "v1"
    if (ROOT / "cgroup.controllers").exists():
        return "v2"
    return "none"


class Cgroup:
    """One sandbox's groups. ``create`` makes them; ``destroy`` kills what is left and removes them."""

    def __init__(self, name: str):
        self.name = name
        self.mode = mode()
        if self.mode == "none":
            raise Unsupported("no usable cgroup hierarchy under /sys/fs/cgroup")
        if self.mode == "v1":
            self.dirs = {c: ROOT / c / _own_path(c).lstrip("/") / name for c in V1_CONTROLLERS}
        else:
            self.dirs = {"unified": ROOT / _own_path("").lstrip("/") / name}

    def create(self, limits: Limits) -> "Cgroup":
        for d in self.dirs.values():
            d.mkdir(exist_ok=True)
        self.set_limits(limits)
        return self

    def ensure(self, limits: Limits) -> None:
        """Make the groups again if something outside removed them (an administrator's cleanup):
        a command must never start outside its limits, nor fail because its group is gone."""
        if not all(d.is_dir() for d in self.dirs.values()):
            self.create(limits)

    def _w(self, ctrl: str, file: str, value) -> None:
        (self.dirs[ctrl] / file).write_text(str(value))

    def set_limits(self, limits: Limits) -> None:
        period = 100_000
        if self.mode == "v1":
            sw = self.dirs["memory"] / "memory.memsw.limit_in_bytes"
            # memsw must stay >= memory: raise memsw first when growing, lower memory first when shrinking
            order = ["memory.limit_in_bytes"]
            if sw.exists():
                grow = limits.memory_bytes > int(sw.read_text())
                order = ["memory.memsw.limit_in_bytes", *order] if grow else [*order, "memory.memsw.limit_in_bytes"]
            for f in order:
                self._w("memory", f, limits.memory_bytes)
            self._w("pids", "pids.max", limits.pids)
            self._w("cpu", "cpu.cfs_period_us", period)
            self._w("cpu", "cpu.cfs_quota_us", int(limits.cpu_quota * period))
        else:
            self._w("unified", "memory.max", limits.memory_bytes)
            self._w("unified", "memory.swap.max", 0)
            self._w("unified", "pids.max", limits.pids)
            self._w("unified", "cpu.max", f"{int(limits.cpu_quota * period)} {period}")

    def join_script(self) -> str:
        """A shell line that moves the shell itself ($$) into every group of this sandbox."""
        return "; ".join(f"echo $$ > {d}/cgroup.procs" for d in self.dirs.values())

    def join(self, pid: int) -> None:
        for d in self.dirs.values():
            (d / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        d = self.dirs.get("pids") or self.dirs["unified"]
        try:
            return [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def memory_usage(self) -> int:
        if self.mode == "v1":
            return int((self.dirs["memory"] / "memory.usage_in_bytes").read_text())
        return int((self.dirs["unified"] / "memory.current").read_text())

    def oom_kills(self) -> int:
        f = self.dirs.get("memory", self.dirs.get("unified")) / ("memory.oom_control" if self.mode == "v1" else "memory.events")
        for line in f.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def freeze(self, frozen: bool) -> None:
        if self.mode == "v1":
            self._w("freezer", "freezer.state", "FROZEN" if frozen else "THAWED")
        else:
            self._w("unified", "cgroup.freeze", 1 if frozen else 0)

    def kill_all(self, exclude: tuple[int, ...] = (), timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = [p for p in self.pids() if p not in exclude]
            if not left:
                return
            for p in left:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.005)

    def destroy(self) -> None:
        if not self.dirs:
            return
        try:
            self.freeze(False)
        except OSError:
            pass
        self.kill_all()
        for d in self.dirs.values():
            for _ in range(200):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
