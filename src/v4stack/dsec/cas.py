"""Content-addressed blob store: ``put(bytes) -> 'sha256:<hex>'``; written temp + fsync + rename."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from v4stack.atomic import atomic_write
from v4stack.dsec.errors import BadRequest, NotFound


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class BlobStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, d: str) -> Path:
        algo, _, hexd = d.partition(":")
        if algo != "sha256" or len(hexd) != 64 or any(c not in "0123456789abcdef" for c in hexd):
            raise BadRequest(f"digest {d!r}: expected 'sha256:<64 hex digits>'", "digest")
        return self.root / hexd[:2] / hexd[2:]

    def put(self, data: bytes) -> str:
        d = digest(data)
        p = self._path(d)
        if not p.exists():
            atomic_write(p, data)
        return d

    def get(self, d: str) -> bytes:
        try:
            return self._path(d).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"blob {d} is not in the store", "digest") from None

    def has(self, d: str) -> bool:
        return self._path(d).exists()
