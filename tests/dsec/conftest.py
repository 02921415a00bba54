"""Shared fixtures: a dsec home in a temp dir, a built busybox image, a runtime; skips name why."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


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
