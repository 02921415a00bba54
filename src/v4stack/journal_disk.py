"""The journal's disk format and the checks that opening and reading it run (the writer, ``Journal``,
is in ``v4stack/journal.py``). The journal is the durable append-only record log shared by the
token WAL and the sandbox trajectory log.

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

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

HEADER = struct.Struct("<IIQ")  # length, crc, seq
MAX_RECORD = 64 << 20
SEG_HEADER = struct.Struct("<8s16sQQQ")  # magic, journal id, segment number, first seq, base lsn
MARK = struct.Struct("<QQ")  # counter, durable bytes of the segment
META = struct.Struct("<8s16sQQQQ")  # magic, journal id, first segment number, its seq, its lsn, last number
SEG_MAGIC, META_MAGIC = b"V4JSEG02", b"V4JMETA2"
MARK_AT = (SEG_HEADER.size + 4, SEG_HEADER.size + 4 + MARK.size + 4)
SEG_HEAD = MARK_AT[1] + MARK.size + 4  # first record's offset in a segment
SEG_PREFIX, SEG_SUFFIX, META_NAME = "seg-", ".log", "JOURNAL"


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


def crc4(data: bytes) -> bytes:
    return struct.pack("<I", zlib.crc32(data))


def seg_name(lsn: int) -> str:
    return f"{SEG_PREFIX}{lsn:020d}{SEG_SUFFIX}"


def list_segments(path: Path) -> list[tuple[int, Path]]:
    out = []
    for p in path.iterdir():
        n = p.name
        if n.startswith(SEG_PREFIX) and n.endswith(SEG_SUFFIX):
            try:
                out.append((int(n[len(SEG_PREFIX) : -len(SEG_SUFFIX)]), p))
            except ValueError:
                continue
    return sorted(out)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode(payload: bytes, seq: int) -> bytes:
    head = struct.pack("<IQ", len(payload), seq)
    crc = zlib.crc32(payload, zlib.crc32(head))
    return HEADER.pack(len(payload), crc, seq) + payload


def mark_bytes(counter: int, durable: int) -> bytes:
    m = MARK.pack(counter, durable)
    return m + crc4(m)


def seg_head_bytes(jid: bytes, number: int, seq: int, base: int) -> bytes:
    h = SEG_HEADER.pack(SEG_MAGIC, jid, number, seq, base)
    return h + crc4(h) + mark_bytes(0, SEG_HEAD) + mark_bytes(0, SEG_HEAD)


@dataclass
class Meta:
    jid: bytes
    number: int  # first segment kept
    seq: int
    lsn: int
    last: int  # number of the newest segment known to exist

    def pack(self) -> bytes:
        m = META.pack(META_MAGIC, self.jid, self.number, self.seq, self.lsn, self.last)
        return m + crc4(m)


def read_meta(path: Path) -> Meta | None:
    try:
        data = (path / META_NAME).read_bytes()
    except FileNotFoundError:
        return None
    if len(data) != META.size + 4 or crc4(data[:-4]) != data[-4:] or data[:8] != META_MAGIC:
        raise JournalCorrupt(path, META_NAME, 0, 0, "journal identity file damaged")
    return Meta(*META.unpack_from(data)[1:])


@dataclass
class Seg:
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


def scan_segment(path: Path, meta: Meta, number: int, seq: int, base: int, last: bool) -> Seg:
    """Check one segment against what must come next; raise JournalCorrupt for damage."""
    name = path.name
    with open(path, "rb") as f:  # the head (and its mark) first, then the data: a record the
        head = f.read(SEG_HEAD)  # mark calls durable was written before the mark, so it is read
        data = head + f.read()
    if len(head) < SEG_HEAD or head[:8] != SEG_MAGIC or crc4(head[: SEG_HEADER.size]) != head[SEG_HEADER.size : SEG_HEADER.size + 4]:
        raise JournalCorrupt(path.parent, name, 0, seq, "segment header missing or damaged")
    _, jid, h_number, h_seq, h_base = SEG_HEADER.unpack_from(head)
    if jid != meta.jid:
        raise JournalCorrupt(path.parent, name, 0, seq, f"foreign segment (journal id {jid.hex()}, "
                             f"this journal is {meta.jid.hex()})")
    if h_base != int(name[len(SEG_PREFIX) : -len(SEG_SUFFIX)]):
        raise JournalCorrupt(path.parent, name, 0, seq, f"segment header says lsn {h_base}, not its name's")
    if (h_number, h_seq, h_base) != (number, seq, base):
        got = f"segment {h_number}, seq {h_seq}, lsn {h_base}"
        raise JournalCorrupt(path.parent, name, 0, seq, f"expected segment {number} starting at seq {seq}, "
                             f"lsn {base}; found {got} (a segment is missing, duplicated or out of order)")
    marks = []
    for at in MARK_AT:
        m = head[at : at + MARK.size + 4]
        if crc4(m[:-4]) == m[-4:]:
            marks.append(MARK.unpack_from(m))
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
    return Seg(path, number, base, seq, out, off, size, mark, counter, why)


def walk(path: Path, meta: Meta, segs: list[tuple[int, Path]]) -> Iterator[Seg]:
    number, seq, base = meta.number, meta.seq, meta.lsn
    for i, (_, p) in enumerate(segs):
        s = scan_segment(p, meta, number, seq, base, last=i == len(segs) - 1)
        yield s
        number, seq, base = number + 1, seq + len(s.records), base + s.end


def live_segments(path: Path, meta: Meta) -> list[tuple[int, Path]]:
    return [(b, p) for b, p in list_segments(path) if b >= meta.lsn]


def read_records(path: str | os.PathLike, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """Yield ``(lsn, payload)`` from ``start`` on; a torn tail ends the read quietly, damage raises
    ``JournalCorrupt``. Safe while a writer appends (it sees a prefix); takes no lock."""
    path = Path(path)
    if not path.is_dir():
        return
    listed = list_segments(path)  # before the identity file: drop_before moves that first
    meta = read_meta(path)
    if meta is None:
        if listed:
            raise JournalCorrupt(path, META_NAME, 0, 0, "journal identity file missing"
                                 " (segments written by an older format are not read)")
        return
    segs = [(b, p) for b, p in listed if b >= meta.lsn]
    number, seq, end = meta.number - 1, meta.seq, meta.lsn
    for i, s in enumerate(walk(path, meta, segs)):
        number, seq, end = s.number, s.first_seq + len(s.records), s.base + s.end
        nxt = segs[i + 1][0] if i + 1 < len(segs) else None
        if nxt is not None and nxt <= start:
            continue
        for off, payload in s.records:
            if s.base + off >= start:
                yield s.base + off, payload
    if number < meta.last and not [b for b, _ in list_segments(path) if b >= end]:  # not a rotation just now
        raise JournalCorrupt(path, seg_name(end), 0, seq, f"segment {number + 1} (to segment {meta.last}, "
                             f"the newest the journal made) is missing")
