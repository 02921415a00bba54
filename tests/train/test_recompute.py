"""The recompute planner on a real V4 block: what it saves follows the rules (views never, random
ops always, the budget kept), gradients under any plan equal the plain backward bit for bit, and a
plan that does not match the executed ops is refused."""

import pytest
import torch

from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.train.recompute import Checkpointed, make_plan, matmul_plan, profile, sac_matmul_policy


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


def _grads(module, blk, args):
    x = args[0].clone().requires_grad_(True)
    blk.zero_grad(set_to_none=True)
    out = module(x, *args[1:])
    (out.float() ** 2).sum().backward()
    return [x.grad.clone()] + [p.grad.clone() for p in blk.parameters() if p.grad is not None]


def test_plan_rules_and_budget(block_and_inputs):
    blk, args = block_and_inputs
    recs = profile(blk, *args)
    assert any(r.view for r in recs) and any(r.name == "aten.mm" for r in recs)
    full = make_plan(recs, budget_bytes=1 << 40)
    none = make_plan(recs, budget_bytes=0)
    half = make_plan(recs, budget_bytes=full.full_bytes // 2)
    for p in (full, none, half):
        assert not any(recs[i].view or recs[i].inplace for i in p.save)
        assert p.saved_bytes == sum(recs[i].out_bytes for i in p.save)
    assert none.save == set() and none.saved_bytes == 0
    assert half.saved_bytes <= full.full_bytes // 2
    assert full.recompute_cost < half.recompute_cost < none.recompute_cost
    # at the memory torch's save-the-matmuls policy holds, the planner leaves less to recompute
    mm = matmul_plan(recs)
    same = make_plan(recs, budget_bytes=mm.saved_bytes)
    assert same.saved_bytes <= mm.saved_bytes and same.recompute_cost < mm.recompute_cost


def test_random_draws_are_saved_not_drawn_again():
    lin = torch.nn.Linear(8, 8)

    def f(x):
        return (lin(x) * torch.randn_like(x)).tanh()

    x = torch.randn(4, 8)
    recs = profile(f, x)
    rand = [r.index for r in recs if r.random]
    plan = make_plan(recs, budget_bytes=0)
    assert rand and set(rand) <= plan.save

    def grads(module, seed):
        torch.manual_seed(seed)
        lin.zero_grad(set_to_none=True)
        module(x).sum().backward()
        return lin.weight.grad.clone()

    class F(torch.nn.Module):
        def forward(self, x):
            return f(x)

    ref = grads(F(), 7)
    # the RNG state is not restored for the recompute: only the saved draw keeps the gradient right
    assert torch.equal(grads(Checkpointed(F(), plan.policy(), preserve_rng_state=False), 7), ref)
    plan.save.clear()  # inverse control: the same run with the draw recomputed differs
    assert not torch.equal(grads(Checkpointed(F(), plan.policy(), preserve_rng_state=False), 7), ref)


def test_gradients_under_every_plan_equal_the_plain_backward(block_and_inputs):
    blk, args = block_and_inputs
    ref = _grads(blk, blk, args)
    recs = profile(blk, *args)
    full_bytes = make_plan(recs, 1 << 40).full_bytes
    for ctx in (make_plan(recs, 0).policy(), make_plan(recs, full_bytes // 3).policy(),
                make_plan(recs, 1 << 40).policy(), sac_matmul_policy(), None):
        got = _grads(Checkpointed(blk, ctx), blk, args)
        assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


def test_the_rule_form_holds_on_other_inputs(block_and_inputs):
    blk, (x, positions, segs, ids) = block_and_inputs
    plan = make_plan(profile(blk, x, positions, segs, ids), budget_bytes=1 << 18)
    g = torch.Generator().manual_seed(5)
    other = (torch.randn(x.shape, generator=g), positions, segs, torch.randint(0, 256, ids.shape, generator=g))
    ref = _grads(blk, blk, other)
    got = _grads(Checkpointed(blk, plan.rule()), blk, other)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert plan.rule_stats["saved"] > 0 and plan.rule_stats["recomputed"] > 0


def test_the_rule_form_without_the_op_output(block_and_inputs):
    # torch releases that ask the policy before the op runs give no output: the rule then decides
    # by (op name, input shapes) from the plan; gradients stay the plain backward's, bit for bit
    blk, (x, positions, segs, ids) = block_and_inputs
    plan = make_plan(profile(blk, x, positions, segs, ids), budget_bytes=1 << 18)
    g = torch.Generator().manual_seed(5)
    for args in ((x, positions, segs, ids),
                 (torch.randn(x.shape, generator=g), positions, segs, torch.randint(0, 256, ids.shape, generator=g))):
        got = _grads(Checkpointed(blk, plan.rule(use_output=False)), blk, args)
        assert all(torch.equal(a, b) for a, b in zip(got, _grads(blk, blk, args)))
        assert plan.rule_stats["saved"] > 0 and plan.rule_stats["recomputed"] > 0
    none = make_plan(profile(blk, x, positions, segs, ids), budget_bytes=0)
    _grads(Checkpointed(blk, none.rule(use_output=False)), blk, (x, positions, segs, ids))
    assert none.rule_stats["saved"] == 0  # control: an empty plan saves nothing by key either


def test_a_plan_for_other_ops_is_refused(block_and_inputs):
    blk, args = block_and_inputs
    recs = profile(blk, *args)
    wrong = make_plan(recs[1:], budget_bytes=0)  # shifted by one op: the names no longer line up
    with pytest.raises(RuntimeError, match="recompute plan out of step"):
        _grads(Checkpointed(blk, wrong.policy()), blk, args)


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
