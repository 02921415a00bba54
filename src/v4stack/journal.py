"""The durable append-only record log shared by the token WAL and the sandbox trajectory log.

A journal is a directory of segment files ``seg-<lsn>.log``; ``<lsn>`` (20 digits) is the
position of the segment's first byte in the journal's one global byte space. A record is

    u32 length | u32 crc32(length bytes + payload) | payload

and its position (LSN) is the global offset of its header. Records never span segments.

Durability: ``append`` / ``append_batch`` return only after an ``fsync`` covers the record.
Concurrent appenders share fsyncs (group commit): the first waiter becomes the leader, syncs
everything written so far, and wakes every appender whose record that sync covered.

Recovery (on open): every segment is scanned; a bad record in the last segment is a torn tail
and is cut (the file is truncated there, and what was cut is reported in ``recovery``); a bad
record anywhere else is corruption and raises ``JournalCorrupt`` naming the segment and offset.
One writer per directory (an exclusive ``flock``); readers use ``read_records`` without it.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

HEADER = struct.Struct("<II")
MAX_RECORD = 64 << 20
_SEG_PREFIX, _SEG_SUFFIX = "seg-", ".log"


class JournalError(Exception):
    """Bad use of a journal (bad argument, second writer, closed journal)."""


class JournalCorrupt(JournalError):
    """A record that is not a torn tail failed its check."""


@dataclass(frozen=True)
class Recovery:
    """What opening the journal found: ``cut_bytes`` > 0 means a torn tail was truncated."""

    end_lsn: int
    records: int
    cut_at: int | None = None
    cut_bytes: int = 0
    reason: str = ""
    segment: str = ""


def _seg_name(lsn: int) -> str:
    return f"{_SEG_PREFIX}{lsn:020d}{_SEG_SUFFIX}"


def _segments(path: Path) -> list[tuple[int, Path]]:
    out = []
    for p in path.iterdir():
        n = p.name
        if n.startswith(_SEG_PREFIX) and n.endswith(_SEG_SUFFIX):
            try:
                out.append((int(n[len(_SEG_PREFIX) : -len(_SEG_SUFFIX)]), p))
            except ValueError:
                continue
    return sorted(out)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode(payload: bytes) -> bytes:
    n = struct.pack("<I", len(payload))
    return n + struct.pack("<I", zlib.crc32(payload, zlib.crc32(n))) + payload


def _scan(data: bytes) -> tuple[list[tuple[int, bytes]], int, str]:
    """Valid records of one segment's bytes: ([(offset, payload)], end of the valid prefix, why it stopped)."""
    out, off, size = [], 0, len(data)
    while off < size:
        if size - off < HEADER.size:
            return out, off, "short header"
        length, crc = HEADER.unpack_from(data, off)
        if length > MAX_RECORD:
            return out, off, f"length {length} over the {MAX_RECORD} limit"
        end = off + HEADER.size + length
        if end > size:
            return out, off, "short payload"
        payload = data[off + HEADER.size : end]
        if zlib.crc32(payload, zlib.crc32(data[off : off + 4])) != crc:
            return out, off, "crc mismatch"
        out.append((off, bytes(payload)))
        off = end
    return out, off, ""


