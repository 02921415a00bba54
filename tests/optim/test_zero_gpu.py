"""The sharded step on CUDA over NCCL (one GPU per rank): bitwise equal to single-process Muon on
the same GPU with rounding off; stochastic rounding keeps the update close."""

import pytest
import torch

from v4stack.optim.hybrid import MuonAdamW
from v4stack.optim.zero import ZeroMuonAdamW, canonical_sum

from .distributed import run_world
from .test_zero import ADAMW, MUON, SHAPES, grads_for, make_params

pytestmark = pytest.mark.gpu


def _on(dev, d):
    return {n: t.to(dev) for n, t in d.items()}


def _nccl_bitwise(rank, world, steps):
    dev = torch.device("cuda", rank)
    params = _on(dev, make_params())
    opt = ZeroMuonAdamW(params, MUON, ADAMW, zero_group_size=world, stochastic=False)
    sr_params = _on(dev, make_params())
    sr = ZeroMuonAdamW(sr_params, MUON, ADAMW, zero_group_size=world, stochastic=True)
    for s in range(steps):
        opt.step(_on(dev, grads_for(rank, s)))
        sr.step(_on(dev, grads_for(rank, s)))
    ref_params = _on(dev, make_params())
    ref = MuonAdamW(ref_params, MUON, ADAMW)
    for s in range(steps):
        per_rank = [grads_for(r, s) for r in range(world)]
        ref.step(_on(dev, {n: canonical_sum([g[n] for g in per_rank], world) for n in SHAPES}))
    for n in SHAPES:
        assert params[n].is_cuda
        assert torch.equal(params[n], ref_params[n]), f"rank {rank}: {n} differs on CUDA"
        torch.testing.assert_close(sr_params[n], ref_params[n], rtol=0.05, atol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sharded_step_on_nccl_equals_single_process():
    run_world(_nccl_bitwise, torch.cuda.device_count(), 3, backend="nccl")
