"""The same model code on CUDA: incremental == full forward, and CPU == GPU within fp64 rounding."""

import pytest
import torch

from v4stack.config import preset
from v4stack.model import V4Model

from .conftest import tokens

pytestmark = pytest.mark.gpu


@torch.no_grad()
def test_cuda_incremental_matches_full_and_cpu():
    cfg = preset("tiny")
    cpu = V4Model(cfg, seed=1).cast(torch.float64).eval()
    gpu = V4Model(cfg, seed=1).cast(torch.float64).eval().to("cuda")
    t = tokens(60, seed=2)
    full_gpu = gpu(t.cuda())[0]
    st = gpu.new_state()
    assert st.layers[0].swa_kv.is_cuda
    inc = torch.cat([gpu.step([(t[0, i : i + 1].cuda(), st)])[0] for i in range(60)])
    assert (inc - full_gpu).abs().max().item() < 1e-9
    assert (full_gpu.cpu() - cpu(t)[0]).abs().max().item() < 1e-9


@torch.no_grad()
def test_cuda_bf16_runs():
    cfg = preset("tiny")
    m = V4Model(cfg, seed=1).cast(torch.bfloat16).eval().to("cuda")
    assert m.hc_head_fn.dtype == torch.float32 and m.embed.weight.dtype == torch.bfloat16
    out = m(tokens(40, seed=3).cuda())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


@torch.no_grad()
def test_shared_expert_beside_the_routing_matches_the_joined_one():
    """Fast mode's shared expert with its gate and up on the side stream (``V4STACK_SHARED_STREAM``,
    ``LocalGrouped._sorted_out_beside``) gives the joined grouped path's MoE output to bf16 rounding.
    Control: the same comparison with the shared expert's gate zeroed in one of the two differs far
    beyond that, so it sees the shared expert's rows."""
    from v4stack import ops
    from v4stack.model import side
    from v4stack.model.moe import LocalGrouped, MoE

    cfg = preset("tiny")
    m = V4Model(cfg, seed=4).cast(torch.bfloat16).eval().to("cuda")
    moe = next(mod for mod in m.modules() if isinstance(mod, MoE) and not mod.gate.hashed)
    assert moe._shared_joins()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, cfg.hidden_size, generator=g).to(torch.bfloat16).cuda()
    tok = torch.randint(0, cfg.vocab_size, (37,), generator=g).cuda()

    def run(beside: bool):
        was = LocalGrouped.shared_stream
        LocalGrouped.shared_stream = beside
        try:
            before = side.Fork.made
            with ops.mode("fast"):
                y = moe(x, tok).float()
            return y, side.Fork.made - before
        finally:
            LocalGrouped.shared_stream = was

    joined, forks = run(False)
    assert forks == 0
    beside, forks = run(True)
    assert forks == 1
    scale = joined.abs().max().item()
    err = (beside - joined).abs().max().item()
    assert scale > 0 and err < 2e-2 * scale, (err, scale)
    w1 = moe.shared_experts.w1.weight
    kept = w1.clone()
    w1.zero_()
    try:
        without, _ = run(True)
    finally:
        w1.copy_(kept)
    assert (without - joined).abs().max().item() > 10 * max(err, 1e-3 * scale)
