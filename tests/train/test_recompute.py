"""The recompute planner on a real V4 block: what the trace marks (aliases, what autograd keeps,
where the recompute stops), what a plan caches (never views, in-place ops or outputs written later;
random draws always; the budget kept), gradients under any plan equal the plain backward bit for
bit, and a block whose op sequence differs from the traced one still gets exact gradients."""

import pytest
import torch

from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.train.recompute import (SAC_VARIANTS, Checkpointed, Plan, make_plan, policy_plan, sac_policy,
                                     trace)
from v4stack.train.recompute_trace import candidates


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # with several intra-op threads some CPU reductions split by load, and two plain backwards can
    # already differ in the last bit; bitwise comparisons need one thread
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def block_and_inputs():
    torch.manual_seed(0)
    m = V4Model(preset("tiny"), seed=0)
    blk = m.layers[2]  # a CSA layer: attention, compressor, indexer, MoE, mHC
    B, T = 2, 24
    segs, positions = m._fresh_segments(B, T, "cpu")
    ids = torch.randint(0, 256, (B * T,))
    x = torch.randn(B * T, m.cfg.hc_mult, m.cfg.hidden_size)
    return blk, (x, positions, segs, ids)


@pytest.fixture(scope="module")
def block_trace(block_and_inputs):
    blk, args = block_and_inputs
    return trace(blk, *args)


def _grads(module, params, args):
    x = args[0].clone().requires_grad_(True)
    for p in params.parameters():
        p.grad = None
    out = module(x, *args[1:])
    (out.float() ** 2).sum().backward()
    return [x.grad.clone()] + [p.grad.clone() for p in params.parameters() if p.grad is not None]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_trace_counts_each_storage_once(block_trace):
    tr = block_trace
    recs = tr.records
    assert any(r.view for r in recs) and any(r.name == "aten.mm" for r in recs)
    assert all(r.new_bytes == 0 for r in recs if r.view)
    # what the trace calls needed is a subset of what autograd keeps (no address seen twice)
    assert 0 < sum(r.new_bytes for r in recs if r.needed) <= tr.saved_bytes
    assert 0 < tr.stop <= len(recs)
    c = candidates(tr)
    assert c.ops and all(r.index < tr.stop and not (r.view or r.inplace or r.written_later) for r in c.ops)
    assert any(r.written_later for r in recs)  # the block writes into earlier outputs (y[order] = ...)


