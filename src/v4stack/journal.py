"""The durable append-only record log shared by the token WAL and the sandbox trajectory log.

A journal is a directory: ``JOURNAL`` (its identity and where it starts) and segment files
``seg-<lsn>.log``, ``<lsn>`` (20 digits) being the position of the segment's first byte in the
journal's one global byte space. The LSN of a record is the global position of its header.

    segment  = head | mark A | mark B | record*
    head     = magic | journal id | segment number | first record's sequence | base lsn | crc
    mark     = counter | durable bytes of this segment | crc       (two slots, newest wins)
    record   = u32 length | u32 crc32(length, seq, payload) | u64 seq | payload

Sequence numbers run on across segments without a gap; records never span segments.

Durability: ``append`` / ``append_batch`` return only after an ``fsync`` covers the record.
Concurrent appenders share fsyncs (group commit). After each fsync the writer records how far
the segment is durable in a mark slot (the next fsync carries it to disk; a full segment is
sealed with its final size before the next one is created), so the mark never claims more than
was synced.

Recovery (on open) checks every segment: header, identity, numbering, sequence continuity and
every record. A bad record at or after the last segment's mark is a torn tail (bytes no fsync
covered): it is cut and reported in ``recovery``. Anything else - a bad record before the mark,
a short, missing, duplicated, reordered or foreign segment - is damage: ``JournalCorrupt``
names the segment, the offset and the first lost sequence number, and nothing is changed.
``Journal(path, repair=True)`` keeps everything before the damage and sets the rest aside
(``*.lost``). What recovery keeps is fsynced before the journal is usable, so nothing that
was never durable is reported as durable.

Any write or fsync error poisons the writer (``JournalPoisoned``): no further append is
acknowledged, a failed write is cut back so no partial record stays reachable, and the next
open recovers from what is durable. One writer per directory: an exclusive ``flock`` on a
descriptor of the directory itself. ``read_records`` reads without the lock.
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

from v4stack.atomic import atomic_write

HEADER = struct.Struct("<IIQ")  # length, crc, seq
MAX_RECORD = 64 << 20
_HEAD = struct.Struct("<8s16sQQQ")  # magic, journal id, segment number, first seq, base lsn
_MARK = struct.Struct("<QQ")  # counter, durable bytes of the segment
_META = struct.Struct("<8s16sQQQQ")  # magic, journal id, first segment number, its seq, its lsn, last number
SEG_MAGIC, META_MAGIC = b"V4JSEG02", b"V4JMETA2"
_MARK_AT = (_HEAD.size + 4, _HEAD.size + 4 + _MARK.size + 4)
SEG_HEAD = _MARK_AT[1] + _MARK.size + 4  # first record's offset in a segment
_SEG_PREFIX, _SEG_SUFFIX, _META_NAME = "seg-", ".log", "JOURNAL"


class JournalError(Exception):
    """Bad use of a journal (bad argument, second writer, closed journal)."""


class JournalPoisoned(JournalError):
    """A write or fsync failed earlier: this writer acknowledges nothing more; reopen to recover."""


class JournalCorrupt(JournalError):
    """Damage that is not a torn tail: names the segment, offset and first lost sequence number."""

    def __init__(self, path, segment: str, offset: int, seq: int, reason: str, more: str = ""):
        self.segment, self.offset, self.first_lost_seq, self.reason = segment, offset, seq, reason
        super().__init__(f"journal {path}: segment {segment}: {reason} at offset {offset}; records from "
                         f"seq {seq} on are lost{more} (open with repair=True to keep everything before it)")


@dataclass(frozen=True)
class Recovery:
    """What opening the journal found: ``cut_bytes`` > 0 means a torn tail was truncated."""

    end_lsn: int
    records: int
    cut_at: int | None = None
    cut_bytes: int = 0
    reason: str = ""
    segment: str = ""
    next_seq: int = 0
    set_aside: tuple[str, ...] = ()  # segments a repair moved to ``*.lost``


def _crc(data: bytes) -> bytes:
    return struct.pack("<I", zlib.crc32(data))


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


def encode(payload: bytes, seq: int) -> bytes:
    head = struct.pack("<IQ", len(payload), seq)
    crc = zlib.crc32(payload, zlib.crc32(head))
    return HEADER.pack(len(payload), crc, seq) + payload


def _mark(counter: int, durable: int) -> bytes:
    m = _MARK.pack(counter, durable)
    return m + _crc(m)


def _seg_head(jid: bytes, number: int, seq: int, base: int) -> bytes:
    h = _HEAD.pack(SEG_MAGIC, jid, number, seq, base)
    return h + _crc(h) + _mark(0, SEG_HEAD) + _mark(0, SEG_HEAD)


@dataclass
class _Meta:
    jid: bytes
    number: int  # first segment kept
    seq: int
    lsn: int
    last: int  # number of the newest segment known to exist

    def pack(self) -> bytes:
        m = _META.pack(META_MAGIC, self.jid, self.number, self.seq, self.lsn, self.last)
        return m + _crc(m)


def _read_meta(path: Path) -> _Meta | None:
    try:
        data = (path / _META_NAME).read_bytes()
    except FileNotFoundError:
        return None
    if len(data) != _META.size + 4 or _crc(data[:-4]) != data[-4:] or data[:8] != META_MAGIC:
        raise JournalCorrupt(path, _META_NAME, 0, 0, "journal identity file damaged")
    return _Meta(*_META.unpack_from(data)[1:])


@dataclass
class _Seg:
    """One segment as recovery found it."""

    path: Path
    number: int
    base: int
    first_seq: int
    records: list[tuple[int, bytes]]  # (offset, payload)
    end: int  # end of the valid records
    size: int
    mark: int  # durable bytes recorded
    counter: int  # the newest mark's counter (the writer goes on from it)
    why: str  # why the scan stopped before ``size`` ('' = it did not)


def _scan_segment(path: Path, meta: _Meta, number: int, seq: int, base: int, last: bool) -> _Seg:
    """Check one segment against what must come next; raise JournalCorrupt for damage."""
    name = path.name
    with open(path, "rb") as f:  # the head (and its mark) first, then the data: a record the
        head = f.read(SEG_HEAD)  # mark calls durable was written before the mark, so it is read
        data = head + f.read()
    if len(head) < SEG_HEAD or head[:8] != SEG_MAGIC or _crc(head[: _HEAD.size]) != head[_HEAD.size : _HEAD.size + 4]:
        raise JournalCorrupt(path.parent, name, 0, seq, "segment header missing or damaged")
    _, jid, h_number, h_seq, h_base = _HEAD.unpack_from(head)
    if jid != meta.jid:
        raise JournalCorrupt(path.parent, name, 0, seq, f"foreign segment (journal id {jid.hex()}, "
                             f"this journal is {meta.jid.hex()})")
    if h_base != int(name[len(_SEG_PREFIX) : -len(_SEG_SUFFIX)]):
        raise JournalCorrupt(path.parent, name, 0, seq, f"segment header says lsn {h_base}, not its name's")
    if (h_number, h_seq, h_base) != (number, seq, base):
        got = f"segment {h_number}, seq {h_seq}, lsn {h_base}"
        raise JournalCorrupt(path.parent, name, 0, seq, f"expected segment {number} starting at seq {seq}, "
                             f"lsn {base}; found {got} (a segment is missing, duplicated or out of order)")
    marks = []
    for at in _MARK_AT:
        m = head[at : at + _MARK.size + 4]
        if _crc(m[:-4]) == m[-4:]:
            marks.append(_MARK.unpack_from(m))
    counter, mark = max(marks) if marks else (0, SEG_HEAD)
    out, off, size, why = [], SEG_HEAD, len(data), ""
    mv = memoryview(data)
    while off < size:
        if size - off < HEADER.size:
            why = "short record header"
            break
        length, crc, rseq = HEADER.unpack_from(data, off)
        end = off + HEADER.size + length
        if length > MAX_RECORD or end > size:
            why = "record runs past the end of the segment" if length <= MAX_RECORD else f"length {length} over the limit"
            break
        if zlib.crc32(mv[off + HEADER.size : end], zlib.crc32(struct.pack("<IQ", length, rseq))) != crc:
            why = "crc mismatch"
            break
        if rseq != seq + len(out):
            why = f"record seq {rseq} where seq {seq + len(out)} belongs"
            break
        out.append((off, bytes(mv[off + HEADER.size : end])))
        off = end
    if off < max(mark, SEG_HEAD if last else size) or (why and not last) or (why and len(marks) < 2):
        if off >= size:
            why = f"segment ends at {size} but {mark} bytes were durable"
        elif len(marks) < 2:  # a mark slot is only ever rewritten whole: a bad one is damage, and
            why = f"{why}, and a durable mark is damaged"  # the durable end it held is unknown
        raise JournalCorrupt(path.parent, name, off, seq + len(out), why or "trailing bytes in a sealed segment")
    return _Seg(path, number, base, seq, out, off, size, mark, counter, why)


def _walk(path: Path, meta: _Meta, segs: list[tuple[int, Path]]) -> Iterator[_Seg]:
    number, seq, base = meta.number, meta.seq, meta.lsn
    for i, (_, p) in enumerate(segs):
        s = _scan_segment(p, meta, number, seq, base, last=i == len(segs) - 1)
        yield s
        number, seq, base = number + 1, seq + len(s.records), base + s.end


def _live_segments(path: Path, meta: _Meta) -> list[tuple[int, Path]]:
    return [(b, p) for b, p in _segments(path) if b >= meta.lsn]


def read_records(path: str | os.PathLike, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """Yield ``(lsn, payload)`` from ``start`` on; a torn tail ends the read quietly, damage raises
    ``JournalCorrupt``. Safe while a writer appends (it sees a prefix); takes no lock."""
    path = Path(path)
    if not path.is_dir():
        return
    listed = _segments(path)  # before the identity file: drop_before moves that first
    meta = _read_meta(path)
    if meta is None:
        if listed:
            raise JournalCorrupt(path, _META_NAME, 0, 0, "journal identity file missing")
        return
    segs = [(b, p) for b, p in listed if b >= meta.lsn]
    number, seq, end = meta.number - 1, meta.seq, meta.lsn
    for i, s in enumerate(_walk(path, meta, segs)):
        number, seq, end = s.number, s.first_seq + len(s.records), s.base + s.end
        nxt = segs[i + 1][0] if i + 1 < len(segs) else None
        if nxt is not None and nxt <= start:
            continue
        for off, payload in s.records:
            if s.base + off >= start:
                yield s.base + off, payload
    if number < meta.last and not [b for b, _ in _segments(path) if b >= end]:  # not a rotation just now
        raise JournalCorrupt(path, _seg_name(end), 0, seq, f"segment {number + 1} (to segment {meta.last}, "
                             f"the newest the journal made) is missing")


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
            _fsync_dir(d.parent)

    # -- recovery ---------------------------------------------------------------------------
    def _recover(self, repair: bool) -> Recovery:
        for p in self.path.glob(f".{_SEG_PREFIX}*.tmp"):  # a rotation that never finished
            p.unlink()
        meta = _read_meta(self.path)
        if meta is None:
            meta = self._adopt()
        self._meta = meta
        for b, p in _segments(self.path):  # left behind by a drop_before that was cut short
            if b < meta.lsn:
                p.unlink()
        segs = _live_segments(self.path, meta)
        kept: list[_Seg] = []
        aside: list[str] = []
        try:
            for s in _walk(self.path, meta, segs):
                kept.append(s)
            if not kept or kept[-1].number < meta.last:
                number, seq, base = self._next(kept)
                raise JournalCorrupt(self.path, _seg_name(base), 0, seq, f"segment {number} (to segment "
                                     f"{meta.last}, the newest the journal made) is missing")
        except JournalCorrupt as e:
            if not repair:
                later = len(segs) - len(kept) - 1
                more = f"; {later} later segment(s) not read" if later > 0 else ""
                raise JournalCorrupt(self.path, e.segment, e.offset, e.first_lost_seq, e.reason, more) from None
            aside = self._set_aside(segs, len(kept), e)
            if e.offset >= SEG_HEAD:  # the damaged segment's header is good: keep its records before it
                kept.append(_scan_segment(segs[len(kept)][1], meta, *self._next(kept), last=True))
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
        os.fsync(self._fd)  # what recovery keeps is durable before anyone sees it
        os.fsync(self._dirfd)
        self._seg_number, self._seg_base, self._seq = last.number, last.base, seq
        self._end = last.base + last.end
        self._marks = last.counter + 1
        os.pwrite(self._fd, _mark(self._marks, last.end), _MARK_AT[self._marks % 2])
        if cut:
            return Recovery(self._end, count, cut[0], cut[1], cut[2], cut[3], seq, tuple(aside))
        return Recovery(self._end, count, next_seq=seq, set_aside=tuple(aside))

    def _adopt(self) -> _Meta:
        """No ``JOURNAL``: a new journal, or one whose creation stopped before it was written
        (then its only segment is segment 0 holding nothing). Anything else is damage."""
        segs = _segments(self.path)
        if not segs:
            self._meta = _Meta(os.urandom(16), 0, 0, 0, 0)
            self._create_segment(0, 0, 0)  # the segment first, then the file that says it exists
        else:
            with open(segs[0][1], "rb") as f:
                head = f.read()
            ok = len(segs) == 1 and len(head) == SEG_HEAD and head[:8] == SEG_MAGIC and \
                _crc(head[: _HEAD.size]) == head[_HEAD.size : _HEAD.size + 4]
            if not ok or _HEAD.unpack_from(head)[2:] != (0, 0, 0):
                raise JournalCorrupt(self.path, _META_NAME, 0, 0, "journal identity file missing")
            self._meta = _Meta(_HEAD.unpack_from(head)[1], 0, 0, 0, 0)
        atomic_write(self.path / _META_NAME, self._meta.pack())
        return self._meta

    def _set_meta(self, **changes) -> None:
        self._meta = _Meta(**{**self._meta.__dict__, **changes})
        atomic_write(self.path / _META_NAME, self._meta.pack())

    def _next(self, kept: list[_Seg]) -> tuple[int, int, int]:
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
                mark = _mark(1 << 62, e.offset)  # the cut segment's records are all durable
                os.pwrite(f.fileno(), mark, _MARK_AT[0])
                os.pwrite(f.fileno(), mark, _MARK_AT[1])
                os.fsync(f.fileno())
        os.fsync(self._dirfd)
        return moved

    def _create_segment(self, number: int, seq: int, base: int) -> None:
        """Create segment ``number`` whole (temp, fsync, rename, fsync dir) and make it current;
        the previous descriptor stays open until the new one is in place."""
        final = self.path / _seg_name(base)
        tmp = self.path / f".{final.name}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, _seg_head(self._meta.jid, number, seq, base), 0)
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
            os.pwrite(self._fd, _mark(self._marks, self._end - self._seg_base), _MARK_AT[self._marks % 2])
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
                                os.pwrite(self._fd, _mark(self._marks, target - base), _MARK_AT[self._marks % 2])
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
            segs = _live_segments(self.path, self._meta)
            gone = [p for i, (_, p) in enumerate(segs[:-1]) if segs[i + 1][0] <= lsn]
            if not gone:
                return 0
            first = segs[len(gone)][1]
            with open(first, "rb") as f:
                _, _, number, seq, base = _HEAD.unpack_from(f.read(_HEAD.size))
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
        finally:
            with self._wlock:
                self._closed = True
                self._release()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
