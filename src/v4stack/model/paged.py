"""The incremental path over paged storage: one step's flat description and the pools it reads.

The serving model runner describes a step as flat tensors (``StepBatch``): token ids, positions,
the request of every row, each request's first row / start / end position, its state slot, its
block table (one table serves every paged group: a block id names the same token span in each),
the slot mapping of the compressed entries that close in this step, and the boundary captures
(state snapshots at block ends, written straight into a snapshot slot). ``PagedCache`` holds the
pools themselves: fixed-size state per slot (``swa_kv`` window ring, ``compressor_tail`` and
``index_tail`` rings of kv and gate scores) and paged rows per block (``compressed_kv``,
``index_keys``), keyed by ``(kind, layer)`` as in ``serve/cache/spec.py``.

Layers read the pools by index - the window as ring rows, compressed entries through the block
table - and write only what the step produces: the new window and tail rows, the entries that
close, and the captures. Nothing is gathered into per-request copies, so a decode step moves
O(new rows) bytes of cache, whatever the context (``PagedCache.bytes_written`` counts them).

Ring rows a step needs are read in place in a decode step (every request feeds one token: its
row is written first, then read). A step that feeds several tokens of a request reads from the
concatenation of its requests' rings and the fresh rows, since a long chunk would overwrite ring
rows that its own early queries still need; the rings are updated afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from v4stack.ops import fused


@dataclass
class Closing:
    """Compressed entries that close in this step: request ``seq``, entry number ``entry``, and the
    row of the flattened pool they go to (``dest``, the slot mapping)."""

    seq: torch.Tensor
    entry: torch.Tensor
    dest: torch.Tensor


@dataclass
class Captures:
    """Fixed-size state to record at position ``pos`` of request ``seq`` into snapshot ``slot``."""

    seq: torch.Tensor
    pos: torch.Tensor
    slot: torch.Tensor

    def __len__(self) -> int:
        return int(self.seq.shape[0])


@dataclass
class StepBatch:
    ids: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T]
    seq: torch.Tensor  # [T] request index of each row
    row0: torch.Tensor  # [B] first row of each request
    pos0: torch.Tensor  # [B] position of that row
    end: torch.Tensor  # [B] pos0 + rows of the request
    slots: torch.Tensor  # [B] state slot
    block_table: torch.Tensor  # [B, nb] block ids, -1 padded
    max_end: int  # host copy of end.max()
    decode: bool  # every request feeds exactly one token
    closing: dict[int, Closing] = field(default_factory=dict)  # by compression ratio
    captures: Captures | None = None
    out_rows: torch.Tensor | None = None  # rows whose logits to return (default: all)
    memo: dict = field(default_factory=dict)  # index tensors every layer shares, for one model call

    def shared(self, key, make):
        """``make()`` once per model call (``V4Model.step_paged`` clears the memo first): the
        window rows, entry rows and ring destinations are the same in every layer."""
        got = self.memo.get(key)
        if got is None:
            got = self.memo[key] = make()
        return got


@dataclass
class PagedCache:
    state: dict  # (kind, layer) -> (tensor [S, R, w],) or (kv, score)
    snap: dict  # the same layout for boundary snapshots
    blocks: dict  # (kind, layer) -> tensor [n_blocks, rows, w]
    block_tokens: int
    bytes_written: int = 0

    def count(self, t: torch.Tensor) -> None:
        self.bytes_written += t.numel() * t.element_size()


@dataclass
class PagedStep:
    """What a layer's incremental path receives: the step and the pools."""

    batch: StepBatch
    cache: PagedCache


def take(pool: torch.Tensor, idx: torch.Tensor, fill: float) -> torch.Tensor:
    """Rows ``pool[idx]`` with ``fill`` where ``idx < 0``."""
    rows = pool[idx.clamp(min=0)]
    return torch.where((idx >= 0).unsqueeze(-1), rows, torch.full((), fill, dtype=rows.dtype, device=rows.device))


