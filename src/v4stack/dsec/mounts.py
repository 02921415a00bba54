"""Thin wrappers over mount(8)/umount(8) and the host's mount table."""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

from v4stack.dsec.errors import Unsupported


def need(cmd: str) -> str:
    p = shutil.which(cmd) or (f"/usr/sbin/{cmd}" if os.path.exists(f"/usr/sbin/{cmd}") else None)
    if p is None:
        raise Unsupported(f"{cmd} is not installed (run scripts/dsec-system-deps.sh)")
    return p


def run(argv: list[str], timeout: float = 60) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise OSError(f"{' '.join(argv[:3])}... failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    return r.stdout


def is_mount(path: str | os.PathLike) -> bool:
    p = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if line.split()[4].replace("\\040", " ") == p:
                return True
    return False


_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2


MS_NOSUID, MS_NODEV = 2, 4
SAFE = "nosuid,nodev"  # on every mount DSec makes: no setuid binary or device node works through them


def private_dir(path: Path) -> Path:
    """A directory only root can enter (DSec's home and run directories)."""
    path.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        raise OSError(f"{path}: is a symlink, refusing to use it")
    os.chmod(path, 0o700)
    return path


def mount(fstype: str, source: str, target: str | os.PathLike, options: str = "") -> None:
    """mount(2) directly for in-memory filesystems (no fork); mount(8) where a loop device is needed.
    Always nosuid,nodev; the target must be a real directory (a symlink there is refused)."""
    if os.path.islink(target) or not os.path.isdir(target):
        raise OSError(f"mount target {target} is not a plain directory")
    if "loop" in options.split(","):
        run(["mount", "-t", fstype, "-o", f"{options},{SAFE}", source, str(target)])
        return
    if _libc.mount(source.encode(), str(target).encode(), fstype.encode(), MS_NOSUID | MS_NODEV,
                   options.encode() or None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount -t {fstype} {target}: {os.strerror(e)}")


def umount(target: str | os.PathLike, lazy: bool = True) -> None:
    if _libc.umount2(str(target).encode(), _MNT_DETACH if lazy else 0) != 0:
        e = ctypes.get_errno()
        if e not in (22, 2):  # EINVAL: not a mount point; ENOENT: gone
            raise OSError(e, f"umount {target}: {os.strerror(e)}")


def make_shared(path: Path) -> None:
    """Bind ``path`` on itself with shared propagation so mounts under it reach slave namespaces."""
    path.mkdir(parents=True, exist_ok=True)
    if not is_mount(path):
        run(["mount", "--bind", str(path), str(path)])
        run(["mount", "-o", f"remount,bind,{SAFE}", str(path)])
    run(["mount", "--make-shared", str(path)])


@contextmanager
def file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
