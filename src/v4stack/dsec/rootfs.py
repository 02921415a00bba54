"""A sandbox's root filesystem: read-only layers over the shared EROFS image, a writable upper.

    root (overlay)  = upper (tmpfs, size = disk quota)  over  layer_n : ... : layer_1 : image

``seal`` turns the upper into a new read-only layer (content-addressed, copied to the layer
store, written temp + rename) and continues on a fresh upper: a chainable snapshot. ``flatten``
folds a chain into one layer, keeping whiteouts so deletions of image files stay deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

from v4stack.dsec import fsdiff
from v4stack.atomic import atomic_write
from v4stack.dsec.errors import Conflict, NotFound
from v4stack.dsec.mounts import is_mount, mount, run, umount
from v4stack.dsec.validate import ident


def _syncfs(path: Path) -> None:
    import ctypes

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ctypes.CDLL(None, use_errno=True).syncfs(fd)
    finally:
        os.close(fd)


class LayerStore:
    def __init__(self, home: Path):
        self.dir = home / "layers"
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, layer_id: str) -> Path:
        p = self.dir / ident(layer_id, "layer_id", "layer")
        if not p.is_dir():
            raise NotFound(f"layer {layer_id} is missing from {self.dir}", "layer")
        return p

    def ids(self) -> list[str]:
        return [p.name for p in self.dir.iterdir() if p.is_dir() and not p.name.startswith(".")]

    def _commit(self, tmp: Path, layer_id: str) -> str:
        final = self.dir / layer_id
        _syncfs(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # the same content is already a layer
            shutil.rmtree(tmp, ignore_errors=True)
        return layer_id

    def seal(self, upper: Path, image_id: str, below: list[str], fs_digest: str) -> str:
        """Copy ``upper`` into the store as a layer whose id names its content and its base."""
        layer_id = hashlib.sha256(json.dumps([image_id, below[:1], fs_digest]).encode()).hexdigest()[:32]
        if (self.dir / layer_id).is_dir():
            return layer_id
        tmp = self.dir / f".tmp-{layer_id}-{os.urandom(4).hex()}"
        tmp.mkdir()
        if os.listdir(upper):
            try:
                run(["cp", "-a", f"{upper}/.", f"{tmp}/"], timeout=1800)
            except OSError as e:  # e.g. names past PATH_MAX: the sandbox goes on, unsnapshotted
                fsdiff.remove_tree(tmp)
                raise Conflict(f"snapshot: the sandbox's files cannot be sealed ({str(e)[-160:]})",
                               "sandbox_id") from None
        return self._commit(tmp, layer_id)

    def flatten(self, image_id: str, chain: list[str]) -> str:
        """One layer equivalent to ``chain`` (top first) over the same image."""
        tmp = self.dir / f".tmp-flat-{os.urandom(6).hex()}"
        tmp.mkdir()
        for layer in reversed(chain):
            _fold(self.path(layer), tmp)
        digest = fsdiff.fs_digest(fsdiff.Scanner().scan(tmp))
        layer_id = hashlib.sha256(json.dumps([image_id, "flat", digest]).encode()).hexdigest()[:32]
        if (self.dir / layer_id).is_dir():
            shutil.rmtree(tmp)
            return layer_id
        return self._commit(tmp, layer_id)

    def remove(self, layer_id: str) -> None:
        p = self.dir / layer_id
        if p.is_dir():
            trash = self.dir / f".gc-{layer_id}-{os.urandom(3).hex()}"
            os.rename(p, trash)
            run(["rm", "-rf", "--one-file-system", str(trash)], timeout=600)  # no Python recursion limit


_clear = fsdiff.remove_tree


def _fold(src: Path, dst: Path) -> None:
    """Apply overlay layer ``src`` on top of the folded tree ``dst`` (iteratively: no depth limit)."""
    stack = [(src, dst)]
    while stack:
        s, d = stack.pop()
        _fold_dir(s, d, stack)
    # directory modes last, children first (a 0500 directory must still be filled)
    for s, d in reversed(list(_dirs(src, dst))):
        st = os.lstat(s)
        os.chown(d, st.st_uid, st.st_gid)
        os.chmod(d, stat.S_IMODE(st.st_mode))


def _dirs(src: Path, dst: Path):
    stack = [(src, dst)]
    while stack:
        s, d = stack.pop()
        yield s, d
        for name in os.listdir(s):
            if stat.S_ISDIR(os.lstat(s / name).st_mode):
                stack.append((s / name, d / name))


def _fold_dir(src: Path, dst: Path, stack: list) -> None:
    for name in os.listdir(src):
        s, d = src / name, dst / name
        st = os.lstat(s)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            _clear(d)
            os.mknod(d, stat.S_IFCHR, 0)
        elif stat.S_ISDIR(st.st_mode):
            if fsdiff._opaque(str(s)) or not (d.is_dir() and not d.is_symlink()):
                _clear(d)
                d.mkdir()
                if fsdiff._opaque(str(s)):
                    os.setxattr(d, fsdiff.OPAQUE, b"y")
            stack.append((s, d))
        else:
            _clear(d)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), d)
                os.chown(d, st.st_uid, st.st_gid, follow_symlinks=False)
            elif stat.S_ISFIFO(st.st_mode):
                os.mkfifo(d, stat.S_IMODE(st.st_mode))
                os.chown(d, st.st_uid, st.st_gid)
            elif not stat.S_ISREG(st.st_mode):
                continue  # sockets and device nodes are not state a snapshot keeps
            else:
                shutil.copy2(s, d, follow_symlinks=False)
                os.chown(d, st.st_uid, st.st_gid)


class Rootfs:
    """The mounted root of one sandbox under ``<home>/run/<sandbox>``."""

    def __init__(self, home: Path, sandbox: str, image_dir: Path, layers: LayerStore, disk_bytes: int):
        self.base = home / "run" / sandbox
        self.rw = self.base / "rw"
        self.root = self.base / "root"
        self.image_dir = image_dir
        self.layers = layers
        self.disk_bytes = disk_bytes
        self.chain: list[str] = []

    @property
    def upper(self) -> Path:
        return self.rw / "upper"

    def mount(self, chain: list[str], prepare=None) -> None:
        """Mount a fresh upper over ``chain``; ``prepare(upper)`` may fill the upper first."""
        lowers = [str(self.layers.path(x)) for x in chain] + [str(self.image_dir)]
        self.base.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.base, 0o700)
        self.rw.mkdir(mode=0o700, exist_ok=True)
        self.root.mkdir(exist_ok=True)
        mount("tmpfs", "dsec-rw", self.rw, f"size={self.disk_bytes},mode=0700")
        self.upper.mkdir()
        (self.rw / "work").mkdir()
        if prepare is not None:
            prepare(self.upper)
        mount("overlay", "dsec-root", self.root,
              f"lowerdir={':'.join(lowers)},upperdir={self.upper},workdir={self.rw / 'work'}")
        self.chain = list(chain)

    def unmount(self) -> None:
        for target in (self.root, self.rw):
            for _ in range(8):  # a crashed earlier run may have left mounts stacked here
                if not is_mount(target):
                    break
                umount(target)

    def remount(self, chain: list[str]) -> None:
        self.unmount()
        self.mount(chain)

    def destroy(self) -> None:
        self.unmount()
        shutil.rmtree(self.base, ignore_errors=True)

    def mounted(self) -> bool:
        return is_mount(self.root)


def write_snapshot(home: Path, doc: dict) -> None:
    atomic_write(home / "snapshots" / f"{doc['id']}.json", json.dumps(doc).encode())


def read_snapshot(home: Path, snapshot_id: str, field: str = "snapshot_id") -> dict:
    ident(snapshot_id, "snapshot_id", field)
    try:
        return json.loads((home / "snapshots" / f"{snapshot_id}.json").read_text())
    except FileNotFoundError:
        raise NotFound(f"{field}={snapshot_id!r}: no such snapshot", field) from None