class Rings:
    """One kind of per-slot ring state (``R`` rows a slot, indexed ``position % R``) together with
    this step's fresh rows: maps (position, request) to a row of ``pools`` (``-1`` before 0)."""

    def __init__(self, rings: tuple[torch.Tensor, ...], fresh: tuple[torch.Tensor, ...] | None, b: StepBatch,
                 cache: PagedCache):
        """``fresh`` None (a decode step only): the caller has written this step's rows into the
        rings at ``Rings.dest`` already (``ops.fused.tail_write``); they are counted here."""
        self.rings, self.fresh, self.b, self.cache = rings, fresh, b, cache
        self.R = rings[0].shape[1]
        if b.decode:  # write first, then read in place
            if fresh is None:
                for ring in rings:
                    cache.bytes_written += b.positions.shape[0] * ring.shape[-1] * ring.element_size()
            else:
                dest = Rings.dest(b, self.R)
                for ring, new in zip(rings, fresh):
                    ring.view(-1, ring.shape[-1]).index_copy_(0, dest, new.to(ring.dtype))
                    cache.count(new)
            self.pools = tuple(r.view(-1, r.shape[-1]) for r in rings)
        else:
            self.pools = tuple(torch.cat((r[b.slots].reshape(-1, r.shape[-1]), f.to(r.dtype)))
                               for r, f in zip(rings, fresh))

    @staticmethod
    def dest(b: StepBatch, R: int) -> torch.Tensor:
        """A decode step's ring row of every row (``R`` rows a slot), shared by the layers."""
        return b.shared(("ring_dest", R), lambda: fused.ring_rows(b.positions, b.slots, R)[0])

    def rows(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Pool rows of positions ``q [n, k]`` of requests ``s [n]``."""
        b, R = self.b, self.R
        s2 = s.unsqueeze(1)
        if b.decode:
            idx = b.slots[s2] * R + q % R
        else:
            n_ring = b.slots.shape[0] * R
            idx = torch.where(q < b.pos0[s2], s2 * R + q % R, n_ring + b.row0[s2] + q - b.pos0[s2])
        return torch.where(q >= 0, idx, -1)

    def finish(self) -> None:
        """Store the fresh rows each slot keeps (its last ``R`` positions) after a multi-token step."""
        if self.b.decode:
            return
        b = self.b
        keep = b.positions >= b.end[b.seq] - self.R
        dest = (b.slots[b.seq] * self.R + b.positions % self.R)[keep]
        for ring, new in zip(self.rings, self.fresh):
            rows = new[keep].to(ring.dtype)
            ring.view(-1, ring.shape[-1]).index_copy_(0, dest, rows)
            self.cache.count(rows)

    def capture(self, snaps: tuple[torch.Tensor, ...], fills: tuple[float, ...]) -> None:
        """Write each capture's ring as it stood at its position into its snapshot slot."""
        cap = self.b.captures
        if cap is None or len(cap) == 0:
            return
        if self.b.decode:  # every ring is in its slot: one kernel a ring on CUDA (``ops.fused.ring_capture``)
            for snap, pool, fill in zip(snaps, self.pools, fills):
                fused.ring_capture(pool, snap, self.b.slots, cap.seq, cap.pos, cap.slot, self.R, fill)
                self.cache.bytes_written += cap.seq.shape[0] * self.R * pool.shape[1] * snap.element_size()
            return
        q = cap.pos.unsqueeze(1) - self.R + torch.arange(self.R, device=cap.pos.device)
        idx = self.rows(q, cap.seq)
        for snap, pool, fill in zip(snaps, self.pools, fills):
            rows = take(pool, idx, fill).to(snap.dtype)
            snap[cap.slot.unsqueeze(1), q % self.R] = rows
            self.cache.count(rows)


def entry_rows(b: StepBatch, ratio: int, block_tokens: int) -> torch.Tensor:
    """Flattened pool row of every entry ``e < max_end // ratio`` of every request ``[B, E]``
    (``-1`` where the request has no such closed entry by the end of this step)."""
    per = block_tokens // ratio
    E = b.max_end // ratio
    e = torch.arange(E, device=b.block_table.device)
    blk = b.block_table[:, (e // per).clamp(max=max(b.block_table.shape[1] - 1, 0))] if E else b.block_table[:, :0]
    rows = blk * per + e % per
    ok = (e.unsqueeze(0) < (b.end // ratio).unsqueeze(1)) & (blk >= 0)
    return torch.where(ok, rows, -1)
