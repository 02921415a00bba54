"""Context parallelism in units: bitwise the one-process gradients (``--grad-chunks U``).

``train/context.py`` splits a sequence into ``2 cp`` chunks; its forward is one process's to the
bit, but every sum over tokens in the backward is regrouped by the split. Here every sum is put in
an order the sequence fixes, so one process (``cp = 1``, the same code) and every ``cp`` with
``U / (2 cp)`` a power of two produce the same gradient bits:

- the sequence is cut into ``U`` units of ``u = T / U`` tokens; a rank holds the units of its two
  chunks (the causal load balance is unchanged) and runs attention unit by unit: a unit's
  candidates, pooled entries and window come from its **span**, the ``H`` rows before it and its
  own (``cp_comm.unit_spans``); everything that mixes rows happens inside one unit, with the same
  shapes on every layout;
- a row's gradient from the spans that hold it, and an entry's gradient from every unit that
  reads it, are added in unit order (``cp_comm.unit_spans`` / ``unit_entries``: the unit
  gradients are gathered and every owner adds them in that order);
- parameter gradients: every row step runs unit by unit with per-unit stand-ins, and the units'
  gradients are added in the tree of ``train/chunk_grads.py``.

Row-wise gradient paths (the streams into three mHC consumers, the trunk's streams into the head
and the MTP block) add their few terms in the order their data dependencies fix, the same on
every layout. The exchanges gather whole spans and per-unit entry gradients (``cp`` times the
halo traffic of ``context.py``): this is the exact mode, not the fast one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterator

import torch

from v4stack.model import rowwise
from v4stack.model.attention import Segment
from v4stack.train.chunk_grads import ChunkGrads, Runs
from v4stack.train.context import Layout, head_losses, logged_means, piece_candidates, projected_rows, shard_means
from v4stack.train.cp_comm import UnitPlan, unit_entries, unit_spans


@lru_cache(maxsize=64)
def _local_units(lay: Layout, units: int, rank: int) -> tuple[int, ...]:
    k = units // (2 * lay.cp)
    return tuple(c * k + t for c in lay.chunks(rank) for t in range(k))


@lru_cache(maxsize=64)
def unit_plan(lay: Layout, units: int, halo: int) -> UnitPlan:
    u, U, cp = lay.seq_len // units, units, lay.cp
    span = halo + u
    owner = {}
    for r in range(cp):
        for i, v in enumerate(_local_units(lay, U, r)):
            owner[v] = (r, i)
    mine = _local_units(lay, U, lay.rank)
    n_lu, n_rows = len(mine), len(mine) * u
    span_idx = []
    for v in mine:
        for k in range(span):
            p = v * u - halo + k
            if p < 0:
                span_idx.append(0)
            else:
                r, i = owner[p // u]
                span_idx.append(1 + r * n_rows + i * u + p % u)
    depth = 1 + (u - 1 + halo) // u
    zero = cp * n_lu * span
    back = []
    for d in range(depth):
        for v0 in mine:
            for t in range(u):
                p, v = v0 * u + t, v0 + d
                slot = p - v * u + halo
                if v < U and slot >= 0:
                    r, i = owner[v]
                    back.append((r * n_lu + i) * span + slot)
                else:
                    back.append(zero)
    slots = tuple(owner[v][0] * n_lu + owner[v][1] for v in range(U))
    return UnitPlan(cp, lay.rank, span, tuple(span_idx), tuple(back), depth, slots)


@lru_cache(maxsize=64)
def entry_plan(lay: Layout, units: int, r: int):
    """(capacity, per local unit its block range, gather order over ``[cp, units, cap]``)."""
    u, U = lay.seq_len // units, units
    blocks = [(v * u // r, (v + 1) * u // r) for v in range(U)]
    cap = max(hi - lo for lo, hi in blocks)
    owner = {}
    for rk in range(lay.cp):
        for i, v in enumerate(_local_units(lay, U, rk)):
            owner[v] = (rk, i)
    n_lu = 2 * (U // (2 * lay.cp))
    order = []
    for v, (lo, hi) in enumerate(blocks):
        rk, i = owner[v]
        order += [(rk * n_lu + i) * cap + e for e in range(hi - lo)]
    return cap, tuple(blocks[v] for v in _local_units(lay, U, lay.rank)), tuple(order)


@dataclass
class UnitShard:
    """The segment list of ``V4Model._trunk`` under unit pieces (``attention`` builds candidates)."""

    layout: Layout
    batch: int
    units: int
    group: object = None
    pieces: list[Segment] = field(init=False)

    def __post_init__(self):
        lay, U = self.layout, self.units
        self.u = lay.seq_len // U
        self.mine = _local_units(lay, U, lay.rank)
        n = len(self.mine)
        self.pieces = [Segment(start=(b * n + i) * self.u, length=self.u, pos0=v * self.u)
                       for b in range(self.batch) for i, v in enumerate(self.mine)]

    def runs(self) -> Runs:
        """The trunk's rows by unit (sequence ``b``'s unit ``v`` is unit ``b U + v``)."""
        n = len(self.mine)
        return Runs(tuple((b * self.units + v, (b * n + i) * self.u, (b * n + i + 1) * self.u)
                          for b in range(self.batch) for i, v in enumerate(self.mine)), self.batch * n * self.u)

    def attention(self, attn, x, qr, q, kv, positions, layer: int) -> torch.Tensor:
        B, u, n = self.batch, self.u, len(self.mine)
        parts, comps, iq, iw, H, wire, widths = projected_rows(attn, x, qr, kv, positions)
        rows = torch.cat([p.to(wire) for p in parts], -1).view(B, n * u, -1).transpose(0, 1)
        spans = unit_spans(rows, unit_plan(self.layout, self.units, H), self.group)  # [n, H+u, B, w]
        spans = spans.permute(2, 0, 1, 3)  # [B, n, H+u, w]
        sp = [s.to(p.dtype) for s, p in zip(torch.split(spans, widths, -1), parts)]

        def span(i: int, b: int, s: int, k: int) -> torch.Tensor:
            """Part ``i``'s rows of the ``k`` positions before unit piece (b, s), then its own."""
            return sp[i][b, s, H - k:]

        ents = ikeys = None
        if comps:
            pooled = [self._pool(comp, span, 1 + 2 * k, kv.dtype) for k, comp in enumerate(comps)]
            cap, _, order = entry_plan(self.layout, self.units, comps[0].ratio)
            idx = torch.tensor(order, dtype=torch.long, device=kv.device)
            gathered = unit_entries(torch.cat(pooled, -1), idx, unit_plan(self.layout, self.units, H), self.group)
            ents = gathered[..., : attn.head_dim]  # [n, S, B, c]: one copy per local unit
            if attn.indexer is not None:
                ikeys = gathered[..., attn.head_dim:]
        cands = [piece_candidates(attn, piece, lambda h, b=b, s=s: span(0, b, s, h), positions, iq, iw,
                                  None if ents is None else ents[s, :, b], None if ikeys is None else ikeys[s, :, b])
                 for piece, (b, s) in zip(self.pieces, ((b, s) for b in range(B) for s in range(n)))]
        outs = []  # one attention call per piece: its rows are one unit, whatever the model's budget
        for piece, cand, run in zip(self.pieces, cands, self.runs().runs):
            with ChunkGrads.rows(Runs(((run[0], 0, u),), u)):
                outs.append(attn._attend(q, [piece], [cand]))
        return torch.cat(outs)

    def _pool(self, comp, span, part: int, dtype) -> torch.Tensor:
        """Entries ``[n, cap, B, w]`` of ``comp`` for the local units (zero padding past each
        unit's blocks); a unit pools the blocks whose last token it holds."""
        r, lb = comp.ratio, comp.ratio if comp.overlap else 0
        cap, mine, _ = entry_plan(self.layout, self.units, r)
        out = []
        for b in range(self.batch):
            for s, (lo, hi) in enumerate(mine):
                v = self.mine[s]
                p0 = v * self.u
                row0 = max(0, lo * r - lb)
                kv_rows, sc_rows = span(part, b, s, p0 - row0), span(part + 1, b, s, p0 - row0)
                with ChunkGrads.rows(Runs(((b * self.units + v, 0, hi - lo),) if hi > lo else (), hi - lo)):
                    e = comp.pool(kv_rows, sc_rows, row0, range(lo, hi), dtype)
                out.append(torch.cat((e, e.new_zeros(cap - e.shape[0], e.shape[1]))))
        return torch.stack(out).view(self.batch, len(mine), cap, -1).permute(1, 2, 0, 3)


