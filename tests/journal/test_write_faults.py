"""Faults while writing: ENOSPC during an append (a real full filesystem: a small tmpfs mounted for
the test when run as root; and an error injected into the write path) and during a segment
rotation, EIO from fsync, two writers, a kill between write and fsync, and the directory entries
a new journal depends on. After any write or fsync error the writer is poisoned: nothing more is
acknowledged, no partial record is reachable, and reopening returns every acknowledged record."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from tests.journal.faults import SEG, Faults, batches, fd_path, no_silent_loss, open_all, payloads
from v4stack import journal as J
from v4stack.journal import Journal, JournalError, JournalPoisoned, read_records


def _fill(j: Journal, n: int, seed: int = 0) -> list[bytes]:
    acked = []
    for b in batches(n, seed):
        j.append_batch(b)
        acked += b
    return acked


def _after_poison(j: Journal, path, acked: list[bytes]) -> None:
    """The writer acknowledges nothing more; reopening returns the acknowledged records, and the
    journal goes on."""
    with pytest.raises(JournalPoisoned):
        j.append(b"after-the-error")
    with pytest.raises(JournalPoisoned):
        j.sync(j.end_lsn + 1)
    j.close()  # lets go of the directory; raises nothing more
    got = open_all(path)
    no_silent_loss(got, acked)
    assert b"after-the-error" not in got
    with Journal(path, segment_bytes=SEG) as j2:
        j2.append(b"next")
    assert open_all(path)[-1] == b"next"


def test_enospc_in_the_write_path_cuts_the_partial_record(tmp_path, monkeypatch):
    f = Faults(monkeypatch)
    j = Journal(tmp_path / "j", segment_bytes=SEG)
    acked = _fill(j, 40)
    seg = sorted((tmp_path / "j").glob("seg-*.log"))[-1]
    size = seg.stat().st_size
    f.pwrite_fault = lambda fd, data, off: errno.ENOSPC if len(data) > J.SEG_HEAD else None
    with pytest.raises(JournalPoisoned, match="No space left"):
        j.append_batch([b"x" * 300, b"y" * 300])
    f.pwrite_fault = None
    assert seg.stat().st_size == size  # half a record landed and was cut back
    assert [p for _, p in read_records(tmp_path / "j")] == acked
    _after_poison(j, tmp_path / "j", acked)


@pytest.mark.parametrize("where", ["header", "rename"])
def test_failed_rotation_keeps_owned_descriptors(tmp_path, monkeypatch, where):
    """A rotation that fails part way leaves the writer poisoned with its own descriptor; a file
    another component opens afterwards (it may get the number a closed descriptor had) is never
    written by the journal."""
    f = Faults(monkeypatch)
    j = Journal(tmp_path / "j", segment_bytes=SEG)
    acked = _fill(j, 20)
    if where == "header":
        f.pwrite_fault = lambda fd, data, off: errno.ENOSPC if ".tmp" in fd_path(fd) else None
    else:
        def bad_rename(a, b):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(os, "rename", bad_rename)
    big = [b"z" * 1000] * 6  # more than one segment holds
    with pytest.raises(JournalPoisoned, match="rotation"):
        j.append_batch(big)
    f.pwrite_fault = None
    monkeypatch.undo()
    other = tmp_path / "other-component.dat"
    fd = os.open(other, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with pytest.raises(JournalPoisoned):
            j.append(b"after")
        j.close()
        assert other.read_bytes() == b""  # nothing of the journal landed in another file
        os.fstat(fd)  # and the journal closed nothing it did not own
    finally:
        os.close(fd)
    got = open_all(tmp_path / "j")
    no_silent_loss(got, acked)
    assert not list((tmp_path / "j").glob(".seg-*.tmp"))  # the half-made segment was cleaned


def test_eio_on_fsync_poisons_the_writer(tmp_path, monkeypatch):
    """After a failed fsync the page cache's state is unknown: the record it covered is not
    acknowledged, and neither is anything after it, even if a later fsync would succeed."""
    f = Faults(monkeypatch)
    j = Journal(tmp_path / "j", segment_bytes=SEG)
    acked = _fill(j, 30)
    f.fsync_fault = lambda fd: errno.EIO if "seg-" in fd_path(fd) else None
    with pytest.raises(JournalPoisoned, match="fsync failed.*Input/output error"):
        j.append(b"not-acknowledged")
    f.fsync_fault = None  # the disk "recovers": a later fsync would succeed
    assert j.durable_lsn < j.end_lsn
    _after_poison(j, tmp_path / "j", acked)


def test_group_commit_waiters_see_the_failure(tmp_path, monkeypatch):
    import threading

    f = Faults(monkeypatch)
    j = Journal(tmp_path / "j", segment_bytes=SEG)
    f.fsync_fault = lambda fd: errno.EIO if "seg-" in fd_path(fd) else None
    errors = []

    def appender(i):
        try:
            j.append(b"t%d" % i)
        except JournalError as e:
            errors.append(e)

    ts = [threading.Thread(target=appender, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in ts) and len(errors) == 6
    assert all(isinstance(e, JournalPoisoned) for e in errors)
    j.close()


def _tmpfs(path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root (the injected-error test covers ENOSPC)")
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(path)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")


def test_enospc_on_a_full_filesystem(tmp_path):
    """A real full disk: append until the filesystem refuses; every acknowledged record survives,
    nothing partial is reachable, and after space is freed the journal goes on."""
    mnt = tmp_path / "small"
    _tmpfs(mnt)
    try:
        (mnt / "filler").write_bytes(b"f" * 8192)
        j = Journal(mnt / "j", segment_bytes=SEG)
        acked, err = [], None
        for b in batches(5000, 3):
            try:
                j.append_batch(b)
            except JournalPoisoned as e:
                err = e
                break
            acked += b
        assert err is not None and isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.ENOSPC
        with pytest.raises(JournalPoisoned):
            j.append(b"more")
        j.close()
        got = [p for _, p in read_records(mnt / "j")]
        assert got[: len(acked)] == acked and set(got[len(acked):]) <= set(payloads(5000, 3))
        no_silent_loss(open_all(mnt / "j"), acked)  # opening a full disk's journal works
        (mnt / "filler").unlink()
        with Journal(mnt / "j", segment_bytes=SEG) as j:
            j.append(b"after-space-was-freed")
        got = open_all(mnt / "j")
        no_silent_loss(got, acked)
        assert got[-1] == b"after-space-was-freed"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


_SECOND = """
import sys
from v4stack.journal import Journal, JournalError
try:
    Journal(sys.argv[1])
