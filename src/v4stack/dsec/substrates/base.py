"""The substrate interface. A substrate runs commands in an isolated view of a mounted root.

The root filesystem (image, layers, upper) belongs to ``rootfs.Rootfs`` and is the same for every
substrate, so files, snapshot and restore work on it directly; a substrate provides the isolation
(namespaces, cgroup, capabilities) and ``create / exec / remount / destroy``. Commands do not
outlive their ``exec``: whatever they leave running is killed when they finish, so a sandbox's
state is its filesystem, which is exactly what the trajectory log and snapshots capture.
"""

from __future__ import annotations

import base64
import selectors
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

from v4stack.dsec.cgroups import Cgroup, Limits
from v4stack.dsec.rootfs import Rootfs

OUTPUT_CAP = 1 << 20
OnOutput = Callable[[str, bytes], None]


@dataclass
class ExecResult:
    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    duration: float = 0.0
    timed_out: bool = False
    oom_killed: bool = False
    truncated: bool = False


@dataclass
class Handle:
    sandbox: str
    rootfs: Rootfs
    cgroup: Cgroup
    limits: Limits
    state: dict = field(default_factory=dict)


class Collector:
    """Keeps up to OUTPUT_CAP bytes per stream and forwards every chunk to ``on_output``."""

    def __init__(self, on_output: OnOutput | None):
        self.buf = {"stdout": bytearray(), "stderr": bytearray()}
        self.truncated = False
        self.on_output = on_output

    def add(self, stream: str, data: bytes) -> None:
        b = self.buf[stream]
        room = OUTPUT_CAP - len(b)
        if len(data) > room:
            self.truncated = True
        b += data[: max(room, 0)]
        if self.on_output and room > 0:
            self.on_output(stream, data[:room])


def pump(proc, collector: Collector, timeout: float, on_timeout: Callable[[], None]) -> bool:
    """Read a child's stdout/stderr until both close; returns True if it hit ``timeout``."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    deadline = time.monotonic() + timeout
    timed_out = False
    open_ = 2
    while open_:
        left = deadline - time.monotonic()
        if left <= 0 and not timed_out:
            timed_out = True
            on_timeout()
        for key, _ in sel.select(timeout=max(min(left, 0.5), 0.01) if not timed_out else 0.5):
            data = key.fileobj.read1(65536) if hasattr(key.fileobj, "read1") else key.fileobj.read(65536)
            if not data:
                sel.unregister(key.fileobj)
                open_ -= 1
            else:
                collector.add(key.data, data)
    sel.close()
    return timed_out


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Substrate(ABC):
    """Constructed as ``cls(home, pool_size=...)`` (options a substrate has no use for are ignored).
    ``supports_allow``: whether it takes an egress allow-list (``network.allow``)."""

    name = "base"
    supports_allow = False

    @abstractmethod
    def create(self, handle: Handle) -> None:
        """Make the isolation for a sandbox whose root is mounted at ``handle.rootfs.root``."""

    @abstractmethod
    def exec(self, handle: Handle, argv: list[str], cwd: str, env: dict[str, str], timeout: float,
             on_output: OnOutput | None = None) -> ExecResult:
        """Run ``argv`` inside; kill it (and all it started) at ``timeout`` seconds."""

    def unmounting(self, handle: Handle) -> None:
        """The root is about to be unmounted and mounted again (snapshot / restore)."""

    @abstractmethod
    def destroy(self, handle: Handle) -> None:
        """Kill everything of the sandbox and release the isolation (not the rootfs)."""

    def close(self) -> None:
        """Release pooled resources."""
