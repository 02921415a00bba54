"""The durable append-only record log shared by the token WAL and the sandbox trajectory log: the
writer (``Journal``). The on-disk format, the checks recovery and readers run, and what the journal
promises are described in ``v4stack/journal_disk.py``.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from typing import Iterator

from v4stack.atomic import atomic_write
from v4stack.journal_disk import (  # noqa: F401  (re-exported: the journal's public names)
    HEADER,
    JournalCorrupt,
    JournalError,
    JournalPoisoned,
    MARK_AT,
    MAX_RECORD,
    META_NAME,
    Meta,
    Recovery,
    SEG_HEAD,
    SEG_HEADER,
    SEG_MAGIC,
    SEG_PREFIX,
    Seg,
    crc4,
    encode,
    fsync_dir,
    list_segments,
    live_segments,
    mark_bytes,
    read_meta,
    read_records,
    scan_segment,
    seg_head_bytes,
    seg_name,
    walk,
)


def writer_alive(path: str | os.PathLike) -> bool:
    """Whether a live process holds the journal in ``path`` open for writing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def repair(path: str | os.PathLike) -> Recovery:
    """Keep every record before the first damage, set the rest aside; returns what was done."""
    j = Journal(path, repair=True)
    j.close()
    return j.recovery


class Journal:
    """A single-writer, multi-threaded durable record log in directory ``path``."""

    def __init__(self, path: str | os.PathLike, segment_bytes: int = 64 << 20, repair: bool = False):
        if segment_bytes < 4096:
            raise JournalError(f"segment_bytes={segment_bytes}: must be >= 4096")
        self.path = Path(path)
        self.segment_bytes = segment_bytes
        self._make_dir()
        self._dirfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._dirfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._dirfd)
            raise JournalError(f"journal {self.path} is open for writing by another process") from None
        self._fd = self._lockfd = -1
        try:  # ``LOCK`` stays a liveness probe for tools that look for it; the exclusion is the above
            self._lockfd = os.open(self.path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass
        self._wlock = threading.Lock()
        self._cond = threading.Condition()
        self._syncing = False
        self._failed: BaseException | None = None
        self._closed = False
        try:
            self.recovery = self._recover(repair)
        except BaseException:
            self._release()
            raise
        self._durable = self._end

    def _make_dir(self) -> None:
        """Create the directory and any missing parents, fsyncing each new entry's parent."""
        missing, p = [], self.path
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                pass
            fsync_dir(d.parent)

    # -- recovery ---------------------------------------------------------------------------
    def _recover(self, repair: bool) -> Recovery:
        for p in self.path.glob(f".{SEG_PREFIX}*.tmp"):  # a rotation that never finished
            p.unlink()
        meta, fresh = read_meta(self.path), False
        if meta is None:
            fresh = not list_segments(self.path)
            meta = self._adopt()
        self._meta = meta
        for b, p in list_segments(self.path):  # left behind by a drop_before that was cut short
            if b < meta.lsn:
                p.unlink()
        segs = live_segments(self.path, meta)
        kept: list[Seg] = []
        aside: list[str] = []
        try:
            for s in walk(self.path, meta, segs):
                kept.append(s)
            if not kept or kept[-1].number < meta.last:
                number, seq, base = self._next(kept)
                raise JournalCorrupt(self.path, seg_name(base), 0, seq, f"segment {number} (to segment "
                                     f"{meta.last}, the newest the journal made) is missing")
        except JournalCorrupt as e:
            if not repair:
                later = len(segs) - len(kept) - 1
                more = f"; {later} later segment(s) not read" if later > 0 else ""
                raise JournalCorrupt(self.path, e.segment, e.offset, e.first_lost_seq, e.reason, more) from None
            aside = self._set_aside(segs, len(kept), e)
            if e.offset >= SEG_HEAD:  # the damaged segment's header is good: keep its records before it
                kept.append(scan_segment(segs[len(kept)][1], meta, *self._next(kept), last=True))
        number, seq, base = self._next(kept)
        count = sum(len(s.records) for s in kept)
        if not kept:  # a repair set every segment aside: start again where they started
            self._create_segment(number, seq, base)
            self._set_meta(last=number)
            return Recovery(base + SEG_HEAD, 0, next_seq=seq, set_aside=tuple(aside))
        if repair and kept[-1].number != meta.last:
            self._set_meta(last=kept[-1].number)
        last = kept[-1]
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(last.path, os.O_RDWR)
        cut = None
        if last.end < last.size:
            os.ftruncate(self._fd, last.end)
            cut = (last.base + last.end, last.size - last.end, last.why, last.path.name)
        for s in kept[:-1]:
            if s.mark < s.size:  # sealed before its successor existed; make sure all the same
                fd = os.open(s.path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        if not fresh:  # a journal made just now was synced as it was made
            os.fsync(self._fd)  # what recovery keeps is durable before anyone sees it
            os.fsync(self._dirfd)
        self._seg_number, self._seg_base, self._seq = last.number, last.base, seq
        self._end = last.base + last.end
        self._marks = last.counter + 1
        os.pwrite(self._fd, mark_bytes(self._marks, last.end), MARK_AT[self._marks % 2])
        if cut:
            return Recovery(self._end, count, cut[0], cut[1], cut[2], cut[3], seq, tuple(aside))
        return Recovery(self._end, count, next_seq=seq, set_aside=tuple(aside))

    def _adopt(self) -> Meta:
        """No ``JOURNAL``: a new journal, or one whose creation stopped before it was written
        (then its only segment is segment 0 holding nothing). Anything else is damage."""
        segs = list_segments(self.path)
        if not segs:
            self._meta = Meta(os.urandom(16), 0, 0, 0, 0)
            self._create_segment(0, 0, 0)  # the segment first, then the file that says it exists
        else:
            with open(segs[0][1], "rb") as f:
                head = f.read()
            ok = len(segs) == 1 and len(head) == SEG_HEAD and head[:8] == SEG_MAGIC and \
                crc4(head[: SEG_HEADER.size]) == head[SEG_HEADER.size : SEG_HEADER.size + 4]
            if not ok or SEG_HEADER.unpack_from(head)[2:] != (0, 0, 0):
                raise JournalCorrupt(self.path, META_NAME, 0, 0, "journal identity file missing"
                                     " (segments written by an older format are not read)")
            self._meta = Meta(SEG_HEADER.unpack_from(head)[1], 0, 0, 0, 0)
        atomic_write(self.path / META_NAME, self._meta.pack())
        return self._meta

    def _set_meta(self, **changes) -> None:
        self._meta = Meta(**{**self._meta.__dict__, **changes})
        atomic_write(self.path / META_NAME, self._meta.pack())

    def _next(self, kept: list[Seg]) -> tuple[int, int, int]:
        if not kept:
            return self._meta.number, self._meta.seq, self._meta.lsn
        s = kept[-1]
        return s.number + 1, s.first_seq + len(s.records), s.base + s.end

    def _set_aside(self, segs, i: int, e: JournalCorrupt) -> list[str]:
        """Repair: move the segments after the damaged one (and it too, if its header is bad) aside."""
        first = i + 1 if e.offset >= SEG_HEAD else i
        moved = []
        for _, p in segs[first:]:
            os.replace(p, p.with_name(p.name + ".lost"))
            moved.append(p.name)
        if e.offset >= SEG_HEAD:
            with open(segs[i][1], "r+b") as f:
                data = f.read()
                f.seek(0)  # the damaged bytes are kept aside too, then the segment is cut before them
                if len(data) > e.offset:
                    atomic_write(self.path / (segs[i][1].name + f".{e.offset}.lost"), data)
                f.truncate(e.offset)
                os.fsync(f.fileno())
                mark = mark_bytes(1 << 62, e.offset)  # the cut segment's records are all durable
                os.pwrite(f.fileno(), mark, MARK_AT[0])
                os.pwrite(f.fileno(), mark, MARK_AT[1])
                os.fsync(f.fileno())
        os.fsync(self._dirfd)
        return moved

    def _create_segment(self, number: int, seq: int, base: int) -> None:
        """Create segment ``number`` whole (temp, fsync, rename, fsync dir) and make it current;
        the previous descriptor stays open until the new one is in place."""
        final = self.path / seg_name(base)
        tmp = self.path / f".{final.name}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, seg_head_bytes(self._meta.jid, number, seq, base), 0)
            os.fsync(fd)
            os.rename(tmp, final)
            os.fsync(self._dirfd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        old, self._fd = self._fd, fd
        if old >= 0:
            os.close(old)
        self._seg_number, self._seg_base, self._seq, self._end, self._marks = number, base, seq, base + SEG_HEAD, 0

    # -- writing ----------------------------------------------------------------------------
    @property
    def end_lsn(self) -> int:
        """Position the next record will get."""
        return self._end

    @property
    def durable_lsn(self) -> int:
        """Every record that ends at or before this position is on disk."""
        return self._durable

    @property
    def next_seq(self) -> int:
        """Sequence number the next record will get."""
        return self._seq

    def _check_open(self) -> None:
        if self._failed is not None:
            raise JournalPoisoned(f"journal {self.path}: an earlier write or fsync failed ({self._failed}); "
                                  f"nothing more is acknowledged - reopen to recover") from self._failed
        if self._closed:
            raise JournalError(f"journal {self.path} is closed")

    def _poison(self, e: BaseException, what: str) -> JournalPoisoned:
        self._failed = e
        with self._cond:
            self._cond.notify_all()
        return JournalPoisoned(f"journal {self.path}: {what} failed ({e}); nothing more is acknowledged "
                               f"- reopen to recover")

    def _put(self, buf: bytes) -> None:
        """Write ``buf`` at the end of the current segment; on any error cut it back and poison."""
        at = self._end - self._seg_base
        try:
            view = memoryview(buf)
            while view:
                n = os.pwrite(self._fd, view, at + len(buf) - len(view))
                if n == 0:
                    raise OSError(28, "no progress writing the journal")
                view = view[n:]
        except OSError as e:
            try:
                os.ftruncate(self._fd, at)  # no partial record stays reachable
            except OSError:
                pass  # it lies past the durable mark: the next open cuts it as a torn tail
            raise self._poison(e, "write") from e
        self._end += len(buf)

    def _rotate(self) -> None:
        try:
            os.fsync(self._fd)  # the old segment is whole and durable, then sealed at its size
            self._marks += 1
            os.pwrite(self._fd, mark_bytes(self._marks, self._end - self._seg_base), MARK_AT[self._marks % 2])
            os.fsync(self._fd)
            with self._cond:
                self._durable = max(self._durable, self._end)
            self._create_segment(self._seg_number + 1, self._seq, self._end)
            self._set_meta(last=self._seg_number)  # now a missing newest segment is noticed
        except OSError as e:
            raise self._poison(e, "segment rotation") from e

    def write(self, payloads: list[bytes]) -> tuple[list[int], int]:
        """Write without waiting for durability: (lsns, end). Pair with ``sync(end)``."""
        for p in payloads:
            if not isinstance(p, (bytes, bytearray, memoryview)):
                raise JournalError(f"payload: expected bytes, got {type(p).__name__}")
            if len(p) > MAX_RECORD:
                raise JournalError(f"payload: {len(p)} bytes is over the {MAX_RECORD} limit")
        with self._wlock:
            self._check_open()
            lsns, buf, pending = [], [], 0
            for p in payloads:
                rec = encode(bytes(p), self._seq)
                if self._end + pending > self._seg_base + SEG_HEAD and \
                        self._end + pending - self._seg_base + len(rec) > self.segment_bytes:
                    if buf:
                        self._put(b"".join(buf))
                        buf, pending = [], 0
                    self._rotate()
                lsns.append(self._end + pending)
                buf.append(rec)
                pending += len(rec)
                self._seq += 1
            if buf:
                self._put(b"".join(buf))
            return lsns, self._end

    def sync(self, upto: int | None = None) -> None:
        """Return once everything written before ``upto`` (default: now) is durable (group commit)."""
        if upto is None:
            upto = self._end
        with self._cond:
            while self._durable < upto:
                self._check_open()
                if self._syncing:
                    self._cond.wait()
                    continue
                self._syncing = True
                self._cond.release()  # lock order is always _wlock -> _cond, never the reverse
                try:
                    with self._wlock:
                        self._check_open()
                        fd, target, base = os.dup(self._fd), self._end, self._seg_base
                    try:
                        os.fsync(fd)
                    except OSError as e:
                        raise self._poison(e, "fsync") from e
                    finally:
                        os.close(fd)
                    with self._wlock:  # record how far this segment is durable (the next fsync carries it)
                        if self._seg_base == base and self._failed is None and not self._closed:
                            self._marks += 1
                            try:
                                os.pwrite(self._fd, mark_bytes(self._marks, target - base), MARK_AT[self._marks % 2])
                            except OSError as e:
                                raise self._poison(e, "durable mark write") from e
                finally:
                    self._cond.acquire()
                    self._syncing = False
                    self._cond.notify_all()
                self._durable = max(self._durable, target)

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
        """Delete whole segments that end at or before ``lsn``; returns how many were removed.
        ``JOURNAL`` moves its start first, so a missing early segment is never mistaken for loss."""
        with self._wlock:
            self._check_open()
            segs = live_segments(self.path, self._meta)
            gone = [p for i, (_, p) in enumerate(segs[:-1]) if segs[i + 1][0] <= lsn]
            if not gone:
                return 0
            first = segs[len(gone)][1]
            with open(first, "rb") as f:
                _, _, number, seq, base = SEG_HEADER.unpack_from(f.read(SEG_HEADER.size))
            self._set_meta(number=number, seq=seq, lsn=base)
            for p in gone:
                p.unlink()
            os.fsync(self._dirfd)
            return len(gone)

    def _release(self) -> None:
        for fd in (self._fd, self._lockfd, self._dirfd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._lockfd = self._dirfd = -1

    def close(self) -> None:
        """Sync what was written and let go of the directory; a poisoned journal just lets go."""
        if self._closed:
            return
        try:
            if self._failed is None:
                self.sync()
                os.fsync(self._fd)  # the last durable mark too: a clean close leaves an exact one
        finally:
            with self._wlock:
                self._closed = True
                self._release()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