except JournalError as e:
    print("refused:", e)
    sys.exit(3)
print("opened")
"""


def test_two_writers(tmp_path):
    """The lock is on the directory itself: a second writer is refused in this process and in
    another, also after every file that looks like a lock is deleted."""
    j = Journal(tmp_path / "j", segment_bytes=SEG)
    j.append(b"one")
    for p in (tmp_path / "j").iterdir():  # nothing to unlink that would let a second writer in
        if p.name in ("LOCK", "lock"):
            p.unlink()
    with pytest.raises(JournalError, match="another process"):
        Journal(tmp_path / "j", segment_bytes=SEG)
    r = subprocess.run([sys.executable, "-c", _SECOND, str(tmp_path / "j")], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 3 and "refused" in r.stdout, r.stdout + r.stderr
    j.close()
    with Journal(tmp_path / "j", segment_bytes=SEG) as j2:
        assert [p for _, p in j2.iter()] == [b"one"]


def test_recovery_syncs_what_it_keeps(tmp_path, monkeypatch):
    """A writer killed between write and fsync left records the disk may not hold. Opening keeps
    them only after fsyncing them: before the constructor returns, the segment was synced, and
    ``durable_lsn`` covers exactly what is kept."""
    live = tmp_path / "live"
    j = Journal(live, segment_bytes=SEG)
    acked = _fill(j, 10)
    j.write([b"written-not-synced"])
    import shutil

    shutil.copytree(live, tmp_path / "j")  # the state a kill leaves (the page cache has the bytes)
    j.close()
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd_path(fd)), real(fd))[1])
    with Journal(tmp_path / "j", segment_bytes=SEG) as k:
        last = str(sorted((tmp_path / "j").glob("seg-*.log"))[-1])
        assert last in synced, synced
        got = [p for _, p in k.iter()]
        assert got == acked + [b"written-not-synced"] and k.durable_lsn == k.end_lsn


def test_new_directory_entries_are_synced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd_path(fd)), real(fd))[1])
    with Journal(tmp_path / "a" / "b" / "wal", segment_bytes=SEG) as j:
        j.append(b"x")
    for d in (tmp_path, tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "wal"):
        assert str(d) in synced, (d, synced)
