"""The per-sandbox trajectory log: a totally ordered, durable record of every mutating request.

Records (JSON payloads on the shared journal):

- ``intent``  seq, req (request digest), idem (idempotent flag), parent (snapshot the state
  descends from), request (the request itself) - durable BEFORE the request runs;
- ``result``  seq, exit, stdout / stderr (blob digests), duration, fs (digest of the upper after),
  delta (blob digest of the change), changed (paths) - durable after it ran;
- ``snapshot`` id, seq (the log position the snapshot corresponds to);
- ``restore`` snapshot, seq;
- ``replayed`` seq, from_sandbox, from_seq: this entry's result was copied, not re-executed.

An intent with no result is an *unknown outcome*: it is reported, never re-run silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from v4stack.journal import Journal, JournalCorrupt, read_records


def request_digest(request: dict) -> str:
    blob = json.dumps(request, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


@dataclass
class Entry:
    seq: int
    intent: dict
    result: dict | None = None
    notes: list[dict] = field(default_factory=list)

    @property
    def status(self) -> str:
        return "done" if self.result is not None else "unknown_outcome"

    def to_json(self) -> dict:
        return {"seq": self.seq, "status": self.status, "intent": self.intent, "result": self.result}


def _index(records) -> tuple[dict[int, Entry], list[dict]]:
    entries: dict[int, Entry] = {}
    marks: list[dict] = []
    for lsn, payload in records:
        r = json.loads(payload)
        r["lsn"] = lsn
        t = r.get("t")
        if t == "intent":
            entries[r["seq"]] = Entry(r["seq"], r)
        elif t == "result" and r["seq"] in entries:
            entries[r["seq"]].result = r
        else:
            marks.append(r)
    return entries, marks


class TrajectoryLog:
    """Writer side (one per sandbox, held by the edge that runs it)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.journal = Journal(self.path, segment_bytes=8 << 20)
        self.entries, self.marks = _index(self.journal.iter())
        self._lock = threading.Lock()
        self.recovery = self.journal.recovery

    @property
    def next_seq(self) -> int:
        base = max((m.get("seq_base", 0) for m in self.marks if m.get("t") == "create"), default=0)
        return max(max(self.entries, default=-1) + 1, base)

    def last_result_seq(self) -> int:
        done = [s for s, e in self.entries.items() if e.result is not None]
        return max(done, default=-1)

    def _append(self, rec: dict) -> dict:
        rec.setdefault("ts", time.time())
        rec["lsn"] = self.journal.append(json.dumps(rec, separators=(",", ":")).encode())
        return rec

    def intent(self, request: dict, idempotent: bool, parent: str | None, seq: int | None = None) -> Entry:
        with self._lock:
            seq = self.next_seq if seq is None else seq
            rec = self._append(
                {"t": "intent", "seq": seq, "req": request_digest(request), "idem": bool(idempotent),
                 "parent": parent, "request": request}
            )
            e = self.entries[seq] = Entry(seq, rec)
            return e

    def result(self, seq: int, **fields) -> dict:
        with self._lock:
            rec = self._append({"t": "result", "seq": seq, **fields})
            self.entries[seq].result = rec
            return rec

    def mark(self, kind: str, **fields) -> dict:
        with self._lock:
            rec = self._append({"t": kind, **fields})
            self.marks.append(rec)
            return rec

    def close(self) -> None:
        self.journal.close()


def _read(path: str | os.PathLike) -> tuple[list[tuple[int, bytes]], dict | None]:
    """The readable records and, if the journal found damage (not a torn tail), where it is."""
    recs: list[tuple[int, bytes]] = []
    try:
        for rec in read_records(path):
            recs.append(rec)
    except JournalCorrupt as e:
        last = None
        for _, payload in reversed(recs):
            try:
                seq = json.loads(payload).get("seq")
            except ValueError:
                continue
            if isinstance(seq, int):
                last = seq
                break
        return recs, {"after_seq": last, "segment": e.segment, "offset": e.offset,
                      "first_lost_record": e.first_lost_seq, "reason": e.reason}
    return recs, None


def read_log(path: str | os.PathLike) -> tuple[dict[int, Entry], list[dict]]:
    """Reader side: index a sandbox's log without taking the writer's lock (apiserver, watcher).
    A damaged log gives what precedes the damage (``damage`` says where it is)."""
    return _index(_read(path)[0])


def damage(path: str | os.PathLike) -> dict | None:
    """Where a log is damaged: after which of its sequence numbers, in which segment at which
    offset, and the journal's first lost record - reported in every log query, never hidden."""
    return _read(path)[1]


def blob_refs(path: str | os.PathLike) -> tuple[set[str], set[str]]:
    """The blobs a log's records name directly (outputs, deltas, written file contents), and
    which of them are delta documents (they name more blobs)."""
    refs: set[str] = set()
    deltas: set[str] = set()
    for _, payload in _read(path)[0]:
        try:
            r = json.loads(payload)
        except ValueError:
            continue
        if r.get("t") == "result":
            refs.update(v for v in (r.get("stdout"), r.get("stderr"), r.get("delta")) if isinstance(v, str))
            if isinstance(r.get("delta"), str):
                deltas.add(r["delta"])
        elif r.get("t") == "intent" and isinstance(r.get("request"), dict) and r["request"].get("op") == "write":
            refs.update(f[1] for f in r["request"].get("files") or [] if isinstance(f, list) and len(f) == 3)
    return refs, deltas


def query(path: str | os.PathLike, since: int = 0, path_filter: str | None = None) -> dict:
    """The log as JSON: entries from ``since``, unknown outcomes, and (with ``path_filter``) the
    provenance of one file - which sequence numbers changed it."""
    recs, damaged = _read(path)
    entries, marks = _index(recs)
    rows = [e.to_json() for s, e in sorted(entries.items()) if s >= since]
    out = {
        "entries": rows,
        "marks": marks,
        "unknown_outcome": [s for s, e in sorted(entries.items()) if e.result is None],
        "damaged": damaged,
    }
    if path_filter is not None:
        rel = path_filter.strip("/")
        out["provenance"] = [
            s for s, e in sorted(entries.items()) if e.result and rel in (e.result.get("changed") or [])
        ]
    return out
