"""The token write-ahead log: every generated token of every trajectory, durable before it is seen.

A ``TokenWAL`` is a ``Journal`` (``v4stack/journal.py``: sequence numbers and a CRC per record,
group commit, a torn tail past the durable mark cut on open, any other damage an error naming the
first lost record unless ``repair=True``) whose payloads are the records of ``rollout/records.py``. Opening it replays the log
into one ``Trajectory`` per id: its prompt and sampling params, every durable token, whether it is
running, preempted (with the saved-KV handle) or ended, its reward and the trainer step that
consumed it. Each record is checked against that state before it is written (a TOKENS offset
must equal the durable length, a trajectory is consumed at most once, ...), so the log never holds
a record that contradicts the ones before it.

Writing: ``append(recs)`` returns once the records are durable (one fsync for the batch, shared
with concurrent appenders); ``write`` + ``sync`` split the two so a caller can overlap the fsync
with the next decode step. ``durable_lsn`` says how far the log is on disk; the rollout worker
exposes a token only when the record that carries it ends at or before ``durable_lsn``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from v4stack.journal import Journal, Recovery, read_records
from v4stack.rollout import records as R
from v4stack.serve.sampling import SamplingParams


class WALInconsistent(RuntimeError):
    """A record that contradicts the trajectory's state (names the trajectory and the field)."""


@dataclass
class Trajectory:
    traj: str
    group: str
    prompt: list[int]
    params: SamplingParams
    version: int = 0
    sandbox: str | None = None
    tokens: list[int] = field(default_factory=list)
    status: str = "running"  # running | preempted | ended
    end_reason: str | None = None
    kv: dict | None = None  # saved-KV handle of the open preemption
    reward: float | None = None
    consumed: int | None = None
    preemptions: int = 0
    resumes: list[str] = field(default_factory=list)  # 'reused' / 'reprefilled', in order
    token_versions: list[tuple[int, int]] = field(default_factory=list)  # (offset, policy version)
    logprobs: list[float] = field(default_factory=list)  # one per token (nan: not recorded; 0.0: observation)
    obs: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) of observation tokens
    calls: list[dict] = field(default_factory=list)  # TOOL_CALL records (off, cmd, sandbox, seq), in order

    @property
    def finished(self) -> bool:
        return self.status == "ended"


@dataclass
class _Head:
    """What checking the next record of a trajectory needs (O(1) to copy, whatever its length)."""

    status: str
    n: int
    consumed: int | None
    max_tokens: int


def _head(tr: Trajectory) -> _Head:
    return _Head(tr.status, len(tr.tokens), tr.consumed, tr.params.max_tokens)


def _check(heads: dict[str, _Head | None], rec: dict) -> None:
    """Refuse ``rec`` if it contradicts its trajectory's head; otherwise advance the head."""
    kind, tid = rec["t"], rec["traj"]
    h = heads.get(tid)
    if kind == "BEGIN":
        if h is not None:
            raise WALInconsistent(f"BEGIN for trajectory {tid!r}: field 'traj' is already in the log")
        heads[tid] = _Head("running", 0, None, R.params_from_dict(rec["params"]).max_tokens)
        return
    if h is None:
        raise WALInconsistent(f"{kind} for trajectory {tid!r}: field 'traj' has no BEGIN")
    if "off" in rec and rec["off"] != h.n:
        raise WALInconsistent(f"{kind} for trajectory {tid!r}: field 'off' is {rec['off']}, "
                              f"the log holds {h.n} tokens")
    allowed = {"TOKENS": ("running",), "TOOL_CALL": ("running",), "OBS": ("running",), "PREEMPT": ("running",), "RESUME": ("running", "preempted"),
               "END": ("running", "preempted"), "REWARD": ("ended",), "CONSUMED": ("ended",)}[kind]
    if h.status not in allowed:
        raise WALInconsistent(f"{kind} for trajectory {tid!r}: it is {h.status}, expected {' or '.join(allowed)}")
    if kind in ("TOKENS", "OBS"):
        if h.n + len(rec["ids"]) > h.max_tokens:
            raise WALInconsistent(f"{kind} for trajectory {tid!r}: field 'ids' goes past max_tokens={h.max_tokens}")
        h.n += len(rec["ids"])
    elif kind == "CONSUMED":
        if h.consumed is not None:
            raise WALInconsistent(f"CONSUMED for trajectory {tid!r}: field 'step' - already consumed at step {h.consumed}")
        h.consumed = rec["step"]
    else:
        h.status = {"PREEMPT": "preempted", "RESUME": "running", "END": "ended"}.get(kind, h.status)