def read_records(path: str | os.PathLike, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """Yield ``(lsn, payload)`` from ``start`` on, stopping quietly at the first invalid record.

    Safe while a writer appends (it sees a prefix); takes no lock and repairs nothing.
    """
    path = Path(path)
    if not path.is_dir():
        return
    segs = _segments(path)
    for i, (base, seg) in enumerate(segs):
        nxt = segs[i + 1][0] if i + 1 < len(segs) else None
        if nxt is not None and nxt <= start:
            continue
        records, valid_end, why = _scan(seg.read_bytes())
        for off, payload in records:
            if base + off >= start:
                yield base + off, payload
        if why:
            return


class Journal:
    """A single-writer, multi-threaded durable record log in directory ``path``."""

    def __init__(self, path: str | os.PathLike, segment_bytes: int = 64 << 20):
        if segment_bytes < 4096:
            raise JournalError(f"segment_bytes={segment_bytes}: must be >= 4096")
        self.path = Path(path)
        self.segment_bytes = segment_bytes
        self.path.mkdir(parents=True, exist_ok=True)
        self._lockfd = os.open(self.path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lockfd)
            raise JournalError(f"journal {self.path} is open for writing by another process") from None
        self._wlock = threading.Lock()
        self._cond = threading.Condition()
        self._syncing = False
        try:
            self.recovery = self._recover()
        except BaseException:
            os.close(self._lockfd)
            raise
        self._durable = self._end
        self._closed = False

    # -- recovery ---------------------------------------------------------------------------
    def _recover(self) -> Recovery:
        segs = _segments(self.path)
        if not segs:
            self._open_segment(0)
            return Recovery(end_lsn=0, records=0)
        count, cut = 0, None
        for i, (base, seg) in enumerate(segs):
            data = seg.read_bytes()
            records, valid_end, why = _scan(data)
            count += len(records)
            if why:
                if i != len(segs) - 1:
                    raise JournalCorrupt(f"segment {seg.name}: {why} at offset {valid_end} (not the tail)")
                with open(seg, "r+b") as f:
                    f.truncate(valid_end)
                    f.flush()
                    os.fsync(f.fileno())
                cut = Recovery(base + valid_end, count, base + valid_end, len(data) - valid_end, why, seg.name)
        last_base, last = segs[-1]
        self._seg_base = last_base
        self._fd = os.open(last, os.O_WRONLY | os.O_APPEND)
        self._end = last_base + os.fstat(self._fd).st_size
        if cut is not None:
            return cut
        return Recovery(end_lsn=self._end, records=count)

    def _open_segment(self, base: int) -> None:
        self._fd = os.open(self.path / _seg_name(base), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._seg_base = base
        self._end = base
        _fsync_dir(self.path)

    # -- writing ----------------------------------------------------------------------------
    @property
    def end_lsn(self) -> int:
        """Position the next record will get."""
        return self._end

    @property
    def durable_lsn(self) -> int:
        """Every record that ends at or before this position is on disk."""
        return self._durable

    def _write_locked(self, payload: bytes) -> int:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise JournalError(f"payload: expected bytes, got {type(payload).__name__}")
        if len(payload) > MAX_RECORD:
            raise JournalError(f"payload: {len(payload)} bytes is over the {MAX_RECORD} limit")
        rec = encode(bytes(payload))
        if self._end > self._seg_base and self._end - self._seg_base + len(rec) > self.segment_bytes:
            os.fsync(self._fd)  # the old segment is whole and durable before the new one exists
            os.close(self._fd)
            with self._cond:
                self._durable = max(self._durable, self._end)
            self._open_segment(self._end)
        lsn = self._end
        view = memoryview(rec)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self._end += len(rec)
        return lsn

    def write(self, payloads: list[bytes]) -> tuple[list[int], int]:
        """Write without waiting for durability: (lsns, end). Pair with ``sync(end)``."""
        if self._closed:
            raise JournalError(f"journal {self.path} is closed")
        with self._wlock:
            lsns = [self._write_locked(p) for p in payloads]
            return lsns, self._end

    def sync(self, upto: int | None = None) -> None:
        """Return once everything written before ``upto`` (default: now) is durable (group commit)."""
        if upto is None:
            upto = self._end
        with self._cond:
            while self._durable < upto:
                if self._syncing:
                    self._cond.wait()
                    continue
                self._syncing = True
                self._cond.release()  # lock order is always _wlock -> _cond, never the reverse
                try:
                    with self._wlock:
                        fd, target = os.dup(self._fd), self._end
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                finally:
                    self._cond.acquire()
                    self._syncing = False
                self._durable = max(self._durable, target)
                self._cond.notify_all()

    def append(self, payload: bytes) -> int:
        """Append one record; returns its LSN once it is durable."""
        return self.append_batch([payload])[0]

    def append_batch(self, payloads: list[bytes]) -> list[int]:
        """Append records in order; returns their LSNs once all are durable (one fsync)."""
        lsns, end = self.write(payloads)
        self.sync(end)
        return lsns

    # -- reading / housekeeping -------------------------------------------------------------
    def iter(self, start: int = 0) -> Iterator[tuple[int, bytes]]:
        """Records from ``start`` on, including written-but-not-yet-durable ones."""
        return read_records(self.path, start)

    def drop_before(self, lsn: int) -> int:
        """Delete whole segments that end at or before ``lsn``; returns how many were removed."""
        segs = _segments(self.path)
        gone = 0
        for i, (base, seg) in enumerate(segs[:-1]):
            if segs[i + 1][0] <= lsn:
                seg.unlink()
                gone += 1
        if gone:
            _fsync_dir(self.path)
        return gone

    def close(self) -> None:
        if self._closed:
            return
        self.sync()
        self._closed = True
        os.close(self._fd)
        os.close(self._lockfd)

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
