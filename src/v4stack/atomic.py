"""Whole-file writes that a crash cannot leave half done: temp file, fsync, rename, fsync the dir.

Used for everything v4stack writes outside its journals: configs, weights, checkpoints, cache
blocks, snapshots, images' metadata and benchmark results. Imports nothing heavy.
"""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path``: a reader (or a restart) sees the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def atomic_png(fig, path: str | os.PathLike, dpi: int | None = None) -> None:
    """A matplotlib figure written as PNG with ``atomic_write`` (rendered in memory first)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    atomic_write(path, buf.getvalue())
