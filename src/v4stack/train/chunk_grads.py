"""Chunk-ordered parameter gradients: the same bits for one process and for any context split.

A parameter's gradient is a sum over tokens. One process sums a whole sequence in one reduction;
a context shard sums its own tokens and the shards are added afterwards - another order, other
bits. Here the order is fixed by the sequence instead: every sequence is cut into ``U`` fixed
*units* of ``T / U`` tokens (every context layout with ``2 cp`` dividing ``U`` holds whole units),
and every parameter gradient is

    sum over pairs p (a tree, below) of  sum over sequences b (in order) of  (g[b, p] + g[b, U-1-p])

where ``g[b, v]`` is the gradient of sequence ``b``'s unit ``v`` alone. Unit ``p`` and unit
``U - 1 - p`` sit on the same rank in the causal load balance (rank ``r`` of ``cp`` holds pairs
``[r m, (r + 1) m)`` with ``m = U / (2 cp)``), and the pairs are added by a bottom-up tree over
adjacent nodes: with ``m`` a power of two each rank's block is one subtree. So a rank reduces its
own subtree, the ``cp`` subtree values are gathered, and the top of the tree is added in the same
order on every layout (one process is ``cp = 1``: the whole tree locally).

How ``g[b, v]`` is obtained: every row step of the model (``model/rowwise.py``: linears, norms,
mHC, the sink, the experts, the embedding) is run unit by unit, each unit with its own stand-in
for each parameter (``_Fanout``: views of the parameter whose backward files each unit's gradient
under (parameter, unit, use number) instead of adding it to ``.grad``). The use number counts a
parameter's uses on a unit in forward order (the head serves the main and the MTP loss), so the
uses are added in the same order on every layout. Which unit each row belongs to is told by the
caller (``rows(runs)``): the trunk's rows, or the compressed entries a compressor pools.

The per-unit row steps need the model's ops in invariant mode only where rows mix (attention);
each unit's own arithmetic is the same call on the same rows on every layout.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from v4stack.model import rowwise


@dataclass(frozen=True)
class Runs:
    """A partition of ``n`` rows into runs ``(unit, lo, hi)`` (rows ``[lo, hi)`` are that unit's)."""

    runs: tuple[tuple[int, int, int], ...]
    n: int


_ROWS: contextvars.ContextVar[Runs | None] = contextvars.ContextVar("v4stack_chunk_rows", default=None)


def tree(nodes: list[torch.Tensor]) -> torch.Tensor:
    """Bottom-up pairwise sum of adjacent nodes (an odd last node is carried up a level)."""
    while len(nodes) > 1:
        nxt = [nodes[i] + nodes[i + 1] for i in range(0, len(nodes) - 1, 2)]
        if len(nodes) % 2:
            nxt.append(nodes[-1])
        nodes = nxt
    return nodes[0]


def check_units(units: int, seq_len: int, cp: int) -> None:
    m = units // (2 * cp) if units % (2 * cp) == 0 else 0
    if units < 2 or seq_len % units or not m or m & (m - 1):
        raise ValueError(f"train field 'grad_chunks' ({units}) must divide seq_len ({seq_len}) and be 2 x cp "
                         f"(= {2 * cp}) times a power of two")


class _Fanout(torch.autograd.Function):
    """Stand-ins (views) of the parameters, one per (unit, parameter); their gradients are filed
    with the hook under their tags and never reach ``.grad`` through autograd."""

    @staticmethod
    def forward(ctx, hook, tags, *params):
        ctx.hook, ctx.tags, ctx.n = hook, tags, len(params)
        ctx.set_materialize_grads(False)
        return tuple(params[i % len(params)].view_as(params[i % len(params)]) for i in range(len(tags)))

    @staticmethod
    def backward(ctx, *grads):
        for tag, g in zip(ctx.tags, grads):
            if g is not None:
                ctx.hook.file(tag, g)
        return (None, None) + (None,) * ctx.n


def _cat(outs: list):
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


class ChunkGrads:
    """The row-step hook of one model's parameters (``params``: name -> parameter)."""

    def __init__(self, params: dict[str, nn.Parameter], units: int):
        self.params = {n: p for n, p in params.items() if p.requires_grad}
        self.names = {id(p): n for n, p in self.params.items()}
        self.units = units
        self.micro = 0
        self.shards: dict[int, object] = {}  # micro-batch -> its shard, between forward and backward
        self.deferred: tuple[str, ...] = ()  # reduced after the step (``finish_deferred``)
        self.kept: dict[int, tuple[int, dict[int, torch.Tensor]]] = {}
        self.filed: dict[tuple[int, str, int], list[tuple[int, torch.Tensor]]] = {}
        self.uses: dict[tuple[int, str, int], int] = {}

    def begin(self, micro: int = 0) -> None:
        """Start micro-batch ``micro``'s forward (several may be in flight under a pipeline)."""
        self.micro = micro
        for d in (self.filed, self.uses):
            for k in [k for k in d if k[0] == micro]:
                del d[k]

    def file(self, tag, g: torch.Tensor) -> None:
        micro, name, unit, use = tag
        self.filed.setdefault((micro, name, unit), []).append((use, g))

    @staticmethod
    @contextlib.contextmanager
    def rows(runs: Runs) -> Iterator[None]:
        token = _ROWS.set(runs)
        try:
            yield
        finally:
            _ROWS.reset(token)

    # ---- the hook -------------------------------------------------------------------------

    def _split(self, call, args, names: list[str], params: list[torch.Tensor], row_args: list[int]):
        runs = _ROWS.get()
        n = args[row_args[0]].shape[0] if row_args else 0
        if runs is None or runs.n != n:
            raise RuntimeError(f"a row step over {n} rows ran outside a matching row partition "
                               f"({None if runs is None else runs.n} rows)")
        for i in row_args:
            if args[i].shape[0] != n:
                raise RuntimeError(f"row step argument {i} has {args[i].shape[0]} rows, expected {n}")
        if not runs.runs:
            with rowwise.installed(None):
                return call(args, [p.detach() for p in params])
        tags = []
        for unit, _, _ in runs.runs:
            for name in names:
                k = self.uses.get((self.micro, name, unit), 0)
                self.uses[(self.micro, name, unit)] = k + 1
                tags.append((self.micro, name, unit, k))
        stand = _Fanout.apply(self, tuple(tags), *params)
        outs = []
        with rowwise.installed(None):
            for u, (_, lo, hi) in enumerate(runs.runs):
                a = list(args)
                for i in row_args:
                    a[i] = args[i][lo:hi]
                outs.append(call(a, stand[u * len(params):(u + 1) * len(params)]))
        return _cat(outs)

    def call(self, fn, args, params):
        names = [self.names.get(id(args[i])) for i in params]
        if not torch.is_grad_enabled() or all(n is None for n in names):
            with rowwise.installed(None):
                return fn(*args)
        if None in names:
            raise RuntimeError(f"a row step mixes hooked and other parameters: {names}")
        rows = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in params]

        def call(a, stand):
            for j, i in enumerate(params):
                a[i] = stand[j]
            return fn(*a)

        return self._split(call, args, names, [args[i] for i in params], rows)

    def call_module(self, module: nn.Module, args):
        named = [(n, p) for n, p in module.named_parameters() if id(p) in self.names]
        if not torch.is_grad_enabled() or not named:
            with rowwise.installed(None):
                return module(*args)
        local = [n for n, _ in named]

        def call(a, stand):
            return torch.func.functional_call(module, dict(zip(local, stand)), tuple(a), strict=False)

        rows = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        return self._split(call, list(args), [self.names[id(p)] for _, p in named], [p for _, p in named], rows)

    # ---- the reduction ----------------------------------------------------------------------

    def _unit_flat(self, micro: int, unit: int, names, dtype, device) -> torch.Tensor:
        parts = []
        for name in names:
            got = sorted(self.filed.get((micro, name, unit), []), key=lambda t: t[0])
            if not got:
                parts.append(torch.zeros(self.params[name].numel(), dtype=dtype, device=device))
                continue
            acc = got[0][1]
            for _, g in got[1:]:
                acc = acc + g
            parts.append(acc.reshape(-1).to(dtype))
        return torch.cat(parts)

    def _reduce(self, unit_flat, batch: int, cp: int, cp_rank: int, group) -> torch.Tensor | None:
        """The tree over this rank's pairs, gathered over the shards, the top added in order."""
        U, m = self.units, self.units // (2 * cp)
        nodes = []
        for p in range(cp_rank * m, (cp_rank + 1) * m):
            acc = None
            for b in range(batch):
                pair = unit_flat(b * U + p) + unit_flat(b * U + U - 1 - p)
                acc = pair if acc is None else acc + pair
            nodes.append(acc)
        sub = tree(nodes)
        if cp > 1:
            parts = [torch.empty_like(sub) for _ in range(cp)]
            dist.all_gather(parts, sub, group=group)
            sub = tree(parts)
        return None if cp_rank else sub

    def _unflat(self, sub: torch.Tensor, names) -> dict[str, torch.Tensor]:
        out, o = {}, 0
        for name in names:
            p = self.params[name]
            out[name] = sub[o:o + p.numel()].view_as(p).clone()
            o += p.numel()
        return out

    def finish(self, batch: int, cp: int, cp_rank: int, group=None, micro: int = 0) -> dict[str, torch.Tensor] | None:
        """Micro-batch ``micro``'s chunk-ordered gradients (on ``cp_rank`` 0; None elsewhere) of
        every parameter not ``deferred`` (those keep their unit gradients for ``finish_deferred``)."""
        U, m = self.units, self.units // (2 * cp)
        first = next(iter(self.params.values()))
        dtype, dev = first.dtype, first.device
        known = {u for mb, _, u in self.filed if mb == micro}
        mine = {b * U + v for b in range(batch) for p in range(cp_rank * m, (cp_rank + 1) * m) for v in (p, U - 1 - p)}
        if not known <= mine:
            raise RuntimeError(f"gradients filed for units {sorted(known - mine)} this shard does not hold")
        names = [n for n in self.params if n not in self.deferred]
        if self.deferred:
            self.kept[micro] = (batch, {u: self._unit_flat(micro, u, self.deferred, dtype, dev) for u in sorted(mine)})
        sub = self._reduce(lambda u: self._unit_flat(micro, u, names, dtype, dev), batch, cp, cp_rank, group)
        for k in [k for k in self.filed if k[0] == micro]:
            del self.filed[k]
        return None if sub is None else self._unflat(sub, names)

    def finish_deferred(self, cp: int, cp_rank: int, group, exchange) -> dict[str, torch.Tensor] | None:
        """The deferred parameters' gradients over the kept micro-batches (added in micro-batch
        order, on ``cp_rank`` 0). ``exchange(units [n, size]) -> [n, size]`` combines each unit's
        gradient with another rank's first (a pipeline's two embedding copies: first + last)."""
        total = None
        for micro in sorted(self.kept):
            batch, units = self.kept.pop(micro)
            keys = sorted(units)
            merged = dict(zip(keys, exchange(torch.stack([units[u] for u in keys]))))
            sub = self._reduce(lambda u: merged[u], batch, cp, cp_rank, group)
            if sub is not None:
                total = sub if total is None else total + sub
        return None if total is None else self._unflat(total, self.deferred)