def _apply(trajs: dict[str, Trajectory], rec: dict) -> None:
    kind, tid = rec["t"], rec["traj"]
    if kind == "BEGIN":
        trajs[tid] = Trajectory(tid, rec["group"], list(rec["prompt"]), R.params_from_dict(rec["params"]),
                                rec["version"], rec["sandbox"])
        return
    tr = trajs[tid]
    if kind == "TOKENS":
        if not tr.token_versions or tr.token_versions[-1][1] != rec["version"]:
            tr.token_versions.append((len(tr.tokens), rec["version"]))
        tr.tokens.extend(rec["ids"])
        tr.logprobs.extend(rec["lp"] if "lp" in rec else [float("nan")] * len(rec["ids"]))
    elif kind == "TOOL_CALL":
        tr.calls.append({k: rec[k] for k in ("off", "cmd", "sandbox", "seq")})
    elif kind == "OBS":
        tr.obs.append((len(tr.tokens), len(rec["ids"])))
        tr.tokens.extend(rec["ids"])
        tr.logprobs.extend([0.0] * len(rec["ids"]))
    elif kind == "PREEMPT":
        tr.status, tr.kv = "preempted", rec["kv"]
        tr.preemptions += 1
    elif kind == "RESUME":
        tr.status, tr.kv = "running", None
        tr.resumes.append(rec["kv"])
    elif kind == "END":
        tr.status, tr.end_reason, tr.kv = "ended", rec["reason"], None
    elif kind == "REWARD":
        tr.reward = float(rec["value"])
    elif kind == "CONSUMED":
        tr.consumed = rec["step"]


def _replay(records, trajs: dict[str, Trajectory], path) -> int:
    n = 0
    for lsn, payload in records:
        try:
            rec = R.decode(payload)
            tr = trajs.get(rec["traj"])
            _check({rec["traj"]: _head(tr) if tr is not None else None}, rec)
        except (R.RecordError, WALInconsistent) as e:
            raise WALInconsistent(f"{path}: record at lsn {lsn}: {e}") from None
        _apply(trajs, rec)
        n += 1
    return n


def inspect(path: str | os.PathLike) -> dict:
    """A read-only summary of the WAL in ``path`` (no lock taken, nothing repaired; a torn tail
    just ends the read, damage raises ``JournalCorrupt``): trajectories by status, tokens,
    preemptions and how they resumed."""
    trajs: dict[str, Trajectory] = {}
    n = _replay(read_records(path), trajs, path)
    out = {"records": n, "trajectories": len(trajs), "tokens": sum(len(t.tokens) for t in trajs.values()),
           "by_status": {}, "preemptions": sum(t.preemptions for t in trajs.values()),
           "resumed": {"reused": 0, "reprefilled": 0}, "consumed": sum(t.consumed is not None for t in trajs.values())}
    for t in trajs.values():
        out["by_status"][t.status] = out["by_status"].get(t.status, 0) + 1
        for m in t.resumes:
            out["resumed"][m] += 1
    return out


class TokenWAL:
    """The durable token log of a rollout worker, in directory ``path`` (one writer at a time)."""

    def __init__(self, path: str | os.PathLike, segment_bytes: int = 64 << 20, repair: bool = False):
        self.journal = Journal(path, segment_bytes=segment_bytes, repair=repair)
        self.path = self.journal.path
        self.trajectories: dict[str, Trajectory] = {}
        self.records = 0
        try:
            self.records = _replay(self.journal.iter(), self.trajectories, self.path)
        except BaseException:
            self.journal.close()
            raise

    @property
    def recovery(self) -> Recovery:
        """What opening the journal cut (``cut_bytes`` > 0: a torn tail past the durable mark was removed)."""
        return self.journal.recovery

    @property
    def durable_lsn(self) -> int:
        return self.journal.durable_lsn

    def write(self, recs: list[dict]) -> tuple[list[int], int]:
        """Check and write ``recs`` in order without waiting: ``(lsn of each, end)``. Not durable
        until ``sync(end)`` returns; the in-memory trajectories already include them."""
        payloads = []
        heads: dict[str, _Head | None] = {}
        for rec in recs:  # check the whole batch against the state it will meet, before writing any
            payloads.append(R.encode(rec))
            tid = rec["traj"]
            if tid not in heads:
                tr = self.trajectories.get(tid)
                heads[tid] = _head(tr) if tr is not None else None
            _check(heads, rec)
        lsns, end = self.journal.write(payloads)
        for rec in recs:
            _apply(self.trajectories, rec)
        self.records += len(recs)
        return lsns, end

    def sync(self, upto: int | None = None) -> None:
        self.journal.sync(upto)

    def append(self, recs: list[dict]) -> int:
        """Write ``recs`` and return the log position after them, once they are durable."""
        _, end = self.write(recs)
        self.sync(end)
        return end

    def unfinished(self) -> list[Trajectory]:
        return [t for t in self.trajectories.values() if not t.finished]

    def close(self) -> None:
        self.journal.close()

    def __enter__(self) -> "TokenWAL":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

