"""A rollout worker: owns an ``Engine`` and a ``TokenWAL`` and enforces the commit order

    generate token -> append its WAL record -> record durable -> expose to client / environment

The engine reports each sampled token through ``on_event``; the worker only buffers it. After the
engine's step the buffered tokens become TOKENS (and END) records, written as one batch (one
fsync). ``_expose`` is the only path to the ``expose`` callback and refuses any batch whose end is
past the WAL's durable position, so no caller can see a token the log could still lose.

``pipeline=True`` overlaps the fsync of step k with the decode of step k+1 (the tokens of step k
are exposed after that fsync, one step later); ``pipeline=False`` waits for the fsync inline.
Either way the engine's own feedback of a sampled token into its next step is not exposure: a
token lost in a crash before its record was durable was seen by no one and is sampled again,
identically, on recovery.

Preemption saves the request's cache (``rollout/kvsave.py``) and writes PREEMPT with the file's
handle; ``resume`` loads it back into the engine, or - if the file is missing, corrupt, or there
is no room - re-prefills the durable tokens (prompt + output are fed again, never re-sampled; draw i
depends only on the seed and i, so nothing needs advancing). ``recover`` does the same for
every unfinished trajectory after a restart. The engine runs its ops in invariant mode, so either
path continues bit-identically to an uninterrupted run.

With a ``prefix_store`` (``serve/cache/disk.py``) the worker saves the closed blocks of its live
requests every ``save_every`` steps and restores a prompt's stored prefix before admitting it, so a
re-prefill after a restart computes only what the store does not hold.

Every TOKENS record carries the sampled tokens' log-probabilities (``lp``): the log-softmax of the
logits at the request's temperature (1 when greedy), taken where the engine samples (the
request's sampler is wrapped), which is what an importance ratio against the rollout policy needs.

The worker preempts and resumes through the engine's public ``detach`` (take a request out
without finishing it) and ``attach`` (run one whose cache is already restored).
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from v4stack.rollout import kvsave
from v4stack.rollout import records as R
from v4stack.rollout.wal import TokenWAL, Trajectory
from v4stack.serve.cache.disk import DiskPrefixStore
from v4stack.serve.cache.manager import CacheFull
from v4stack.serve.engine import Engine
from v4stack.serve.request import Request
from v4stack.serve.sampling import SamplingParams


@dataclass(frozen=True)
class Exposure:
    """What a client or environment receives: tokens ``[off, off + len(ids))`` of ``traj``."""

    traj: str
    off: int
    ids: tuple[int, ...]
    finished: bool
    reason: str | None
    record_end: int  # log position the carrying records end at
    durable_lsn: int  # the WAL's durable position when this was exposed (>= record_end)


class NotDurable(RuntimeError):
    """An attempt to expose tokens whose records are not durable yet."""


@dataclass
class WorkerStats:
    steps: int = 0
    step_s: list[float] = field(default_factory=list)  # engine.step() alone
    wal_s: list[float] = field(default_factory=list)  # WAL time on the decode critical path, per step
    records: int = 0
    bytes: int = 0
    resumed: dict[str, int] = field(default_factory=lambda: {"reused": 0, "reprefilled": 0})


def _kv_name(traj: str, off: int) -> str:
    return f"{hashlib.blake2b(traj.encode(), digest_size=8).hexdigest()}-{off}.kv"


def track_logprobs(req: Request) -> None:
    """Expose each sampled token's log-probability (the engine's sampler records it: ``req.draws``)."""
    req.expose_logprobs = True


class RolloutWorker:
    def __init__(self, engine: Engine, wal: TokenWAL, expose: Callable[[Exposure], None] | None = None,
                 kv_dir: str | os.PathLike | None = None, server: str | None = None, policy_version: int = 0,
                 pipeline: bool = False, prefix_store: DiskPrefixStore | None = None, save_every: int = 0):
        if save_every < 0:
            raise ValueError(f"save_every must be >= 0, got {save_every}")
        self.engine, self.wal, self.expose = engine, wal, expose
        self.prefix_store, self.save_every = prefix_store, save_every
        self.kv_dir = Path(kv_dir) if kv_dir is not None else wal.path / "kv"
        self.kv_dir.mkdir(parents=True, exist_ok=True)
        self.server = server or f"{socket.gethostname()}:{os.getpid()}"
        self.policy_version = policy_version
        self.pipeline = pipeline
        self.live: dict[str, Request] = {}
        self.stats = WorkerStats()
        self._new: list[tuple[str, list[int], bool, str | None]] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="v4stack-wal-sync") if pipeline else None
        self._inflight: tuple[Future, int, list[tuple]] | None = None

    # ---- the commit order ----------------------------------------------------------------

    def _on_event(self, req: Request, toks: list[int], finished: bool) -> None:
        lps = []
        if toks and getattr(req, "expose_logprobs", False):
            lps = [d.sampled_logprob for d in req.draws[-len(toks):]]
        self._new.append((req.id, list(toks), finished, req.finish_reason, lps))

    def _records(self) -> tuple[list[dict], list[tuple]]:
        """Turn buffered engine events into records and the exposures they will allow."""
        merged: dict[str, list] = {}
        for tid, toks, finished, reason, lps in self._new:
            m = merged.setdefault(tid, [[], False, None, []])
            m[0].extend(toks)
            m[3].extend(lps)
            if finished:
                m[1], m[2] = True, reason
        self._new.clear()
        recs, items = [], []
        for tid, (toks, finished, reason, lps) in merged.items():
            off = len(self.wal.trajectories[tid].tokens)
            if toks:
                recs.append(R.tokens(tid, off, toks, self.policy_version, lps if len(lps) == len(toks) else None))
            if finished and self._turn_ended(tid, reason):
                finished = False  # a tool call follows: the trajectory stays open
            if finished:
                recs.append(R.end(tid, off + len(toks), reason or "abort"))
                self.live.pop(tid, None)
            items.append((tid, off, tuple(toks), finished, reason))
        return recs, items

    def _turn_ended(self, traj: str, reason: str | None) -> bool:
        """Whether the engine's finish of ``traj`` ends a turn of a multi-turn trajectory rather
        than the trajectory (no END then); a multi-turn driver overrides this."""
        return False

    def _expose(self, items: list[tuple], end: int) -> None:
        durable = self.wal.durable_lsn
        if durable < end:
            raise NotDurable(f"refusing to expose tokens of records ending at {end}: the WAL is durable to {durable}")
        if self.expose is None:
            return
        for tid, off, ids, finished, reason in items:
            self.expose(Exposure(tid, off, ids, finished, reason, end, durable))

    def _drain_inflight(self) -> None:
        if self._inflight is not None:
            fut, end, items = self._inflight
            self._inflight = None
            fut.result()
            self._expose(items, end)

    def step(self) -> int:
        """One engine step, its records, and the exposures now allowed; returns tokens generated."""
        t0 = time.perf_counter()
        self.engine.step()
        t1 = time.perf_counter()
        recs, items = self._records()
        if self.pipeline:
            self._drain_inflight()  # the previous step's fsync ran during this step's decode
            if recs:
                _, end = self.wal.write(recs)
                self._inflight = (self._pool.submit(self.wal.sync, end), end, items)
        elif recs:
            end = self.wal.append(recs)
            self._expose(items, end)
        t2 = time.perf_counter()
        s = self.stats
        s.steps += 1
        s.step_s.append(t1 - t0)
        s.wal_s.append(t2 - t1)
        s.records += len(recs)
        if self.prefix_store is not None and self.save_every and s.steps % self.save_every == 0:
            for req in self.live.values():  # the blocks this request has closed so far
                if req.cache is not None:
                    self.prefix_store.save(req.cache.tokens)
        return sum(len(i[2]) for i in items)

    def flush(self) -> None:
        """Wait for the last batch's fsync and expose it."""
        self._drain_inflight()

    def run(self, max_steps: int | None = None) -> None:
        n = 0
        while self.engine.has_work() and (max_steps is None or n < max_steps):
            self.step()
            n += 1
        self.flush()

    # ---- trajectories --------------------------------------------------------------------

    def submit(self, traj: str, prompt: list[int], params: SamplingParams, group: str = "",
               sandbox: str | None = None) -> None:
        """Start a trajectory: the engine checks the request, then BEGIN is made durable."""
        if traj in self.wal.trajectories:
            raise ValueError(f"trajectory id {traj!r} is already in the WAL")
        req = self.engine.add_request(prompt, params, traj, self._on_event)
        track_logprobs(req)
        self._restore_prefix(prompt)
        try:
            self.wal.append([R.begin(traj, prompt, req.params, group, self.policy_version, sandbox)])
        except BaseException:
            self._detach(req)
            raise
        self.live[traj] = req

    def cancel(self, traj: str) -> None:
        """End a running or preempted trajectory early (END with reason 'abort'), durably."""
        self.flush()
        tr = self.wal.trajectories.get(traj)
        if tr is None or tr.finished:
            raise ValueError(f"trajectory {traj!r} is not an unfinished trajectory")
        saved = tr.kv
        if traj in self.live:
            self.engine.abort(traj)  # reports (req, [], finished) through _on_event
        else:
            self._new.append((traj, [], True, "abort", []))
        recs, items = self._records()
        end = self.wal.append(recs)
        self._expose(items, end)
        if saved is not None:
            (self.kv_dir / saved["file"]).unlink(missing_ok=True)

    def reward(self, traj: str, value: float) -> None:
        self.wal.append([R.reward(traj, value)])

    def consume(self, traj: str, step: int) -> None:
        """Mark a finished trajectory as trained on at ``step`` (refused if it already was)."""
        self.wal.append([R.consumed(traj, step)])

    def _restore_prefix(self, tokens: list[int]) -> None:
        """Put what the on-disk prefix store has of ``tokens`` back into the cache before the
        request is admitted (bit-identical to computing it, so this only saves time)."""
        if self.prefix_store is not None:
            try:
                self.prefix_store.restore(tokens)
            except CacheFull:
                pass

    def _detach(self, req: Request) -> None:
        self.engine.detach(req)

    def _attach(self, req: Request, rc) -> None:
        self.engine.attach(req, rc)

    def preempt(self, traj: str, save_kv: bool = True, reason: str = "preempt") -> dict | None:
        """Take ``traj`` out of the engine, saving its cache when asked; returns the KV handle."""
        self.flush()
        req = self.live.get(traj)
        if req is None:
            raise ValueError(f"trajectory {traj!r} is not running in this worker")
        off = len(self.wal.trajectories[traj].tokens)
        handle = None
        if save_kv and req.cache is not None and req.cache.pos > 0:
            handle = kvsave.save(self.engine.cache, req.cache, self.kv_dir / _kv_name(traj, off))
        self.wal.append([R.preempt(traj, off, reason, handle)])
        self._detach(req)
        del self.live[traj]
        return handle

    def resume(self, traj: str) -> str:
        """Bring an unfinished trajectory back into the engine: 'reused' (saved cache) or 'reprefilled'."""
        tr = self.wal.trajectories.get(traj)
        if tr is None or tr.finished or traj in self.live:
            raise ValueError(f"trajectory {traj!r} is not an unfinished trajectory outside the engine")
        if self._complete(tr):
            return "ended"
        req = self.engine.add_request(tr.prompt, tr.params, traj, self._on_event)
        req.output = list(tr.tokens)  # draw i depends on (seed, i) only: nothing to advance
        track_logprobs(req)
        mode, why, used = "reprefilled", "no saved cache", None
        if tr.kv is not None:
            path = self.kv_dir / tr.kv["file"]
            try:
                saved = kvsave.load(self.engine.cache, path, tr.kv, tr.prompt + tr.tokens)
                self._attach(req, kvsave.restore(self.engine.cache, saved))
                mode, why, used = "reused", "", path
            except (kvsave.KVUnavailable, CacheFull) as e:
                why = str(e)
        if mode == "reprefilled":
            self._restore_prefix(tr.prompt + tr.tokens)
        try:
            self.wal.append([R.resume(traj, len(tr.tokens), self.server, self.policy_version, mode, why)])
        except BaseException:
            self._detach(req)
            raise
        self.live[traj] = req
        self.stats.resumed[mode] += 1
        if used is not None:
            used.unlink(missing_ok=True)
        return mode

    def _complete(self, tr: Trajectory) -> bool:
        """End a trajectory whose durable tokens already reach its stop (crash before END)."""
        probe = Request(tr.traj, tr.prompt, tr.params, output=list(tr.tokens))
        if len(tr.tokens) < tr.params.max_tokens and not probe.hit_stop():
            return False
        reason = "stop" if probe.hit_stop() else "length"
        end = self.wal.append([R.end(tr.traj, len(tr.tokens), reason)])
        self._expose([(tr.traj, len(tr.tokens), (), True, reason)], end)
        return True

    def redeliver(self, traj: str, start: int) -> None:
        """Expose the durable tokens of ``traj`` from offset ``start`` (a client that saw fewer
        before a crash asks for the rest; an ended trajectory also gets its end)."""
        tr = self.wal.trajectories[traj]
        end = self.wal.durable_lsn
        if start < len(tr.tokens) or tr.finished:
            self._expose([(traj, start, tuple(tr.tokens[start:]), tr.finished, tr.end_reason)], end)

    def recover(self) -> dict[str, str]:
        """After a restart: resume every unfinished trajectory; drop saved caches nobody names."""
        out = {tid: self.resume(tid) for tid in [t.traj for t in self.wal.unfinished() if t.traj not in self.live]}
        named = {t.kv["file"] for t in self.wal.unfinished() if t.kv is not None}
        for p in self.kv_dir.glob("*.kv"):
            if p.name not in named:
                p.unlink(missing_ok=True)
        for p in self.kv_dir.glob(".*.tmp-*"):
            p.unlink(missing_ok=True)
        return out

    def close(self) -> None:
        self.flush()
        if self._pool is not None:
            self._pool.shutdown()
        self.wal.close()
