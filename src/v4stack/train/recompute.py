"""Tensor-level activation recompute, planned per op output for a memory budget.

A checkpointed block keeps its inputs and a cache of chosen op outputs; backward re-runs the
block's forward, and each cached op hands back its output instead of running. Whole-block
checkpointing caches nothing; torch's usual selective policy caches every matrix product. The
planner decides per op call from the block's trace (``recompute_trace``): only ops the recompute
reaches, never views (free), never in-place ops or outputs written in place later, random and
nondeterministic outputs always (a recompute could give other bits); the rest is a knapsack: keep
the outputs with the most recompute time per byte, time estimated as
``flops / F + bytes moved / B + one launch``, until the budget is spent.

The plan runs through ``torch.utils.checkpoint``'s ``context_fn`` as a pair of dispatch modes of
its own: the forward mode counts op calls and caches the planned ones (a list lookup per op); the
recompute mode hands them back by position, checking that it is the same op and that nothing
wrote into the cached tensor since. A block whose op sequence differs from the traced one (data
dependent control flow) stops caching at the first op that differs, so what it caches is always
what the plan meant; the rest is recomputed (``plan.stats['diverged']`` counts such calls).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (SAC_IGNORED_OPS, CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from v4stack.train.recompute_trace import MATMULS, OpRecord, Trace, candidates, trace

__all__ = ["Machine", "Plan", "as_run", "make_plan", "policy_plan", "sac_policy", "SAC_VARIANTS", "Checkpointed",
           "checkpoint_in_place", "apply_recompute", "trace", "MATMULS"]


@dataclass(frozen=True)
class Machine:
    """The recompute time model: ``flops / flops_per_s + bytes / bytes_per_s + launch_s`` per op
    (defaults: an H200, bf16 dense)."""
    flops_per_s: float = 989e12
    bytes_per_s: float = 4.8e12
    launch_s: float = 5e-6

    def cost(self, r: OpRecord) -> float:
        return r.flops / self.flops_per_s + (r.in_bytes + r.out_bytes) / self.bytes_per_s + self.launch_s


@dataclass
class Plan:
    trace: Trace
    save: frozenset = frozenset()
    saved_bytes: int = 0  # what the cache holds between forward and recompute
    recompute_flops: int = 0  # FLOPs the recompute runs again (ops it reaches, not cached)
    recompute_ops: int = 0
    recompute_s: float = 0.0  # estimated
    stats: dict = field(default_factory=lambda: {"calls": 0, "cached": 0, "replayed": 0, "diverged": 0,
                                                 "diverged_at": None})

    def contexts(self):
        """``context_fn`` for ``torch.utils.checkpoint``: a fresh (forward, recompute) mode pair
        per checkpointed call, sharing one cache; None (whole-block recompute, no modes) for a plan
        that caches nothing."""
        if not self.save:
            return None
        funcs = [r.func for r in self.trace.records]
        save = [r.index in self.save for r in self.trace.records]
        stats = self.stats

        def make():
            cache: dict = {}
            return _Caching(funcs, save, cache, stats), _Replaying(cache, stats)

        return make

    def torch_contexts(self):
        """The same plan through torch's own selective-checkpoint modes (a policy by position)."""
        funcs = [r.func for r in self.trace.records]
        save = [r.index in self.save for r in self.trace.records]

        def make():
            at = {False: 0, True: 0}
            aligned = {False: True, True: True}

            def fn(ctx, op, *args, **kwargs):
                rec = ctx.is_recompute
                i = at[rec]
                at[rec] = i + 1
                if aligned[rec] and i < len(funcs) and funcs[i] is op:
                    return CheckpointPolicy.MUST_SAVE if save[i] else CheckpointPolicy.PREFER_RECOMPUTE
                aligned[rec] = False
                return CheckpointPolicy.PREFER_RECOMPUTE

            return create_selective_checkpoint_contexts(fn)

        return make


class _Caching(TorchDispatchMode):
    def __init__(self, funcs, save, cache, stats):
        super().__init__()
        self.funcs, self.save, self.cache, self.stats = funcs, save, cache, stats
        self.n, self.i, self.aligned = len(funcs), 0, True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SAC_IGNORED_OPS or not self.aligned:
            return out
        i = self.i
        self.i = i + 1
        if i < self.n and self.funcs[i] is func:
            if self.save[i]:
                ts = (out,) if isinstance(out, torch.Tensor) else tuple(out)
                self.cache[i] = (func, isinstance(out, torch.Tensor), _alias(ts), tuple(t._version for t in ts))
            return out
        self.aligned = False  # another op sequence than traced: cache nothing more in this call
        self.stats["diverged"] += 1
        at = self.stats["diverged_at"]
        self.stats["diverged_at"] = i if at is None else min(at, i)
        return out

    def __exit__(self, *exc):
        self.stats["calls"] += 1
        self.stats["cached"] += len(self.cache)
        return super().__exit__(*exc)


