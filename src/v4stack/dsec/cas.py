"""Content-addressed blob store: ``put(bytes) -> 'sha256:<hex>'``; written temp + fsync + rename.

Every read is checked against the digest it is named by: a blob damaged or replaced on disk is
reported (``Corrupt``, naming the digest), never served. ``gc`` removes blobs nothing references.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from v4stack.atomic import atomic_write
from v4stack.dsec.errors import BadRequest, DsecError, NotFound


class Corrupt(DsecError):
    """Stored data failed its check (a blob's digest, a log record)."""

    status = 500


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def is_digest(d) -> bool:
    if not isinstance(d, str):
        return False
    algo, _, hexd = d.partition(":")
    return algo == "sha256" and len(hexd) == 64 and all(c in "0123456789abcdef" for c in hexd)


class BlobStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, d: str) -> Path:
        if not is_digest(d):
            raise BadRequest(f"digest {d!r}: expected 'sha256:<64 hex digits>'", "digest")
        hexd = d[7:]
        return self.root / hexd[:2] / hexd[2:]

    def put(self, data: bytes) -> str:
        d = digest(data)
        p = self._path(d)
        if not p.exists():
            atomic_write(p, data)
        return d

    def get(self, d: str) -> bytes:
        try:
            data = self._path(d).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"blob {d} is not in the store", "digest") from None
        if digest(data) != d:
            raise Corrupt(f"blob {d} is damaged on disk (its content no longer has this digest)", "digest")
        return data

    def has(self, d: str) -> bool:
        return self._path(d).exists()

    def gc(self, referenced: set[str], grace: float = 300.0, now: float | None = None) -> list[str]:
        """Remove blobs not in ``referenced`` whose file is older than ``grace`` seconds (a blob
        just written may not be referenced by its log record yet)."""
        now = now or time.time()
        gone = []
        for sub in self.root.iterdir() if self.root.is_dir() else []:
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for f in sub.iterdir():
                d = f"sha256:{sub.name}{f.name}"
                if d in referenced or not is_digest(d):
                    continue
                try:
                    if now - f.stat().st_mtime > grace:
                        f.unlink()
                        gone.append(d)
                except FileNotFoundError:
                    pass
        return gone
