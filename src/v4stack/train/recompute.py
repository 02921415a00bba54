"""Tensor-level activation recompute, planned per op output for a memory budget.

A checkpointed block keeps only what its policy saves; backward re-runs the block's forward and
takes saved outputs from the cache instead of recomputing them. Whole-block checkpointing saves
nothing; torch's usual selective policy saves every matrix product. The planner decides per op
output instead, from a profile of one forward (the aten ops, in order, as the checkpoint's
dispatcher sees them):

- a **view** never costs memory of its own and is never saved (saving a view would keep its whole
  base alive, counted or not): it is recomputed, which is free;
- outputs sharing a **storage** with an output already saved cost nothing more;
- **random** ops (tagged nondeterministic_seeded) are always saved: a recompute would draw again
  (an in-place draw cannot be cached; the checkpoint restores the RNG state before it recomputes);
- **in-place** ops are recomputed, and so is any output an in-place op later writes into (a
  cached value must not change under the cache);
- only outputs the backward itself keeps are candidates (autograd's saved tensors, seen through
  saved-tensor hooks while profiling): caching anything else would hold memory a plain backward
  frees;
- the rest is a knapsack: keep the outputs with the most estimated recompute time per byte until
  the budget is spent. Time is ``flops / F + bytes / B`` with the machine's balance F/B (FLOPs
  from torch's flop counter for matrix ops; bytes read and written for the others).

The result is a ``Plan`` (which op calls to save); ``plan.policy()`` feeds
``torch.utils.checkpoint``'s selective-checkpoint contexts and checks at run time that the
recorded op sequence is the one being executed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (SAC_IGNORED_OPS, CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)
from torch.utils.flop_counter import flop_registry

MATMULS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._grouped_mm", "aten._scaled_mm"}


@dataclass
class OpRecord:
    index: int
    name: str
    out_bytes: int  # bytes of the output tensors' storages not already produced earlier
    in_bytes: int
    flops: int
    view: bool
    random: bool
    inplace: bool
    storages: tuple[int, ...] = ()
    in_storages: tuple[int, ...] = ()
    needed: bool = False  # autograd keeps this output (or a view of it) for the backward
    in_shapes: tuple = ()  # shapes of the tensor inputs (the rule's key when the output is not shown)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _record(index: int, func, args, kwargs, out, seen: set[int] | None) -> OpRecord:
    """One op call as the planner sees it (``seen``: storages produced before, not counted again)."""
    ins = list(_tensors((args, list(kwargs.values()))))
    outs = list(_tensors(out))
    in_ptrs = {_storage(t) for t in ins}
    new_bytes, ptrs = 0, []
    for t in outs:
        p = _storage(t)
        ptrs.append(p)
        if p not in in_ptrs and (seen is None or p not in seen):
            if seen is not None:
                seen.add(p)
            new_bytes += t.untyped_storage().nbytes()
    packet = func.overloadpacket
    flops = 0
    if packet in flop_registry:
        try:
            flops = int(flop_registry[packet](*[a.shape if isinstance(a, torch.Tensor) else a for a in args],
                                              out_shape=outs[0].shape if outs else None))
        except TypeError:
            flops = 0
    return OpRecord(index=index, name=str(packet), out_bytes=new_bytes,
                    in_bytes=sum(t.numel() * t.element_size() for t in ins), flops=flops,
                    view=bool(outs) and all(_storage(t) in in_ptrs for t in outs),
                    random=torch.Tag.nondeterministic_seeded in func.tags, inplace=func._schema.is_mutable,
                    storages=tuple(ptrs), in_storages=tuple(in_ptrs), in_shapes=_shapes(ins))


def _shapes(tensors) -> tuple:
    return tuple(tuple(t.shape) for t in tensors)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.records: list[OpRecord] = []
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in SAC_IGNORED_OPS:  # the checkpoint's dispatcher does not see these either
            self.records.append(_record(len(self.records), func, args, kwargs, out, self.seen))
        return out


def profile(fn, *args) -> list[OpRecord]:
    """The aten ops of one forward of ``fn(*args)`` (gradients on, as under a checkpoint), each
    marked with whether autograd saves its output for the backward."""
    rec = _Recorder()
    kept: set[int] = set()

    def pack(t: torch.Tensor):
        kept.add(_storage(t))
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rec:
        fn(*args)
    for r in rec.records:
        r.needed = bool(set(r.storages) & kept)
    return rec.records


@dataclass
class Plan:
    records: list[OpRecord]
    save: set[int] = field(default_factory=set)
    saved_bytes: int = 0
    recompute_cost: float = 0.0  # estimated recompute time per backward (bytes-moved units)
    full_bytes: int = 0  # what saving every savable output would hold
    rule_stats: dict = field(default_factory=dict)  # decisions of the last rule() run (forward)

    def policy(self):
        """A selective-checkpoint context factory following this plan (one fresh pair of op
        counters per checkpointed call: forward and recompute each walk the recorded ops)."""
        names = [r.name for r in self.records]
        save = self.save

        def contexts():
            k = {False: 0, True: 0}

            def fn(ctx, op, *args, **kwargs):
                i = k[ctx.is_recompute]
                k[ctx.is_recompute] = i + 1
                if i >= len(names) or names[i] != str(op.overloadpacket):
                    raise RuntimeError(f"recompute plan out of step at op {i}: planned "
                                       f"{names[i] if i < len(names) else 'end'}, ran {op.overloadpacket}")
                return CheckpointPolicy.MUST_SAVE if i in save else CheckpointPolicy.PREFER_RECOMPUTE

            return create_selective_checkpoint_contexts(fn)

        return contexts

    def rule(self, balance: float = 100.0, use_output: bool = True):
        """The same plan as a rule that holds for other inputs too (a block's op sequence depends on
        its data: which experts get tokens, how many candidates are visible). The greedy knapsack
        keeps every output above a value density, so the rule is: save an op's output when its
        recompute time per byte reaches the smallest density the plan kept, unless the op is a
        view, in-place, or of a kind whose outputs the profile saw written in place later; random
        draws always. Decided per call from the op's real output (``ctx.op_output``).

        Where the checkpoint asks before the op has run (torch releases whose policy context has
        no ``op_output``, e.g. 2.11), or with ``use_output=False``, the decision comes from the
        plan by key instead: (op name, input shapes) as profiled, else the majority decision of
        that op name's savable calls. Neither form depends on the op's position in the sequence."""
        kept = [_density(self.records[i], balance) for i in self.save if not self.records[i].random]
        threshold = min(kept) if kept else float("inf")
        unsafe = {r.name for r in self.records if r.view or r.inplace} | _mutated_later(self.records)
        unsafe |= {r.name for r in self.records} - {r.name for r in self.records if r.needed or r.random}

        stats = self.rule_stats = {"saved": 0, "recomputed": 0}
        by_key: dict = {}
        by_name: dict = {}
        for r in _savable(self.records):
            keep = r.index in self.save
            by_key[(r.name, r.in_shapes)] = by_key.get((r.name, r.in_shapes), False) or keep
            n_keep, n_all = by_name.get(r.name, (0, 0))
            by_name[r.name] = (n_keep + keep, n_all + 1)

        def decide(ctx, op, *args, **kwargs):
            policy = fn(ctx, op, *args, **kwargs)
            if not ctx.is_recompute:
                stats["saved" if policy == CheckpointPolicy.MUST_SAVE else "recomputed"] += 1
            return policy

        def fn(ctx, op, *args, **kwargs):
            out = getattr(ctx, "op_output", None) if use_output else None
            name = str(op.overloadpacket)
            if name in unsafe:
                return CheckpointPolicy.PREFER_RECOMPUTE
            if out is None:
                key = (name, _shapes(_tensors((args, list(kwargs.values())))))
                n_keep, n_all = by_name.get(name, (0, 0))
                save = by_key[key] if key in by_key else 2 * n_keep > n_all
                return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
            r = _record(0, op, args, kwargs, out, None)
            if r.view or r.out_bytes == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            save = r.random or _density(r, balance) >= threshold
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

        return lambda: create_selective_checkpoint_contexts(decide)


def _mutated_later(records: list[OpRecord]) -> set[str]:
    """Names of ops whose outputs some later in-place op writes into."""
    written: set[int] = set()
    names: set[str] = set()
    for r in reversed(records):
        if not r.inplace and set(r.storages) & written:
            names.add(r.name)
        if r.inplace:
            written |= set(r.storages)
    return names


def _density(r: OpRecord, balance: float) -> float:
    return _cost(r, balance) / max(r.out_bytes, 1)


def _cost(r: OpRecord, balance: float) -> float:
    """Estimated recompute time in units of one byte moved (flops / balance + bytes)."""
    return r.flops / balance + r.in_bytes + r.out_bytes


def _savable(records: list[OpRecord]) -> list[OpRecord]:
    """Outputs worth caching: what the backward needs (holding anything else only adds memory a
    plain backward would not hold), with new storage, not a view, never written in place after."""
    written_after: set[int] = set()
    out = []
    for r in reversed(records):
        if (r.needed or r.random) and not r.view and not r.inplace and r.out_bytes > 0 \
                and not (set(r.storages) & written_after):
            out.append(r)
        if r.inplace:
            written_after |= set(r.storages)
    return out[::-1]


def _random_saves(records: list[OpRecord]) -> set[int]:
    """Out-of-place random draws: saved, so a recompute never draws again. (An in-place draw cannot
    be cached; the checkpoint restores the RNG state before recomputing, so it draws the same.)"""
    return {r.index for r in _savable(records) if r.random}


def make_plan(records: list[OpRecord], budget_bytes: int, balance: float = 100.0) -> Plan:
    """Save what buys the most recompute time per byte, within ``budget_bytes``."""
    plan = Plan(records)
    savable = _savable(records)
    plan.full_bytes = sum(r.out_bytes for r in savable)
    for i in _random_saves(records):  # saved whatever the budget
        plan.save.add(i)
        plan.saved_bytes += records[i].out_bytes
    for r in sorted((r for r in savable if r.index not in plan.save),
                    key=lambda r: _cost(r, balance) / r.out_bytes, reverse=True):
        if plan.saved_bytes + r.out_bytes <= budget_bytes:
            plan.save.add(r.index)
            plan.saved_bytes += r.out_bytes
    plan.recompute_cost = sum(_cost(r, balance) for r in records if r.index not in plan.save and not r.view)
    return plan


def matmul_plan(records: list[OpRecord], balance: float = 100.0) -> Plan:
    """Torch's common selective policy, as a plan: save every matrix product, recompute the rest."""
    plan = Plan(records)
    ok = _savable(records)
    plan.full_bytes = sum(r.out_bytes for r in ok)
    for i in sorted(_random_saves(records) | {r.index for r in ok if r.name in MATMULS}):
        plan.save.add(i)
        plan.saved_bytes += records[i].out_bytes
    plan.recompute_cost = sum(_cost(r, balance) for r in records if r.index not in plan.save and not r.view)
    return plan