def test_plan_rules_and_budget(block_trace):
    tr = block_trace
    total = candidates(tr).total_bytes
    full, none, half = make_plan(tr, total), make_plan(tr, 0), make_plan(tr, total // 2)
    ok = {r.index for r in candidates(tr).ops}
    for p in (full, none, half):
        assert p.save <= ok
    assert none.save == frozenset() and none.saved_bytes == 0
    assert half.saved_bytes <= total // 2 and full.saved_bytes == total
    assert full.recompute_s < half.recompute_s < none.recompute_s
    assert none.recompute_flops == policy_plan(tr, SAC_VARIANTS["nothing"]).recompute_flops > 0
    # at the memory torch's save-the-matmuls policy holds, the planner's estimated recompute is smaller
    mm = policy_plan(tr, SAC_VARIANTS["matmuls"])
    same = make_plan(tr, mm.saved_bytes)
    assert same.saved_bytes <= mm.saved_bytes and same.recompute_s < mm.recompute_s


def test_gradients_under_plans_equal_the_plain_backward(block_and_inputs, block_trace):
    blk, args = block_and_inputs
    ref = _grads(blk, blk, args)
    total = candidates(block_trace).total_bytes
    for budget in (total // 3, total):
        plan = make_plan(block_trace, budget)
        assert _same(_grads(Checkpointed(blk, plan.contexts()), blk, args), ref)
        assert plan.stats["replayed"] == len(plan.save) > 0 and plan.stats["diverged"] == 0
    assert _same(_grads(Checkpointed(blk, sac_policy(SAC_VARIANTS["matmuls"])), blk, args), ref)


@pytest.mark.slow
def test_gradients_under_every_plan_and_policy(block_and_inputs, block_trace):
    blk, args = block_and_inputs
    ref = _grads(blk, blk, args)
    total = candidates(block_trace).total_bytes
    for budget in (0, total // 10, total // 2, total):
        plan = make_plan(block_trace, budget)
        assert _same(_grads(Checkpointed(blk, plan.contexts()), blk, args), ref)
        assert _same(_grads(Checkpointed(blk, plan.torch_contexts()), blk, args), ref)
    for keep in SAC_VARIANTS.values():
        assert _same(_grads(Checkpointed(blk, sac_policy(keep)), blk, args), ref)
    assert _same(_grads(Checkpointed(blk, None), blk, args), ref)


def test_a_plan_holds_on_other_inputs(block_and_inputs, block_trace):
    blk, (x, positions, segs, ids) = block_and_inputs
    plan = make_plan(block_trace, candidates(block_trace).total_bytes // 2)
    g = torch.Generator().manual_seed(5)
    other = (torch.randn(x.shape, generator=g), positions, segs, torch.randint(0, 256, ids.shape, generator=g))
    assert _same(_grads(Checkpointed(blk, plan.contexts()), blk, other), _grads(blk, blk, other))


class _Branchy(torch.nn.Module):
    """A block whose op sequence depends on its data."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x).tanh()
        if x.sum() > 0:
            h = h * h.sigmoid()
        return self.b(h).exp()


def test_another_op_sequence_stops_caching_and_stays_exact():
    torch.manual_seed(0)
    m = _Branchy()
    pos, neg = torch.rand(4, 8), -torch.rand(4, 8)
    tr = trace(m, pos)
    plan = make_plan(tr, candidates(tr).total_bytes)
    assert _same(_grads(Checkpointed(m, plan.contexts()), m, (neg,)), _grads(m, m, (neg,)))
    assert plan.stats["diverged"] == 1 and 0 < plan.stats["replayed"] < len(plan.save)


class _Lazy(torch.nn.Module):
    """A block that builds a table on its first call only (as kernel autotuning or a lazily built
    rope table does)."""

    def __init__(self):
        super().__init__()
        self.lin, self.table = torch.nn.Linear(8, 8), None

    def forward(self, x):
        if self.table is None:
            self.table = torch.arange(8.0).exp()
        return (self.lin(x) * self.table).tanh().sigmoid()


def test_the_trace_is_of_a_warm_call():
    x = torch.rand(4, 8)
    for warm, diverged in ((True, 0), (False, 1)):  # control: a cold trace records the first call's extra ops
        torch.manual_seed(0)
        m = _Lazy()
        tr = trace(m, x, warm=warm)
        plan = make_plan(tr, candidates(tr).total_bytes)
        assert _same(_grads(Checkpointed(m, plan.contexts()), m, (x,)), _grads(m, m, (x,)))
        assert plan.stats["diverged"] == diverged
        assert (plan.stats["replayed"] == len(plan.save) > 0) == (not diverged)


def test_a_cached_output_written_later_is_refused(block_and_inputs, block_trace):
    # inverse control for the written-later rule: caching such an output would hand back changed values
    # (a candidate the recompute does not replay op for op - e.g. the MoE's integer routing - stops
    # caching instead; its gradients must then still be exact)
    blk, args = block_and_inputs
    bad = [r for r in block_trace.records[:block_trace.stop]
           if r.written_later and not r.view and not r.inplace and r.tensors_only]
    plain, refused = _grads(blk, blk, args), 0
    for r in bad[:4]:
        try:
            got = _grads(Checkpointed(blk, Plan(block_trace, frozenset({r.index})).contexts()), blk, args)
        except RuntimeError as e:
            assert "written in place since" in str(e), e
            refused += 1
        else:
            assert _same(got, plain), f"op {r.index} ({r.func}) cached after a later write changed the gradients"
    assert refused, [str(r.func) for r in bad[:4]]


def test_random_draws_are_saved_not_drawn_again():
    lin = torch.nn.Linear(8, 8)

    class F(torch.nn.Module):
        def forward(self, x):
            return (lin(x) * torch.randn_like(x)).tanh()

    x = torch.randn(4, 8)
    tr = trace(F(), x)
    rand = {r.index for r in tr.records if r.random}
    plan = make_plan(tr, budget_bytes=0)
    assert rand and rand <= plan.save

    def grads(context_fn, seed):
        torch.manual_seed(seed)
        lin.zero_grad(set_to_none=True)
        Checkpointed(F(), context_fn, preserve_rng_state=False)(x).sum().backward()
        return lin.weight.grad.clone()

    torch.manual_seed(7)
    lin.zero_grad(set_to_none=True)
    F()(x).sum().backward()
    ref = lin.weight.grad.clone()
    # the RNG state is not restored for the recompute: only the cached draw keeps the gradient right
    assert torch.equal(grads(plan.contexts(), 7), ref)
    # inverse control: the same run with the draw recomputed differs
    assert not torch.equal(grads(Plan(tr, plan.save - rand).contexts(), 7), ref)


@pytest.mark.parametrize("spec", ["plan:0.3", "full"])
def test_training_with_recompute_equals_training_without(tmp_path, spec):
    from v4stack.train import checkpoint as ckpt
    from v4stack.train.trainer import TrainConfig, train

    from .test_trainer import SMALL

    runs = {}
    for mode in ("none", spec):
        out = tmp_path / mode.replace(":", "_")
        train(TrainConfig(**{**SMALL, "steps": 2, "ckpt_every": 2, "recompute": mode, "out": str(out)}))
        runs[mode] = ckpt.load_model(ckpt.step_dir(out / "ckpt", 2))["model"]
    a, b = runs["none"], runs[spec]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
