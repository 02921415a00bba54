"""The op trace a recompute plan is made from: the aten ops of one forward of a block, in the order
a checkpoint's dispatch modes see them, each with what it costs to recompute and what keeping its
output would hold.

Storages are told apart by address. Addresses are reused as soon as a tensor is freed, so the
trace keeps every tensor of the forward alive while it records (one forward of one block, held
once, at planning time); otherwise a freed temporary and a later saved tensor at the same address
would look like one storage.

Per op output the trace knows:

- **view**: every output lives in an input's storage (costs nothing, never cached);
- **new bytes**: the bytes of output storages first seen here (an alias of an earlier output or of
  an input counts nothing);
- **needed**: autograd keeps this storage (or a view of it) for the backward (seen through
  saved-tensor hooks);
- **returned**: the storage is part of the block's output, alive after the block anyway, so
  keeping it costs nothing;
- **written later**: some later in-place op writes into the storage (a cached copy would change
  under the cache);
- **random** (``nondeterministic_seeded``) and **nondeterministic** (``nondeterministic_bitwise``):
  a recompute could give other bits;
- whether the recompute reaches it at all: the checkpoint stops recomputing once the last tensor
  the backward keeps has been recomputed (``Trace.stop``); ops from there on never run again, so
  caching their outputs would only hold memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.utils.flop_counter import flop_registry

MATMULS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._grouped_mm", "aten._scaled_mm"})


@dataclass
class OpRecord:
    index: int
    func: object  # the OpOverload (identity-compared at run time)
    name: str
    flops: int
    in_bytes: int  # bytes the op reads (tensor inputs)
    out_bytes: int  # bytes the op writes (tensor outputs)
    new_bytes: int  # bytes of output storages first seen here: what caching the output holds
    view: bool
    inplace: bool
    random: bool
    nondet: bool
    tensors_only: bool  # the output is a tensor or a tuple of tensors (cacheable as such)
    storages: tuple[int, ...] = ()
    needed: bool = False
    returned: bool = False
    written_later: bool = False


@dataclass
class Trace:
    records: list[OpRecord]
    stop: int  # ops with index < stop run again in a recompute
    saved_bytes: int  # distinct storages autograd keeps for the backward (inputs and weights included)

    def __len__(self) -> int:
        return len(self.records)


def tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from tensors(y)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _flops(func, args, kwargs, out) -> int:
    fn = flop_registry.get(func.overloadpacket)
    if fn is None:
        if str(func.overloadpacket) == "aten._grouped_mm" and len(args) >= 2 and args[0].dim() == 2:
            a, b = args[0], args[1]  # rows [T, K] grouped against [E, K, N]: each row meets one group
            return 2 * a.shape[0] * a.shape[1] * b.shape[-1]
        return 0
    try:  # the registry's formulas take the op's arguments and output (as the flop counter calls them)
        return int(fn(*args, **kwargs, out_val=out))
    except (TypeError, ValueError, IndexError, AssertionError):
        return 0


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.records: list[OpRecord] = []
        self.seen: set[int] = set()
        self.alive: list = []  # every tensor of the forward, so no address is reused while recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in SAC_IGNORED_OPS:  # the checkpoint's modes skip these too
            return out
        ins = list(tensors((args, kwargs)))
        outs = list(tensors(out))
        self.alive.append((ins, outs))
        in_ptrs = {_ptr(t) for t in ins}
        new, ptrs = 0, []
        for t in outs:
            p = _ptr(t)
            ptrs.append(p)
            if p and p not in in_ptrs and p not in self.seen:
                self.seen.add(p)
                new += t.untyped_storage().nbytes()
        self.seen |= in_ptrs
        self.records.append(OpRecord(
            index=len(self.records), func=func, name=str(func.overloadpacket), flops=_flops(func, args, kwargs, out),
            in_bytes=sum(t.numel() * t.element_size() for t in ins),
            out_bytes=sum(t.numel() * t.element_size() for t in outs), new_bytes=new,
            view=bool(outs) and all(p in in_ptrs for p in ptrs), inplace=func._schema.is_mutable,
            random=torch.Tag.nondeterministic_seeded in func.tags,
            nondet=torch.Tag.nondeterministic_bitwise in func.tags,
            tensors_only=isinstance(out, torch.Tensor) or (isinstance(out, tuple) and bool(out)
                                                            and all(isinstance(t, torch.Tensor) for t in out)),
            storages=tuple(ptrs)))
        return out


def trace(fn, *args, warm: bool = True) -> Trace:
    """Record one forward of ``fn(*args)`` with gradients on and its floating-point tensor inputs
    requiring gradients (as a block's inputs do in training, so autograd keeps the same tensors).
    ``warm``: run it once unrecorded first, so what only a first call does (kernel autotuning,
    lazily built tables) is not taken for the block's op sequence."""
    args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)
    if warm:
        with torch.enable_grad():
            fn(*args)
    rec = _Recorder()
    kept: dict[int, int] = {}  # storage address -> bytes, of what autograd keeps
    last_pack = 0  # ops recorded when autograd last saved a tensor: the recompute stops there

    def pack(t: torch.Tensor):
        nonlocal last_pack
        kept[_ptr(t)] = t.untyped_storage().nbytes()
        rec.alive.append(t)
        last_pack = len(rec.records)
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with rec:
            out = fn(*args)
        returned = {_ptr(t) for t in tensors(out)}
    records = rec.records
    written: set[int] = set()
    for r in reversed(records):
        if not r.inplace:
            r.written_later = bool(set(r.storages) & written)
        else:
            written |= set(r.storages)
        r.needed = bool(set(r.storages) & kept.keys())
        r.returned = bool(r.storages) and set(r.storages) <= returned
    del rec.alive
    return Trace(records, stop=last_pack, saved_bytes=sum(kept.values()))


@dataclass
class Candidates:
    """What a plan may keep: ops the recompute reaches, not views, not in place, whose outputs are
    tensors in new storage nothing writes into later. ``forced``: random or nondeterministic ones,
    kept whatever the budget (a recompute could change their bits); ``free``: outputs the block
    returns (alive anyway)."""
    ops: list[OpRecord] = field(default_factory=list)
    forced: set[int] = field(default_factory=set)
    free: set[int] = field(default_factory=set)
    unsafe: list[int] = field(default_factory=list)  # nondeterministic ops the recompute re-runs, uncacheable

    @property
    def total_bytes(self) -> int:
        return sum(r.new_bytes for r in self.ops if r.index not in self.free)


def candidates(tr: Trace) -> Candidates:
    c = Candidates()
    for r in tr.records[:tr.stop]:
        ok = (not r.view and not r.inplace and r.tensors_only and r.new_bytes > 0 and not r.written_later)
        if ok:
            c.ops.append(r)
            if r.random or r.nondet:
                c.forced.add(r.index)
            if r.returned:
                c.free.add(r.index)
        elif r.nondet and not r.view:  # (a random draw in place is redrawn alike: the RNG state is restored)
            c.unsafe.append(r.index)
    return c