def sac_matmul_policy():
    """Torch's selective checkpointing with the save-matmuls policy (no plan, no profile)."""
    def fn(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if str(op.overloadpacket) in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE
    return lambda: create_selective_checkpoint_contexts(fn)


class Checkpointed(torch.nn.Module):
    """Runs ``block`` under a checkpoint with the given selective-checkpoint context factory
    (None: recompute everything)."""

    def __init__(self, block: torch.nn.Module, context_fn=None, preserve_rng_state: bool = True):
        super().__init__()
        self.block = block
        self.context_fn = context_fn
        self.preserve_rng_state = preserve_rng_state

    def forward(self, *args):
        return _checkpointed_call(self.block.forward, self.context_fn, self.preserve_rng_state, *args)


def _checkpointed_call(fn, context_fn, preserve_rng_state: bool, *args):
    if not torch.is_grad_enabled():
        return fn(*args)
    kw = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kw)


def checkpoint_in_place(block: torch.nn.Module, context_fn=None) -> None:
    """Make ``block`` run under a checkpoint without renaming its parameters (its ``forward`` is
    wrapped on the instance, so state dicts and optimizer names stay the same)."""
    inner = type(block).forward.__get__(block)
    block.forward = lambda *args: _checkpointed_call(inner, context_fn, True, *args)


