"""Shared pieces of the journal fault suite: a journal built the way a writer builds one (batches
acknowledged by fsync, optionally a tail written and never synced before the process dies), and
the one verdict every fault must meet: every acknowledged record comes back, or opening fails
with an error naming the segment, offset and first lost record - and a repair keeps exactly the
acknowledged records before it. A silent loss fails the verdict.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

SEG = 4096  # small segments, so a few hundred records span several


def payloads(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [b"r%05d:" % i + bytes(rng.randrange(97, 123) for _ in range(rng.randrange(8, 120))) for i in range(n)]


def batches(n: int, seed: int) -> list[list[bytes]]:
    recs, rng, out, i = payloads(n, seed), random.Random(seed + 1), [], 0
    while i < n:
        k = rng.randrange(1, 5)
        out.append(recs[i : i + k])
        i += k
    return out


def build(path: Path, n: int, seed: int = 0, unsynced: int = 0) -> list[bytes]:
    """Write a journal; returns the acknowledged payloads in order. With ``unsynced`` > 0, that
    many more records are written and never synced, and ``path`` is a copy of the directory taken
    at that moment - what a killed writer leaves (the page cache holds every written byte)."""
    from v4stack.journal import Journal

    live = path.with_name(path.name + "-live") if unsynced else path
    j = Journal(live, segment_bytes=SEG)
    for b in batches(n, seed):
        j.append_batch(b)
    if unsynced:
        j.write(payloads(n + unsynced, seed)[n:])
        copy(live, path)
    j.close()
    return payloads(n, seed)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def open_all(path: Path, repair: bool = False) -> list[bytes]:
    from v4stack.journal import Journal

    with Journal(path, segment_bytes=SEG, repair=repair) as j:
        return [p for _, p in j.iter()]


def no_silent_loss(got: list[bytes], acked: list[bytes]) -> None:
    """The records a successful open returned start with every acknowledged record, in order."""
    assert got[: len(acked)] == acked, (f"silent loss: {len(acked)} acknowledged, "
                                        f"{sum(a == b for a, b in zip(got, acked))} returned intact")


def verdict(path: Path, acked: list[bytes]) -> str:
    """'kept' (every acknowledged record returned) or 'named' (the error names what was lost, and
    repairing keeps exactly what came before it); anything else fails."""
    from v4stack.journal import JournalCorrupt, read_records

    try:
        got = open_all(path)
    except JournalCorrupt as e:
        msg = str(e)
        assert e.segment in msg and f"offset {e.offset}" in msg and f"seq {e.first_lost_seq} on are lost" in msg
        try:  # the lock-free reader raises too, or returns every acknowledged record
            no_silent_loss([p for _, p in read_records(path)], acked)
        except JournalCorrupt:
            pass
        kept = open_all(path, repair=True)
        assert kept == acked[: e.first_lost_seq] or (e.first_lost_seq >= len(acked) and kept[: len(acked)] == acked)
        assert open_all(path)[: len(kept)] == kept  # the repaired journal opens cleanly
        return "named"
    no_silent_loss(got, acked)
    no_silent_loss([p for _, p in read_records(path)], acked)
    return "kept"


def fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class Faults:
    """os.pwrite / os.fsync that fail on cue (the journal calls them through the os module)."""

    def __init__(self, monkeypatch):
        self.real_pwrite, self.real_fsync = os.pwrite, os.fsync
        self.pwrite_fault = self.fsync_fault = None  # callables (fd, ...) -> errno or None
        monkeypatch.setattr(os, "pwrite", self._pwrite)
        monkeypatch.setattr(os, "fsync", self._fsync)

    def _pwrite(self, fd, data, off):
        err = self.pwrite_fault and self.pwrite_fault(fd, data, off)
        if err:
            self.real_pwrite(fd, bytes(data)[: len(data) // 2], off)  # part of it lands, then the error
            raise OSError(err, os.strerror(err))
        return self.real_pwrite(fd, data, off)

    def _fsync(self, fd):
        err = self.fsync_fault and self.fsync_fault(fd)
        if err:
            raise OSError(err, os.strerror(err))
        return self.real_fsync(fd)
