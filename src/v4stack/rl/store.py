"""The RL data path: a metadata table per trajectory, heavy fields elsewhere, one consumption each.

The table is columnar (numpy): group, worker, prompt and generated lengths, reward, policy version,
rollout round, state (``READY`` -> ``LEASED`` -> ``CONSUMED``). The batch selector reads only these
columns - like a database ordering an index before it fetches wide columns - so selecting a batch
over a million trajectories costs a few vectorised passes over a few bytes per row, whatever the
trajectories' lengths. Heavy fields (token ids, rollout log-probs, loss masks) are handles: Ray
object references (in the object store, put there by the rollout actor that made them) or plain
in-process objects; only the selected rows' handles are resolved, by the trainer, and a row's
handle is dropped once it is consumed (which frees the object).

A trajectory is consumed once: ``lease`` hands a selected batch out, ``consume`` makes it final,
``release`` returns a lease that was not trained (a trainer that died mid-step). Durability is not
here: CONSUMED marks live in the rollout WALs, written after the trainer's checkpoint names them
(see ``grpo.py``); a restarted loop rebuilds this table from the WALs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

READY, LEASED, CONSUMED = 0, 1, 2
_COLS = {"group": np.int64, "worker": np.int16, "prompt_len": np.int32, "gen_len": np.int32,
         "reward": np.float32, "version": np.int32, "round": np.int32, "state": np.uint8}


@dataclass
class Batch:
    rows: np.ndarray  # rows to train on (whole groups with some reward spread)
    flat: np.ndarray  # rows of whole groups whose rewards are all equal (no gradient: consumed untrained)


class MetaTable:
    def __init__(self, capacity: int = 1024):
        self.n = 0
        self.cols = {k: np.zeros(capacity, dt) for k, dt in _COLS.items()}
        self.ids: list[str] = []
        self.heavy: list = []
        self.index: dict[str, int] = {}
        self.workers: list[str] = []
        self._worker_ix: dict[str, int] = {}
        self._group_ix: dict[str, int] = {}

    def __len__(self) -> int:
        return self.n

    def _grow(self, need: int) -> None:
        cap = len(self.cols["group"])
        if need <= cap:
            return
        new = max(need, 2 * cap)
        for k, a in self.cols.items():
            b = np.zeros(new, a.dtype)
            b[: self.n] = a[: self.n]
            self.cols[k] = b

    def add(self, metas: list[dict], heavy: list | None = None) -> np.ndarray:
        """Append trajectories (``traj, worker, group, prompt_len, gen_len, reward, version,
        round``); a trajectory already in the table is skipped. Returns the new rows."""
        heavy = heavy if heavy is not None else [None] * len(metas)
        fresh = [(m, h) for m, h in zip(metas, heavy) if m["traj"] not in self.index]
        self._grow(self.n + len(fresh))
        rows = np.arange(self.n, self.n + len(fresh))
        for r, (m, h) in zip(rows, fresh):
            w = self._worker_ix.setdefault(m["worker"], len(self._worker_ix))
            if w == len(self.workers):
                self.workers.append(m["worker"])
            g = self._group_ix.setdefault(m["group"], len(self._group_ix))
            c = self.cols
            c["group"][r], c["worker"][r] = g, w
            c["prompt_len"][r], c["gen_len"][r] = m["prompt_len"], m["gen_len"]
            c["reward"][r], c["version"][r], c["round"][r] = m["reward"], m["version"], m.get("round", 0)
            c["state"][r] = CONSUMED if m.get("consumed") else READY
            self.index[m["traj"]] = int(r)
            self.ids.append(m["traj"])
            self.heavy.append(h)
        self.n += len(fresh)
        return rows

    def add_columns(self, n: int, **cols: np.ndarray) -> None:
        """Bulk append of ``n`` rows from column arrays (ids ``t<row>``; for tests and benchmarks)."""
        self._grow(self.n + n)
        for k, a in cols.items():
            self.cols[k][self.n : self.n + n] = a
        start = self.n
        self.ids.extend(f"t{i}" for i in range(start, start + n))
        self.index.update((f"t{i}", i) for i in range(start, start + n))
        self.heavy.extend([None] * n)
        self.n += n

    def col(self, name: str) -> np.ndarray:
        return self.cols[name][: self.n]

    # ---- selection --------------------------------------------------------------------------

    def select(self, groups: int, group_size: int, min_version: int = 0, max_tokens: int | None = None) -> Batch:
        """The oldest ``groups`` complete groups of ``READY`` rows with version >= ``min_version``
        (token budget ``max_tokens`` over prompt + generated lengths, when given). Reads metadata only."""
        state, ver, grp = self.col("state"), self.col("version"), self.col("group")
        ok = np.flatnonzero((state == READY) & (ver >= min_version))
        if ok.size == 0 or groups < 1:
            return Batch(np.zeros(0, np.int64), np.zeros(0, np.int64))
        g = grp[ok]
        uniq, first, inv, counts = np.unique(g, return_index=True, return_inverse=True, return_counts=True)
        complete = np.flatnonzero(counts == group_size)
        complete = complete[np.argsort(ok[first[complete]], kind="stable")]  # oldest group first
        rew = self.col("reward")[ok]
        s1 = np.bincount(inv, rew, minlength=len(uniq))
        s2 = np.bincount(inv, rew.astype(np.float64) ** 2, minlength=len(uniq))
        spread = (s2 / counts - (s1 / counts) ** 2) > 1e-12
        if max_tokens is not None:
            toks = np.bincount(inv, (self.col("prompt_len")[ok] + self.col("gen_len")[ok]).astype(np.float64),
                               minlength=len(uniq))
            take = complete[np.cumsum(toks[complete]) <= max_tokens][:groups]
        else:
            take = complete[:groups]
        chosen = np.zeros(len(uniq), bool)
        chosen[take] = True
        pick = chosen[inv]
        train = pick & spread[inv]
        return Batch(ok[train], ok[pick & ~spread[inv]])

    # ---- state changes ----------------------------------------------------------------------

    def _set(self, rows: np.ndarray, frm: tuple[int, ...], to: int) -> None:
        st = self.cols["state"]
        bad = ~np.isin(st[rows], frm)
        if bad.any():
            r = int(rows[np.flatnonzero(bad)[0]])
            raise ValueError(f"trajectory {self.ids[r]!r}: state {int(st[r])}, expected one of {frm}")
        st[rows] = to

    def lease(self, rows: np.ndarray) -> None:
        self._set(rows, (READY,), LEASED)

    def release(self, rows: np.ndarray) -> None:
        self._set(rows, (LEASED,), READY)

    def consume(self, rows: np.ndarray) -> None:
        self._set(rows, (LEASED,), CONSUMED)
        for r in rows:
            self.heavy[int(r)] = None  # the heavy fields are no longer referenced: freed

    def by_worker(self, rows: np.ndarray) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        w = self.cols["worker"]
        for r in rows:
            out.setdefault(self.workers[int(w[r])], []).append(self.ids[int(r)])
        return out

    def handles(self, rows: np.ndarray) -> list:
        """The heavy-field handles of ``rows`` only (resolved by whoever trains on them)."""
        return [self.heavy[int(r)] for r in rows]
