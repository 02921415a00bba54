"""The journal's guarantees as the token WAL, the rollout worker and DSec's trajectory log see them:
damage in a middle segment is an error (``rollout inspect`` included), never a shorter log; a write
or fsync error during decode stops the worker without exposing anything unacknowledged, and after a
restart the client's token stream equals the uninterrupted run's."""

from __future__ import annotations

import errno
import json

import pytest
import torch
import typer
from typer.testing import CliRunner

from tests.journal.faults import Faults, fd_path
from v4stack.config import preset
from v4stack.journal import JournalCorrupt, JournalPoisoned
from v4stack.model import V4Model
from v4stack.rollout import RolloutWorker, TokenWAL
from v4stack.rollout import records as R
from v4stack.rollout.cli import app as rollout_app
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams

TRAJ = {
    "s": ([7, 3, 99, 41, 12, 250, 8, 8, 1, 17, 64, 5, 33], SamplingParams(max_tokens=12, temperature=0.9, seed=11)),
    "g": ([200, 1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=12)),
}


def _consumed_log(path, n=40):
    sp = SamplingParams(max_tokens=4)
    with TokenWAL(path, segment_bytes=4096) as w:
        for i in range(n):
            t = f"traj-{i}"
            w.append([R.begin(t, [1, 2, 3], sp), R.tokens(t, 0, [4, 5]), R.end(t, 2, "stop")])
            w.append([R.reward(t, 1.0), R.consumed(t, i)])
    return sorted(path.glob("seg-*.log"))


def test_damage_in_a_middle_segment_is_reported_not_shortened(tmp_path):
    segs = _consumed_log(tmp_path / "w")
    assert len(segs) >= 4
    mid = segs[len(segs) // 2]
    data = bytearray(mid.read_bytes())
    data[len(data) // 2] ^= 0x04
    mid.write_bytes(bytes(data))
    a = typer.Typer()
    a.add_typer(rollout_app, name="rollout")
    res = CliRunner().invoke(a, ["rollout", "inspect", str(tmp_path / "w")])
    assert res.exit_code == 1 and mid.name in res.output and "are lost" in res.output, res.output
    with pytest.raises(JournalCorrupt, match=mid.name) as e:
        TokenWAL(tmp_path / "w")
    with TokenWAL(tmp_path / "w", repair=True) as w:  # only when asked: the records before the damage
        assert w.records == e.value.first_lost_seq
        consumed = [t for t in w.trajectories.values() if t.consumed is not None]
        assert consumed and all(t.consumed == int(t.traj.split("-")[1]) for t in consumed)
        assert w.recovery.set_aside  # the later segments were kept aside, not deleted
    assert all(p.exists() or p.with_name(p.name + ".lost").exists() for p in segs)


def test_trajectory_log_inherits(tmp_path, monkeypatch):
    from v4stack.dsec.trajlog import TrajectoryLog, read_log

    log = TrajectoryLog(tmp_path / "log")
    log.intent({"op": "exec", "cmd": ["true"]}, True, None)
    log.result(0, exit=0)
    f = Faults(monkeypatch)
    f.fsync_fault = lambda fd: errno.EIO if "seg-" in fd_path(fd) else None
    with pytest.raises(JournalPoisoned):
        log.intent({"op": "exec", "cmd": ["false"]}, False, None)
    f.fsync_fault = None
    with pytest.raises(JournalPoisoned):  # not acknowledged later either
        log.result(1, exit=1)
    log.close()
    entries, _ = read_log(tmp_path / "log")
    assert entries[0].status == "done"
    seg = sorted((tmp_path / "log").glob("seg-*.log"))[-1]
    data = bytearray(seg.read_bytes())
    data[100] ^= 1
    seg.write_bytes(bytes(data))
    from v4stack.dsec.trajlog import damage

    found = damage(tmp_path / "log")  # readers report the damage (and give what precedes it)
    assert found and seg.name in json.dumps(found), found
    with pytest.raises(JournalCorrupt, match=seg.name):  # the writer refuses to go on past it
        TrajectoryLog(tmp_path / "log")


@pytest.fixture(scope="module")
def model():
    return V4Model(preset("tiny"), seed=0).cast(torch.float32).eval()


def _worker(model, path, seen, pipeline):
    def expose(e):
        assert e.durable_lsn >= e.record_end  # nothing is exposed before its record is durable
        s = seen.setdefault(e.traj, [])
        assert e.off == len(s), (e, len(s))
        s.extend(e.ids)

    eng = Engine(model, EngineConfig(n_blocks=64, n_slots=8))
    return RolloutWorker(eng, TokenWAL(path), expose, pipeline=pipeline)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    seen = {}
    w = _worker(model, tmp_path_factory.mktemp("ref") / "wal", seen, False)
    for tid, (p, sp) in TRAJ.items():
        w.submit(tid, p, sp)
    w.run()
    w.close()
    assert all(len(v) == 12 for v in seen.values())
    return seen


@pytest.mark.parametrize("fault,pipeline", [("eio-fsync", False), ("enospc-write", True)])
def test_worker_stops_on_a_write_fault_and_recovers_exactly(model, reference, tmp_path, monkeypatch, fault, pipeline):
    seen: dict[str, list[int]] = {}
    w = _worker(model, tmp_path / "wal", seen, pipeline)
    for tid, (p, sp) in TRAJ.items():
        w.submit(tid, p, sp)
    for _ in range(4):
        w.step()
    f = Faults(monkeypatch)
    if fault == "eio-fsync":
        f.fsync_fault = lambda fd: errno.EIO if "seg-" in fd_path(fd) else None
    else:
        f.pwrite_fault = lambda fd, data, off: errno.ENOSPC if "seg-" in fd_path(fd) and len(data) > 92 else None
    with pytest.raises(JournalPoisoned):
        for _ in range(4):
            w.step()
    with pytest.raises(JournalPoisoned):
        w.step()  # poisoned: the worker cannot go on acknowledging
    f.fsync_fault = f.pwrite_fault = None
    try:
        w.close()
    except JournalPoisoned:
        pass
    before = {k: list(v) for k, v in seen.items()}
    assert all(reference[k][: len(v)] == v for k, v in before.items())
    w2 = _worker(model, tmp_path / "wal", seen, pipeline)  # a restart: fresh engine, same WAL
    assert w2.wal.durable_lsn == w2.wal.journal.end_lsn
    w2.recover()
    for tid, tr in w2.wal.trajectories.items():
        if len(seen.get(tid, [])) < len(tr.tokens) or tr.finished:
            w2.redeliver(tid, len(seen.get(tid, [])))
    w2.run()
    w2.close()
    assert seen == reference
