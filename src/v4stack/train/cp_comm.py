"""The two exchanges of context parallelism, as autograd functions with fixed-order backwards.

Both move rows laid out position-major, ``[rows, B, width]`` (one row per position, every sequence
of the micro-batch side by side), so a plan written for positions serves any batch size.

- ``exchange_rows``: the halo. Each rank sends the rows other ranks need (named by a static
  ``RowPlan``) with one ``all_to_all``; the receiver places them at fixed halo slots (slots whose
  position is before the sequence start stay zero). Backward runs the same routes in reverse and
  adds each returned gradient onto its source row, destinations in rank order.
- ``gather_entries``: the compressed entries (and indexer keys). Every rank contributes a fixed
  capacity per local chunk (the unused tail is padding); one ``all_gather``, then a static index
  selects the real entries in sequence order (padding dropped). Backward: each rank scatters its
  gradient back to the ``[rank, slot, capacity]`` layout, one ``all_to_all`` sends each owner the
  gradients of its entries from every rank, and the owner adds them in rank order 0, 1, ...

No atomics: index additions with repeated targets are split into passes without repeats, applied
in a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RowPlan:
    """Static routes of one rank's halo exchange (every rank computes every rank's plan)."""

    send_rows: tuple[int, ...]  # local rows to send, grouped by destination rank in rank order
    send_counts: tuple[int, ...]  # per destination rank
    recv_slots: tuple[int, ...]  # halo slots the received rows fill, grouped by source rank
    recv_counts: tuple[int, ...]  # per source rank
    halo_rows: int  # total halo slots on this rank


def ordered_index_add(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst[idx[i]] += src[i]`` for i in order, without atomics: passes of distinct targets."""
    if idx.numel() == 0:
        return dst
    seen: dict[int, int] = {}
    rank = []
    for i in idx.tolist():
        rank.append(seen.get(i, 0))
        seen[i] = rank[-1] + 1
    rank_t = torch.tensor(rank, device=idx.device)
    for r in range(max(rank) + 1):
        sel = (rank_t == r).nonzero().squeeze(1)
        dst.index_add_(0, idx[sel], src[sel])
    return dst


def _joins_backward(t: torch.Tensor) -> torch.Tensor:
    """Every rank must run an exchange's backward (it is a collective), also a rank whose share
    carries no gradient (e.g. chunks that close no block: their entries are all padding)."""
    if torch.is_grad_enabled() and not t.requires_grad:
        return t.detach().requires_grad_(True)
    return t


def _a2a(recv_shape, send: torch.Tensor, out_counts, in_counts, group) -> torch.Tensor:
    recv = send.new_empty(recv_shape)
    dist.all_to_all_single(recv, send.contiguous(), list(out_counts), list(in_counts), group=group)
    return recv


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, plan: RowPlan, group):
        dev = rows.device
        send_idx = torch.tensor(plan.send_rows, dtype=torch.long, device=dev)
        recv_idx = torch.tensor(plan.recv_slots, dtype=torch.long, device=dev)
        tail = rows.shape[1:]
        recv = _a2a((len(plan.recv_slots), *tail), rows.index_select(0, send_idx), plan.recv_counts,
                    plan.send_counts, group)
        halo = rows.new_zeros((plan.halo_rows, *tail))
        halo.index_copy_(0, recv_idx, recv)
        ctx.save_for_backward(send_idx, recv_idx)
        ctx.plan, ctx.group, ctx.n_rows = plan, group, rows.shape[0]
        return halo

    @staticmethod
    def backward(ctx, g_halo: torch.Tensor):
        send_idx, recv_idx = ctx.saved_tensors
        plan = ctx.plan
        g_back = _a2a((len(plan.send_rows), *g_halo.shape[1:]), g_halo.index_select(0, recv_idx),
                      plan.send_counts, plan.recv_counts, ctx.group)
        g_rows = g_halo.new_zeros((ctx.n_rows, *g_halo.shape[1:]))
        return ordered_index_add(g_rows, send_idx, g_back), None, None


def exchange_rows(rows: torch.Tensor, plan: RowPlan, group=None) -> torch.Tensor:
    """Local rows ``[n, B, w]`` -> this rank's halo ``[plan.halo_rows, B, w]`` (differentiable)."""
    return _ExchangeRows.apply(_joins_backward(rows), plan, group)