RECOMPUTE_MODES = "none, full, matmul, or plan:F (F = the fraction of each block's savable bytes to keep)"


def apply_recompute(model, spec: str, sample: tuple, layers=None) -> dict:
    """Wrap ``model.layers`` (or the given layer ids) for recompute; ``sample`` = the arguments of
    one forward of the model (profiled once for ``plan:F``). Returns the saved / recompute totals."""
    if spec == "none":
        return {}
    ids = list(range(len(model.layers))) if layers is None else list(layers)
    if spec == "full":
        ctx = {i: None for i in ids}
    elif spec == "matmul":
        ctx = {i: sac_matmul_policy() for i in ids}
    elif spec.startswith("plan:"):
        try:
            frac = float(spec[5:])
        except ValueError:
            frac = -1.0
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"train field 'recompute': plan fraction must be in [0, 1], got {spec!r}")
        traced = {}

        class Probe(torch.nn.Module):
            def __init__(self, i, block):
                super().__init__()
                self.i, self.block = i, block

            def forward(self, *args):
                traced[self.i] = profile(self.block, *args)
                return self.block(*args)

        blocks = {i: model.layers[i] for i in ids}
        for i in ids:
            model.layers[i] = Probe(i, blocks[i])
        try:
            with torch.no_grad():
                model(*sample)
        finally:
            for i in ids:
                model.layers[i] = blocks[i]
        plans = {i: make_plan(traced[i], int(frac * make_plan(traced[i], 1 << 62).full_bytes)) for i in ids}
        for i in ids:  # the rule form: later batches route and select differently from the sample
            checkpoint_in_place(model.layers[i], plans[i].rule())
        return {"saved_bytes": sum(p.saved_bytes for p in plans.values()),
                "recompute_cost": sum(p.recompute_cost for p in plans.values())}
    else:
        raise ValueError(f"train field 'recompute' must be {RECOMPUTE_MODES}, got {spec!r}")
    for i in ids:
        checkpoint_in_place(model.layers[i], ctx[i])
    return {}