def _alias(ts) -> tuple:
    """Detached aliases sharing the version counter (beneath autograd, a plain detach would not
    share it, and a later in-place write would go unseen)."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tuple(t.detach() for t in ts)


class _Replaying(TorchDispatchMode):
    def __init__(self, cache, stats):
        super().__init__()
        self.cache, self.stats, self.i = cache, stats, 0

    def __enter__(self):
        self.i = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SAC_IGNORED_OPS or not self.cache:
            return func(*args, **(kwargs or {}))
        i = self.i
        self.i = i + 1
        hit = self.cache.pop(i, None)
        if hit is None:
            return func(*args, **(kwargs or {}))
        f, single, ts, versions = hit
        if f is not func:
            raise RuntimeError(f"recompute out of step at op {i}: cached {f}, ran {func}")
        if any(t._version != v for t, v in zip(ts, versions)):
            raise RuntimeError(f"recompute: the cached output of op {i} ({func}) was written in place since")
        self.stats["replayed"] += 1
        return ts[0] if single else ts

    def __exit__(self, *exc):
        self.cache.clear()  # entries past an early stop, or a second backward: recomputed then
        return super().__exit__(*exc)


def _finish(plan: Plan, machine: Machine) -> Plan:
    tr = plan.trace
    plan.saved_bytes = sum(tr.records[i].new_bytes for i in plan.save if not tr.records[i].returned)
    rerun = [r for r in tr.records[:tr.stop] if r.index not in plan.save and not r.view]
    plan.recompute_flops = sum(r.flops for r in rerun)
    plan.recompute_ops = len(rerun)
    plan.recompute_s = sum(machine.cost(r) for r in rerun)
    return plan


def as_run(plan: Plan, machine: Machine = Machine()) -> Plan:
    """What ``plan`` really cached in the calls it ran: the saves before the first op where a call's
    sequence left the trace (all of them where none did)."""
    at = plan.stats["diverged_at"]
    if at is None:
        return plan
    return _finish(Plan(plan.trace, frozenset(i for i in plan.save if i < at)), machine)


def make_plan(tr: Trace, budget_bytes: int, machine: Machine = Machine()) -> Plan:
    """Cache what buys the most recompute time per byte within ``budget_bytes`` (forced and free
    outputs first, whatever the budget)."""
    c = candidates(tr)
    save = set(c.forced | c.free)
    used = sum(tr.records[i].new_bytes for i in save if i not in c.free)
    for r in sorted((r for r in c.ops if r.index not in save), key=lambda r: machine.cost(r) / r.new_bytes,
                    reverse=True):
        if used + r.new_bytes <= budget_bytes:
            save.add(r.index)
            used += r.new_bytes
    return _finish(Plan(tr, frozenset(save)), machine)


def policy_plan(tr: Trace, keep, machine: Machine = Machine()) -> Plan:
    """What a torch selective policy ``keep(op) -> bool`` caches, as a plan (for its accounting:
    torch caches every call the policy keeps, also past the recompute's stop)."""
    return _finish(Plan(tr, frozenset(r.index for r in tr.records if not r.view and keep(r.func))), machine)


def _packet_in(names):
    return lambda op: str(op.overloadpacket) in names


_ALLOCS = frozenset({"aten.empty", "aten.new_empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty_strided"})


def _computes(op) -> bool:
    """Every op that computes a new output (not views, not in place, not the allocations a block
    fills in place afterwards: torch refuses a cached tensor written since)."""
    return not op._schema.is_mutable and not op.is_view and str(op.overloadpacket) not in _ALLOCS


# torch's selective checkpointing with fixed policies (save nothing / matrix products (and softmax,
# top-k, sort) / every computing op)
SAC_VARIANTS = {
    "nothing": lambda op: False,
    "matmuls": _packet_in(MATMULS),
    "matmuls+softmax": _packet_in(MATMULS | {"aten._softmax", "aten._log_softmax", "aten.topk", "aten.sort"}),
    "all": _computes,
}


def sac_policy(keep=SAC_VARIANTS["matmuls"]):
    """Torch's selective checkpointing with a fixed op policy, decided once per op overload."""
    memo: dict = {}

    def fn(ctx, op, *args, **kwargs):
        d = memo.get(op)
        if d is None:
            d = memo[op] = CheckpointPolicy.MUST_SAVE if keep(op) else CheckpointPolicy.PREFER_RECOMPUTE
        return d

    return lambda: create_selective_checkpoint_contexts(fn)


class Checkpointed(torch.nn.Module):
    """Runs ``block`` under a checkpoint with the given ``context_fn`` (None: recompute everything)."""

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


RECOMPUTE_MODES = "none, full, matmul, or plan:F (F = the fraction of each block's cacheable bytes to keep)"


def trace_layers(model, sample: tuple, ids) -> dict[int, Trace]:
    """One traced forward per layer in ``ids``, from one forward of the model on ``sample``."""
    traced: dict[int, Trace] = {}

    class Probe(torch.nn.Module):
        def __init__(self, i, block):
            super().__init__()
            self.i, self.block = i, block

        def forward(self, *args):
            traced[self.i] = trace(self.block, *args)
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
    return traced


def apply_recompute(model, spec: str, sample: tuple, layers=None) -> dict:
    """Wrap ``model.layers`` (or the given layer ids) for recompute; ``sample`` = the arguments of
    one forward of the model (traced once for ``plan:F``). Returns the plans' totals."""
    if spec == "none":
        return {}
    ids = list(range(len(model.layers))) if layers is None else list(layers)
    if spec == "full":
        for i in ids:
            checkpoint_in_place(model.layers[i], None)
        return {}
    if spec == "matmul":
        for i in ids:
            checkpoint_in_place(model.layers[i], sac_policy(SAC_VARIANTS["matmuls"]))
        return {}
    if not spec.startswith("plan:"):
        raise ValueError(f"train field 'recompute' must be {RECOMPUTE_MODES}, got {spec!r}")
    try:
        frac = float(spec[5:])
    except ValueError:
        frac = -1.0
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"train field 'recompute': plan fraction must be in [0, 1], got {spec!r}")
    traced = trace_layers(model, sample, ids)
    plans = {i: make_plan(traced[i], int(frac * candidates(traced[i]).total_bytes)) for i in ids}
    for i in ids:
        checkpoint_in_place(model.layers[i], plans[i].contexts())
    return {"saved_bytes": sum(p.saved_bytes for p in plans.values()),
            "recompute_flops": sum(p.recompute_flops for p in plans.values()), "plans": plans}