class _GatherEntries(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, order: torch.Tensor, world: int, group):
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        full = torch.stack(parts)  # [world, *local.shape]
        flat = full.view(-1, *local.shape[2:])  # [world * slots * cap, B, w]
        ctx.save_for_backward(order)
        ctx.world, ctx.group, ctx.local_shape = world, group, local.shape
        return flat.index_select(0, order)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (order,) = ctx.saved_tensors
        world, shape = ctx.world, ctx.local_shape
        flat = g.new_zeros((world * shape[0] * shape[1], *shape[2:]))
        flat.index_copy_(0, order, g)  # each entry has one source slot: no repeated targets
        per_rank = flat.view(world, -1)
        recv = torch.empty_like(per_rank)
        dist.all_to_all_single(recv, per_rank.contiguous(), group=ctx.group)
        acc = recv[0].clone()
        for r in range(1, world):  # the owner adds every rank's gradient, in rank order
            acc = acc + recv[r]
        return acc.view(shape), None, None, None


def gather_entries(local: torch.Tensor, order: torch.Tensor, world: int, group=None) -> torch.Tensor:
    """Local entries ``[slots, cap, B, w]`` (padding past each slot's count) -> every rank's real
    entries in sequence order ``[len(order), B, w]``; ``order`` indexes the flattened
    ``[world, slots, cap]`` layout."""
    return _GatherEntries.apply(_joins_backward(local), order, world, group)


# ---- unit pieces: every cross-row gradient added in unit order (train/unit_shard.py) ----------


def _gather(t: torch.Tensor, world: int, group) -> list[torch.Tensor]:
    if world == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


@dataclass(frozen=True)
class UnitPlan:
    """Static indices of the unit exchanges of one rank (``train/unit_shard.py`` builds them).

    ``span_idx [n_local_units * span]``: each local unit's span rows in ``1 + every rank's local
    rows`` (0: a zero row before the sequence start); ``back_idx [depth * n_local_rows]``: for each
    local row, offset ``d`` = the ``d``-th unit at or after its own, the slot of that unit's span
    gradient holding the row in ``every rank's span gradients + one zero slot``."""

    world: int
    rank: int
    span: int
    span_idx: tuple[int, ...]
    back_idx: tuple[int, ...]
    depth: int
    unit_slots: tuple[int, ...]  # global unit order -> rank * n_local_units + local index


class _UnitSpans(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, plan: UnitPlan, group):
        tail = rows.shape[1:]
        parts = _gather(rows, plan.world, group)
        flat = torch.cat([rows.new_zeros((1, *tail))] + parts)
        idx = torch.tensor(plan.span_idx, dtype=torch.long, device=rows.device)
        ctx.plan, ctx.group, ctx.n = plan, group, rows.shape[0]
        return flat.index_select(0, idx).view(-1, plan.span, *tail)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        plan = ctx.plan
        tail = g.shape[2:]
        parts = _gather(g.contiguous(), plan.world, ctx.group)
        flat = torch.cat([p.reshape(-1, *tail) for p in parts] + [g.new_zeros((1, *tail))])
        idx = torch.tensor(plan.back_idx, dtype=torch.long, device=g.device)
        c = flat.index_select(0, idx).view(plan.depth, ctx.n, *tail)
        acc = c[0]
        for d in range(1, plan.depth):  # the row's own unit first, then later units in order
            acc = acc + c[d]
        return acc, None, None


def unit_spans(rows: torch.Tensor, plan: UnitPlan, group=None) -> torch.Tensor:
    """Local rows ``[n, B, w]`` (position-major) -> each local unit's span ``[units, span, B, w]``:
    the ``span - unit`` rows before the unit (zeros before the sequence start), then its own. The
    backward adds every row's gradient over the units whose spans hold it, in unit order."""
    return _UnitSpans.apply(_joins_backward(rows), plan, group)


class _UnitEntries(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, order: torch.Tensor, plan: UnitPlan, group):
        parts = _gather(local, plan.world, group)
        flat = torch.stack(parts).view(-1, *local.shape[2:])
        ctx.save_for_backward(order)
        ctx.plan, ctx.group, ctx.shape = plan, group, local.shape
        ents = flat.index_select(0, order)
        return ents.unsqueeze(0).expand(local.shape[0], *ents.shape).contiguous()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (order,) = ctx.saved_tensors
        plan, shape = ctx.plan, ctx.shape
        every = torch.stack(_gather(g.contiguous(), plan.world, ctx.group)).view(-1, *g.shape[1:])
        acc = every[plan.unit_slots[0]]
        for s in plan.unit_slots[1:]:  # every unit's gradient of every entry, in unit order
            acc = acc + every[s]
        flat = g.new_zeros((plan.world * shape[0] * shape[1], *shape[2:]))
        flat.index_copy_(0, order, acc)
        return flat.view(plan.world, *shape)[plan.rank], None, None, None


def unit_entries(local: torch.Tensor, order: torch.Tensor, plan: UnitPlan, group=None) -> torch.Tensor:
    """Local entries ``[units, cap, B, w]`` -> one copy of the sequence's entries per local unit
    ``[units, S, B, w]``; the backward adds each entry's gradient over all units, in unit order."""
    return _UnitEntries.apply(_joins_backward(local), order, plan, group)
