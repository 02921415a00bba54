"""The shared journal: round trip, group commit, torn-tail cut, rotation, iteration (the disk-fault
matrix is in tests/journal/)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from v4stack.journal import HEADER, SEG_HEAD, Journal, JournalCorrupt, JournalError, read_records


def test_round_trip_and_positions(tmp_path):
    with Journal(tmp_path / "j") as j:
        a = j.append(b"alpha")
        b, c = j.append_batch([b"", b"gamma" * 100])
        assert a == SEG_HEAD and b == a + HEADER.size + 5 and c == b + HEADER.size
        assert j.durable_lsn == j.end_lsn
    with Journal(tmp_path / "j") as j:
        assert j.recovery.records == 3 and j.recovery.cut_bytes == 0
        assert [p for _, p in j.iter()] == [b"alpha", b"", b"gamma" * 100]
        assert [p for _, p in j.iter(b)] == [b"", b"gamma" * 100]
        d = j.append(b"delta")
        assert d == c + HEADER.size + 500
    assert [lsn for lsn, _ in read_records(tmp_path / "j")] == [a, b, c, d]


_UNSYNCED = r"""
import os, sys
from v4stack.journal import Journal
j = Journal(sys.argv[1])
j.append_batch([b"one", b"two"])
j.write([b"three-three", b"four"])  # written, never fsynced: past the durable mark
os._exit(0)
"""


@pytest.mark.parametrize("damage", ["half_header", "zeros", "unsynced_flip", "unsynced_half"])
def test_torn_tail_is_cut_and_reported(tmp_path, damage):
    """Bytes past the durable mark are a torn tail: cut, reported, and the log goes on."""
    subprocess.run([sys.executable, "-c", _UNSYNCED, str(tmp_path / "j")], check=True)
    seg = sorted((tmp_path / "j").glob("seg-*.log"))[-1]
    data = bytearray(seg.read_bytes())
    third = data.index(b"three-three") - HEADER.size
    if damage == "half_header":
        data += b"\x05\x00\x00"
    elif damage == "zeros":
        data += bytes(4096)
    elif damage == "unsynced_flip":
        data[third + HEADER.size + 2] ^= 0xFF
    else:
        data = data[: third + 7]
    seg.write_bytes(bytes(data))
    with Journal(tmp_path / "j") as j:
        rec = j.recovery
        assert rec.cut_bytes > 0 and rec.reason and rec.segment == seg.name
        kept = [p for _, p in j.iter()]
        if damage in ("half_header", "zeros"):
            assert kept == [b"one", b"two", b"three-three", b"four"] and rec.cut_at == j.end_lsn
        else:
            assert kept == [b"one", b"two"] and rec.cut_at == third
        assert j.durable_lsn == j.end_lsn  # what recovery kept was fsynced
        j.append(b"after")
    with Journal(tmp_path / "j") as j:
        assert j.recovery.cut_bytes == 0
        assert [p for _, p in j.iter()][-1] == b"after"


@pytest.mark.parametrize("damage", ["flip_byte", "half_payload"])
def test_damage_before_the_durable_mark_is_not_a_tail(tmp_path, damage):
    """The same damage inside acknowledged records is an error naming segment, offset and seq."""
    with Journal(tmp_path / "j") as j:
        j.append_batch([b"one", b"two", b"three-three"])
        last = list(j.iter())[-1][0]
    seg = sorted((tmp_path / "j").glob("seg-*.log"))[-1]
    data = bytearray(seg.read_bytes())
    if damage == "flip_byte":
        data[-1] ^= 0xFF
    else:
        data = data[:-4]
    seg.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match=f"{seg.name}.* offset {last}; records from seq 2 on are lost") as e:
        Journal(tmp_path / "j")
    assert (e.value.segment, e.value.offset, e.value.first_lost_seq) == (seg.name, last, 2)
    with pytest.raises(JournalCorrupt):
        list(read_records(tmp_path / "j"))
    assert seg.read_bytes() == bytes(data)  # nothing was changed without asking
    with Journal(tmp_path / "j", repair=True) as j:
        assert [p for _, p in j.iter()] == [b"one", b"two"]
        j.append(b"after")
    with Journal(tmp_path / "j") as j:
        assert [p for _, p in j.iter()] == [b"one", b"two", b"after"]


def test_rotation_and_drop_and_midlog_corruption(tmp_path):
    with Journal(tmp_path / "j", segment_bytes=4096) as j:
        lsns = [j.append(bytes([i]) * 1000) for i in range(20)]
        segs = sorted((tmp_path / "j").glob("seg-*.log"))
        assert len(segs) >= 5
        assert [p[0] for _, p in j.iter()] == list(range(20))
        assert [lsn for lsn, _ in j.iter(lsns[13])] == lsns[13:]
        assert j.drop_before(lsns[10]) > 0
        assert [lsn for lsn, _ in j.iter()][0] <= lsns[10]
    segs = sorted((tmp_path / "j").glob("seg-*.log"))
    data = bytearray(segs[0].read_bytes())
    data[SEG_HEAD + HEADER.size + 3] ^= 1
    segs[0].write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match=segs[0].name):
        Journal(tmp_path / "j", segment_bytes=4096)


def test_one_writer_per_directory(tmp_path):
    j = Journal(tmp_path / "j")
    with pytest.raises(JournalError, match="another process"):
        Journal(tmp_path / "j")
    j.close()
    with pytest.raises(JournalError, match="segment_bytes"):
        Journal(tmp_path / "k", segment_bytes=10)


def test_group_commit_shares_fsyncs(tmp_path, monkeypatch):
    calls = []
    real = os.fsync

    def counting(fd):
        calls.append(fd)
        time.sleep(0.002)  # a slow disk makes the sharing visible
        return real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    j = Journal(tmp_path / "j")
    calls.clear()
    n_threads, per = 8, 25

    def worker(t):
        for i in range(per):
            j.append(f"{t}:{i}".encode())

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    j.close()
    total = n_threads * per
    got = [p.decode() for _, p in read_records(tmp_path / "j")]
    assert sorted(got) == sorted(f"{t}:{i}" for t in range(n_threads) for i in range(per))
    for t in range(n_threads):  # each thread's records stay in its own order
        mine = [int(g.split(":")[1]) for g in got if g.startswith(f"{t}:")]
        assert mine == list(range(per))
    assert len(calls) < total * 0.75, f"{len(calls)} fsyncs for {total} appends: no group commit"


_KILLER = r"""
import sys
from v4stack.journal import Journal
j = Journal(sys.argv[1])
i = 0
while True:
    j.append_batch([b"rec-%d" % i, b"x" * (i % 300)])
    print(i, flush=True)
    i += 1
"""


def test_sigkill_mid_append_keeps_every_acknowledged_record(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", _KILLER, str(tmp_path / "j")], stdout=subprocess.PIPE, text=True)
    acked = -1
    deadline = time.time() + 20
    while acked < 200 and time.time() < deadline:
        acked = int(p.stdout.readline())
    p.kill()
    p.wait()
    assert acked >= 200
    with Journal(tmp_path / "j") as j:
        names = [pl for _, pl in j.iter() if pl.startswith(b"rec-")]
    got = [int(n[4:]) for n in names]
    assert got[: acked + 1] == list(range(acked + 1))
