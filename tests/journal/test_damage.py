"""Damage on disk: bit flips and zeroed pages at random offsets in every segment, truncation at every
byte of the last records, and deleted, duplicated, reordered and foreign segments. Each case either
returns every acknowledged record or fails naming the segment, offset and first lost record (see
``faults.verdict``); a torn tail past the durable mark is cut without an error. Two journals are
damaged: one closed cleanly, one whose writer died with records written but never synced."""

from __future__ import annotations

import random
import zlib
from collections import Counter

import pytest

from tests.journal.faults import SEG, build, copy, no_silent_loss, open_all, verdict
from v4stack.journal import HEADER, SEG_HEAD, Journal, JournalCorrupt

N, UNSYNCED = 250, 5
TRIALS = 6  # per segment and fault kind in the default run; -m slow runs many more
SLOW_TRIALS = 60


@pytest.fixture(scope="module")
def journals(shm_module):
    root = shm_module
    out = {"clean": (root / "clean", build(root / "clean", N, seed=1)),
           "unsynced": (root / "unsynced", build(root / "unsynced", N, seed=2, unsynced=UNSYNCED))}
    for path, _ in out.values():
        assert len(list(path.glob("seg-*.log"))) >= 4
    return out


def _segments(path):
    return sorted(path.glob("seg-*.log"))


def test_verdict_catches_a_silent_loss():
    """Inverse control: the verdict fails a journal that returns fewer records with no error."""
    acked = [b"a", b"b", b"c"]
    no_silent_loss([b"a", b"b", b"c", b"d"], acked)
    with pytest.raises(AssertionError, match="silent loss"):
        no_silent_loss([b"a", b"b"], acked)
    with pytest.raises(AssertionError, match="silent loss"):
        no_silent_loss([b"a", b"x", b"c"], acked)


def _damage_every_segment(journals, shm_path, which, trials, hurt, seed=0):
    src, acked = journals[which]
    rng = random.Random(zlib.crc32(f"{which}/{hurt.__name__}/{trials}/{seed}".encode()))
    seen = Counter()
    for k, seg in enumerate(_segments(src)):
        for t in range(trials):
            d = copy(src, shm_path / f"{k}-{t}")
            data = bytearray((d / seg.name).read_bytes())
            hurt(data, rng)
            (d / seg.name).write_bytes(bytes(data))
            seen[verdict(d, acked)] += 1
    assert seen["named"] >= len(_segments(src)), seen  # the damage is noticed, not just survived
    return seen


def flip(data, rng):
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)


def zero_page(data, rng):
    page = rng.randrange(0, (len(data) + 4095) // 4096) * 4096
    n = min(4096, len(data) - page)
    data[page : page + n] = bytes(n)


def zero_sector(data, rng):
    i = rng.randrange(len(data))
    data[i : i + 512] = bytes(len(data[i : i + 512]))


@pytest.mark.parametrize("which", ["clean", "unsynced"])
@pytest.mark.parametrize("hurt", [flip, zero_page, zero_sector], ids=lambda f: f.__name__)
def test_damage_in_every_segment(journals, shm_path, which, hurt):
    _damage_every_segment(journals, shm_path, which, TRIALS, hurt)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["clean", "unsynced"])
@pytest.mark.parametrize("hurt", [flip, zero_page, zero_sector], ids=lambda f: f.__name__)
def test_damage_in_every_segment_many(journals, shm_path, which, hurt):
    _damage_every_segment(journals, shm_path, which, SLOW_TRIALS, hurt)


def _record_starts(seg_bytes: bytes) -> list[int]:
    out, off = [], SEG_HEAD
    while off + HEADER.size <= len(seg_bytes):
        length = HEADER.unpack_from(seg_bytes, off)[0]
        out.append(off)
        off += HEADER.size + length
    return out


def test_truncation_at_every_byte_of_the_last_records(journals, shm_path):
    """Clean journal: a cut anywhere inside the last three acknowledged records names the record it
    cut into. Killed writer: a cut inside the unsynced tail is a torn tail - every acknowledged
    record comes back and the cut is reported; a cut into the last acknowledged record is named."""
    for which in ("clean", "unsynced"):
        src, acked = journals[which]
        last = _segments(src)[-1]
        data = last.read_bytes()
        starts = _record_starts(data)
        with open(last, "rb") as f:
            first_seq = int.from_bytes(f.read(48)[32:40], "little")
        tail = 3 if which == "clean" else UNSYNCED + 1
        durable_end = starts[-UNSYNCED] if which == "unsynced" else len(data)
        work = copy(src, shm_path / which)
        for cut in range(starts[-tail], len(data)):
            (work / last.name).write_bytes(data[:cut])  # only the last segment is rewritten per cut
            if cut >= durable_end:
                with Journal(work, segment_bytes=SEG) as j:
                    got = [p for _, p in j.iter()]
                    assert j.recovery.cut_bytes == cut - max(s for s in starts if s <= cut)
                no_silent_loss(got, acked)
                continue
            with pytest.raises(JournalCorrupt) as e:
                open_all(work)
            lost = first_seq + sum(1 for s in starts if s < cut) - (0 if cut in starts else 1)
            assert (e.value.segment, e.value.first_lost_seq) == (last.name, lost), (cut, str(e.value))
            if cut % 11 == 0:  # the full verdict (repair included) on a sample of the cuts
                assert verdict(copy(work, shm_path / f"{which}-{cut}"), acked) == "named"


def _foreign(shm_path):
    other = shm_path / "other"
    build(other, N, seed=1)  # the same records, written by another journal
    return _segments(other)


@pytest.mark.parametrize("fault", ["delete_first", "delete_middle", "delete_last", "duplicate_over",
                                   "duplicate_extra", "reorder", "foreign", "foreign_identity"])
def test_segment_faults(journals, shm_path, fault):
    src, acked = journals["clean"]
    d = copy(src, shm_path / "j")
    segs = _segments(d)
    if fault == "delete_first":
        segs[0].unlink()
    elif fault == "delete_middle":
        segs[2].unlink()
    elif fault == "delete_last":
        segs[-1].unlink()
    elif fault == "duplicate_over":  # a copy of segment 1 where segment 2 was
        segs[2].write_bytes(segs[1].read_bytes())
    elif fault == "duplicate_extra":  # a stray copy after the end
        d.joinpath("seg-%020d.log" % (int(segs[-1].name[4:24]) + 10**6)).write_bytes(segs[1].read_bytes())
    elif fault == "reorder":
        a, b = segs[1].read_bytes(), segs[2].read_bytes()
        segs[1].write_bytes(b)
        segs[2].write_bytes(a)
    elif fault == "foreign":
        segs[1].write_bytes(_foreign(shm_path)[1].read_bytes())
    else:
        (d / "JOURNAL").write_bytes((shm_path / "other" / "JOURNAL").read_bytes() if _foreign(shm_path) else b"")
    with pytest.raises(JournalCorrupt) as e:
        open_all(d)
    msg = str(e.value)
    expect = {"delete_first": "expected segment 0", "delete_middle": "expected segment 2",
              "delete_last": "is missing", "duplicate_over": "not its name's",
              "duplicate_extra": "not its name's", "reorder": "not its name's",
              "foreign": "foreign segment", "foreign_identity": "foreign segment"}[fault]
    assert expect in msg, msg
    assert verdict(d, acked) == "named"