def unit_losses(model, tokens: torch.Tensor, layout: Layout, units: int, group=None, mtp: bool = False):
    """This rank's per-token losses (``context.ShardLosses``) under unit pieces."""
    B, T = tokens.shape
    pos = layout.positions(B, tokens.device)
    shard = UnitShard(layout, B, units, group)
    with ChunkGrads.rows(shard.runs()):
        h = model._trunk(layout.local(tokens).reshape(-1), pos, shard)
        return head_losses(model, h, tokens, shard, pos, mtp)


@contextlib.contextmanager
def chunk_forward(hook: ChunkGrads | None, shard: UnitShard, micro: int = 0) -> Iterator[None]:
    """Micro-batch ``micro``'s forward with the hook installed and the trunk's rows told."""
    if hook is None:
        yield
        return
    hook.begin(micro)
    hook.shards[micro] = shard
    with rowwise.installed(hook), ChunkGrads.rows(shard.runs()):
        yield


@contextlib.contextmanager
def chunk_backward(hook: ChunkGrads | None, mesh, micro: int = 0) -> Iterator[None]:
    """Micro-batch ``micro``'s backward (a recompute re-runs row steps under the same hook); then
    its chunk-ordered gradients land on the replica's first shard's ``.grad`` (the other shards'
    stay zero, so the sharded step's sum over shards changes no bit)."""
    if hook is None:
        yield
        return
    shard = hook.shards.pop(micro)
    held = {n: p.grad for n, p in hook.params.items()}
    for p in hook.params.values():
        p.grad = None
    with rowwise.installed(hook), ChunkGrads.rows(shard.runs()):
        yield
    stray = [n for n, p in hook.params.items() if p.grad is not None]
    if stray:
        raise RuntimeError(f"parameters used outside a row step (their gradient skipped the chunk order): {stray}")
    got = hook.finish(shard.batch, mesh.cp, mesh.cp_rank, mesh.cp_group, micro)
    for n, p in hook.params.items():
        g = held[n]
        if n in hook.deferred:
            p.grad = g
        elif got is None:
            p.grad = torch.zeros_like(p) if g is None else g
        else:
            p.grad = got[n] if g is None else g + got[n]


def chunked_accumulate(model, hook: ChunkGrads, micro: list[torch.Tensor], scale: float, mesh,
                       mtp_weight: float = 0.0) -> torch.Tensor:
    """``context.cp_accumulate`` with chunk-ordered gradients (one process is ``mesh.cp == 1``)."""
    sums = torch.zeros(2, dtype=torch.float32, device=micro[0].device)
    for tokens in micro:
        B, T = tokens.shape
        lay = Layout(mesh.cp, mesh.cp_rank, T)
        shard = UnitShard(lay, B, hook.units, mesh.cp_group)
        with chunk_forward(hook, shard):
            res = unit_losses(model, tokens, lay, hook.units, mesh.cp_group, mtp=mtp_weight > 0)
            total, extra_part = shard_means(res, tokens)
            if extra_part is not None:
                total = total + mtp_weight * extra_part
        with chunk_backward(hook, mesh):
            (total * scale).backward()
        value, extra = logged_means(res, lay, mesh.cp_group)
        if mesh.cp_rank == 0:
            sums[0] += value.item()
            sums[1] += 0.0 if extra is None else extra.item()
    return sums
