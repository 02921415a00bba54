"""The token WAL: records round trip into trajectory state, contradicting records are refused before
anything is written, and a damaged tail is cut exactly with everything before it kept."""

from __future__ import annotations

import pytest

from v4stack.journal import JournalCorrupt, read_records
from v4stack.rollout import TokenWAL, WALInconsistent
from v4stack.rollout import records as R
from v4stack.serve.sampling import SamplingParams

SP = SamplingParams(max_tokens=8, temperature=0.7, seed=3, stop=("\n",))
KV = {"file": "x.kv", "digest": "ab" * 32, "pos": 7, "bytes": 100}


def test_round_trip_into_trajectories(tmp_path):
    with TokenWAL(tmp_path / "w") as w:
        w.append([R.begin("a", [1, 2, 3], SP, group="g", version=4, sandbox="sb-1")])
        w.append([R.tokens("a", 0, [5, 6], 4), R.tokens("a", 2, [7], 5)])
        w.append([R.preempt("a", 3, "memory", KV)])
        assert w.trajectories["a"].status == "preempted" and w.trajectories["a"].kv == KV
        w.append([R.resume("a", 3, "host:1", 5, "reprefilled", "file gone"), R.tokens("a", 3, [8], 5)])
        w.append([R.end("a", 4, "stop"), R.reward("a", 0.5), R.consumed("a", 17)])
    with TokenWAL(tmp_path / "w") as w:
        assert w.recovery.cut_bytes == 0 and w.records == 9
        t = w.trajectories["a"]
        assert (t.prompt, t.tokens, t.status, t.end_reason) == ([1, 2, 3], [5, 6, 7, 8], "ended", "stop")
        assert (t.group, t.sandbox, t.reward, t.consumed, t.preemptions, t.resumes) == ("g", "sb-1", 0.5, 17, 1, ["reprefilled"])
        assert t.params == SP and t.token_versions == [(0, 4), (2, 5)]
        assert w.unfinished() == []


@pytest.mark.parametrize("bad,match", [
    ([R.tokens("a", 1, [9])], "field 'off' is 1"),
    ([R.tokens("zz", 0, [9])], "'zz'.*no BEGIN"),
    ([R.begin("a", [1], SP)], "already in the log"),
    ([R.end("a", 0, "length"), R.end("a", 0, "length")], "it is ended"),
    ([R.reward("a", 1.0)], "it is running"),
    ([R.tokens("a", 0, list(range(9)))], "past max_tokens=8"),
    ([R.end("a", 0, "length"), R.consumed("a", 1), R.consumed("a", 2)], "already consumed at step 1"),
])
def test_contradictions_refused_and_nothing_written(tmp_path, bad, match):
    with TokenWAL(tmp_path / "w") as w:
        w.append([R.begin("a", [1, 2], SP)])
        end = w.journal.end_lsn
        with pytest.raises(WALInconsistent, match=match):
            w.append(bad)
        assert w.journal.end_lsn == end and w.trajectories["a"].tokens == []
    assert len(list(read_records(tmp_path / "w"))) == 1


@pytest.mark.parametrize("rec,field", [
    ({"t": "TOKENS", "traj": "a", "off": -1, "ids": [1], "version": 0}, "'off': must be >= 0"),
    ({"t": "TOKENS", "traj": "a", "off": 0, "ids": [], "version": 0}, "'ids': must hold"),
    ({"t": "TOKENS", "traj": "a", "off": 0, "ids": [1.5], "version": 0}, "'ids': token ids"),
    ({"t": "END", "traj": "a", "reason": "x"}, "missing field 'off'"),
    ({"t": "NOPE", "traj": "a"}, "field 't'"),
    ({"t": "RESUME", "traj": "a", "off": 0, "server": "s", "version": 0, "kv": "maybe", "why": ""}, "'kv'"),
    ({"t": "PREEMPT", "traj": "a", "off": 0, "reason": "r", "kv": {"file": "f"}}, "'kv.digest'"),
])
def test_bad_fields_named(rec, field):
    with pytest.raises(R.RecordError, match=field):
        R.encode(rec)


def _log_with_tail(path):
    with TokenWAL(path) as w:
        w.append([R.begin("a", [1, 2], SP)])
        w.append([R.tokens("a", 0, [3, 4])])
        last = w.journal.end_lsn
        w.append([R.tokens("a", 2, [5, 6, 7])])
    return last


@pytest.mark.parametrize("damage", ["truncated", "flipped", "zeros"])
def test_damaged_tail(tmp_path, damage):
    """Zeros past the durable end are a torn tail (cut); damage inside durable records is an error
    naming the segment, offset and first lost record, and ``repair`` keeps everything before it."""
    last = _log_with_tail(tmp_path / "w")
    seg = sorted((tmp_path / "w").glob("seg-*.log"))[-1]
    data = bytearray(seg.read_bytes())
    size = len(data)
    if damage == "truncated":
        data = data[: last + (size - last) // 2]  # mid-record
    elif damage == "flipped":
        data[last + 20] ^= 0x20  # inside the last record's payload
    else:
        data += bytes(512)  # a zero-filled tail after the last whole record
    seg.write_bytes(bytes(data))
    if damage == "zeros":
        with TokenWAL(tmp_path / "w") as w:
            rec = w.recovery
            assert rec.cut_at == size and rec.cut_bytes == 512 and rec.reason
            assert w.trajectories["a"].tokens == [3, 4, 5, 6, 7]
    else:
        with pytest.raises(JournalCorrupt, match=f"{seg.name}.*offset {last}; records from seq 2 on are lost"):
            TokenWAL(tmp_path / "w")
        with TokenWAL(tmp_path / "w", repair=True) as w:
            assert w.trajectories["a"].tokens == [3, 4]  # everything before the damaged record
    with TokenWAL(tmp_path / "w") as w:
        n = len(w.trajectories["a"].tokens)
        w.append([R.tokens("a", n, [9])])  # the log goes on
    with TokenWAL(tmp_path / "w") as w:
        assert w.recovery.cut_bytes == 0 and w.trajectories["a"].tokens[-1] == 9


def test_valid_frame_with_bad_record_is_reported(tmp_path):
    from v4stack.journal import Journal

    with Journal(tmp_path / "w") as j:
        j.append(R.encode(R.begin("a", [1], SP)))
        j.append(b'{"t":"TOKENS","traj":"a","off":3,"ids":[1],"version":0}')
    with pytest.raises(WALInconsistent, match="field 'off' is 3"):
        TokenWAL(tmp_path / "w")
    Journal(tmp_path / "w").close()  # the refused open let go of the writer lock


def test_replay_across_segments(tmp_path):
    sp = SamplingParams(max_tokens=2000)
    with TokenWAL(tmp_path / "w", segment_bytes=4096) as w:
        w.append([R.begin("a", [1], sp), R.begin("b", [2], sp)])
        for i in range(300):
            w.append([R.tokens("a", i, [i % 256]), R.tokens("b", i, [(7 * i) % 256])])
    assert len(list((tmp_path / "w").glob("seg-*.log"))) > 5
    with TokenWAL(tmp_path / "w", segment_bytes=4096) as w:
        assert w.trajectories["a"].tokens == [i % 256 for i in range(300)]
        assert w.trajectories["b"].tokens == [(7 * i) % 256 for i in range(300)]
