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
