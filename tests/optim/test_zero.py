"""The sharded step over real gloo process groups: bitwise equal to single-process Muon with
rounding off, unbiased with stochastic rounding on, reduced in FP32 on the owner."""

import pytest
import torch

from v4stack.optim.adamw import AdamWHyper
from v4stack.optim.hybrid import MuonAdamW
from v4stack.optim.muon import MuonHyper
from v4stack.optim.zero import ZeroMuonAdamW, canonical_sum

from .distributed import run_world

SHAPES = {
    "embed.weight": (32, 16), "head.weight": (32, 16), "norm.weight": (16,), "hc_head_base": (4,),
    "layers.0.attn.wq_a.weight": (8, 16), "layers.0.attn.wq_b.weight": (24, 8),
    "layers.0.attn.wo_b.weight": (16, 24), "layers.0.attn.attn_sink": (2,),
    "layers.0.attn_norm.weight": (16,), "layers.0.ffn.gate.weight": (4, 16), "layers.0.ffn.gate.bias": (4,),
    **{f"layers.0.ffn.experts.{e}.w{j}.weight": ((12, 16) if j != 2 else (16, 12))
       for e in range(4) for j in (1, 2, 3)},
    "layers.0.ffn.shared_experts.w1.weight": (12, 16), "layers.1.attn.wkv.weight": (20, 16),
    "mtp.0.e_proj.weight": (16, 16), "mtp.0.enorm.weight": (16,),
}
MUON = MuonHyper(lr=0.05, weight_decay=0.1)
ADAMW = AdamWHyper(lr=0.01, weight_decay=0.1)


def make_params():
    g = torch.Generator().manual_seed(1234)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def grads_for(rank, step):
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return {n: torch.randn(s, generator=g) * (1 + rank) for n, s in SHAPES.items()}


def _bitwise(rank, world, group_size, steps):
    params = make_params()
    opt = ZeroMuonAdamW(params, MUON, ADAMW, zero_group_size=group_size, stochastic=False)
    assert opt.G == group_size and opt.R == world // group_size
    assert len(opt.items) == 10  # 7 plain matrices + 3 expert stacks
    for s in range(steps):
        opt.step(grads_for(rank, s))
    ref_params = make_params()
    ref = MuonAdamW(ref_params, MUON, ADAMW)
    for s in range(steps):
        per_rank = [grads_for(r, s) for r in range(world)]
        ref.step({n: canonical_sum([g[n] for g in per_rank], group_size) for n in SHAPES})
    for n in SHAPES:
        assert torch.equal(params[n], ref_params[n]), f"rank {rank}: {n} differs from single-process Muon"
    assert not torch.equal(params["layers.0.attn.wq_a.weight"], make_params()["layers.0.attn.wq_a.weight"])


@pytest.mark.parametrize("world,group_size", [(2, 2), (4, 4), (4, 2)])
def test_sharded_step_equals_single_process_bitwise(world, group_size):
    run_world(_bitwise, world, group_size, 3)


def _fp32_on_owner_and_unbiased(rank, world):
    params = make_params()
    opt = ZeroMuonAdamW(params, MUON, ADAMW, zero_group_size=world, stochastic=True, seed=7)
    # FP32 on the owner: 256 + 1 + 1 + ... is exact in fp32 but not in bf16 (8 significant bits)
    grads = {n: torch.full(s, 256.0 if rank == 0 else 1.0) for n, s in SHAPES.items()}
    acc = opt.reduce(grads)
    expect = 256.0 + (world - 1)
    assert torch.tensor(expect).bfloat16().float().item() != expect
    for i in opt.mine:
        assert torch.all(opt.owned_grad(acc, i) == expect), "owner sum lost precision"
    adam = acc[opt.L:opt.L + min(opt.S, opt.N - opt.local * opt.S)]
    assert torch.all(adam == expect)

    # unbiased: gradients that bf16 cannot hold; the mean of K stochastic reductions -> fp32 sum
    g = torch.Generator().manual_seed(99)
    base = {n: (1.0 + torch.rand(s, generator=g) * 0.999) for n, s in SHAPES.items()}
    per_rank = [{n: v * (1 + 0.37 * r) for n, v in base.items()} for r in range(world)]
    mine = {n: v.clone() for n, v in per_rank[rank].items()}
    K = 300
    total = torch.zeros_like(acc, dtype=torch.float64)
    for _ in range(K):
        total += opt.reduce(mine).double()
    mean = total / K
    exact = opt._send_buffer({n: canonical_sum([p[n] for p in per_rank], world)
                              for n in SHAPES})[opt.local].double()
    # each rank's value is in [1, 3.2): bf16 spacing <= 2^-6; sum of `world` roundings, K draws
    ulp = 2.0 ** -6
    sigma = (world * ulp ** 2 / 4 / K) ** 0.5
    live = exact != 0
    z = ((mean - exact)[live] / sigma).abs()
    assert z.max() < 6.0, f"stochastic rounding biased: max z {z.max():.2f}"
    # the same statistic catches round-to-nearest: its error is a fixed bias, not noise
    rne = canonical_sum([opt._send_buffer(p)[opt.local].bfloat16().float() for p in per_rank], world)
    z_rne = ((rne.double() - exact)[live] / sigma).abs()
    assert z_rne.max() > 6.0


@pytest.mark.parametrize("world", [2, 4])
def test_owner_reduces_in_fp32_and_rounding_is_unbiased(world):
    run_world(_fp32_on_owner_and_unbiased, world)


def _state_round_trip(rank, world):
    params = make_params()
    opt = ZeroMuonAdamW(params, MUON, ADAMW, stochastic=True, seed=3)
    for s in range(2):
        opt.step(grads_for(rank, s))
    saved_params = {n: p.clone() for n, p in params.items()}
    saved = opt.state_dict()
    opt.step(grads_for(rank, 2))
    after = {n: p.clone() for n, p in params.items()}

    params2 = {n: p.clone() for n, p in saved_params.items()}
    opt2 = ZeroMuonAdamW(params2, MUON, ADAMW, stochastic=True, seed=999)  # seed is overwritten
    opt2.load_state_dict(saved)
    opt2.step(grads_for(rank, 2))
    for n in SHAPES:
        assert torch.equal(params2[n], after[n]), f"{n}: resumed step differs"
    bad = dict(saved, zero_group_size=saved["zero_group_size"] + 1)
    with pytest.raises(ValueError, match="zero_group_size"):
        opt2.load_state_dict(bad)


def test_state_round_trip_with_stochastic_rounding():
    run_world(_state_round_trip, 2)
