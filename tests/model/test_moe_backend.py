"""The expert-backend seam: the local grouped backend equals per-expert SwiGLU, stacks weights once,
passes gradients, and ``set_expert_backend`` swaps the backend on every MoE layer."""

import torch

from v4stack import ops
from v4stack.model.moe import swiglu


def _per_expert(moe, x, idx, w):
    y = torch.zeros(x.shape[0], idx.shape[1], x.shape[1], dtype=x.dtype)
    for e in range(moe.n_experts):
        tok, slot = torch.where(idx == e)
        if len(tok):
            ex = moe.experts[e]
            y[tok, slot] = swiglu(x[tok], ex.w1.weight, ex.w2.weight, ex.w3.weight, moe.limit, w[tok, slot])
    return ops.moe_combine(y, idx)


@torch.no_grad()
def test_grouped_equals_per_expert_bitwise(model64):
    moe = model64.layers[-1].ffn
    x = torch.randn(29, model64.cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with ops.mode("invariant"):
        idx, w = moe.gate(x, torch.randint(0, 200, (29,)))
        assert torch.equal(moe.backend(moe, x, w, idx), _per_expert(moe, x, idx, w))
        w1, _, _ = moe.stacked_weights()
        assert moe.experts[2].w1.weight.data_ptr() == w1[2].data_ptr()  # views, no copy per call
        assert moe.stacked_weights()[0] is w1


def test_gradients_reach_each_expert(model64):
    moe = model64.layers[-1].ffn
    x = torch.randn(8, model64.cfg.hidden_size, dtype=torch.float64)
    idx = torch.arange(16).view(8, 2) % moe.n_experts
    w = torch.full((8, 2), 0.5, dtype=torch.float64)
    moe.backend(moe, x, w, idx).sum().backward()
    hit = set(idx.flatten().tolist())
    for e, ex in enumerate(moe.experts):
        g = ex.w2.weight.grad
        assert (g is not None and g.abs().sum() > 0) == (e in hit)
        ex.zero_grad()


@torch.no_grad()
def test_set_expert_backend_reaches_every_layer(model64):
    calls = []

    def factory(layer_id, moe):
        def backend(m, x, weights, indices):
            calls.append(layer_id)
            return torch.zeros(x.shape[0], x.shape[1], dtype=x.dtype)
        return backend

    model64.set_expert_backend(factory)
    try:
        model64(torch.zeros(1, 3, dtype=torch.long))
        assert sorted(set(calls)) == list(range(model64.cfg.num_hidden_layers))
    finally:
        from v4stack.model.moe import LocalGrouped
        model64.set_expert_backend(lambda i, m: LocalGrouped())


@torch.no_grad()
def test_shared_expert_joins_the_grouped_gemms_with_the_same_bits(model64):
    """Serving (no autograd): the shared expert runs as expert E of the routed grouped GEMMs, one
    more slot per token with weight 1 - the combine's order adds it last, as the separate path
    did, so the layer's output keeps its bits (invariant ops, CPU); its parameters become views
    of the stacks' last entries. Control: leaving the shared expert out is another output."""
    from v4stack.model.moe import LocalGrouped, swiglu_in_weight_dtype

    moe = model64.layers[-1].ffn
    se = moe.shared_experts
    x = torch.randn(13, model64.cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with ops.mode("invariant"):
        idx, w = moe.gate(x, torch.randint(0, 200, (13,)))
        assert moe._shared_joins()
        joined = moe.combine(x, idx, w)
        shared = swiglu_in_weight_dtype(x, se.w1.weight, se.w2.weight, se.w3.weight, se.limit, cast=False)
        assert torch.equal(joined, LocalGrouped().run(moe, x, w, idx, shared, x.dtype))
        assert not torch.equal(joined, LocalGrouped().run(moe, x, w, idx, None, x.dtype))
        w1, _, _ = moe.stacked_weights(True)
        assert w1.shape[0] == moe.n_experts + 1 and se.w1.weight.data_ptr() == w1[-1].data_ptr()
    with torch.enable_grad():
        assert not moe._shared_joins()  # training keeps the shared expert apart


def test_router_weight_widened_once_and_again_after_a_change():
    """A bf16 router's fp32 weight is one kept copy (no cast a call) that follows the weight: an
    in-place update and a replaced tensor both give the new weight's choice. The control: the
    first choice is not the updated weight's (a stale copy would be seen)."""
    from v4stack.config import preset
    from v4stack.model.moe import Gate

    cfg = preset("tiny")
    gate = Gate(cfg, hashed=False).bfloat16()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen))
        x = torch.randn(16, cfg.hidden_size, generator=gen).bfloat16()
        first = gate(x, None)[0]
        assert gate._weight_in(torch.float32) is gate._weight_in(torch.float32)
        gate.weight.mul_(-1)  # in place: the best experts become the worst
        flipped = gate(x, None)[0]
        assert torch.equal(flipped, Gate.forward(_fresh(gate, cfg), x, None)[0])
        assert not torch.equal(flipped, first)
        gate.weight.data = torch.randn(gate.weight.shape, generator=gen).bfloat16()  # replaced
        assert torch.equal(gate(x, None)[0], Gate.forward(_fresh(gate, cfg), x, None)[0])


def _fresh(gate, cfg):
    from v4stack.model.moe import Gate

    g = Gate(cfg, hashed=False).bfloat16()
    g.load_state_dict(gate.state_dict())
    return g
