"""Muon: the Newton-Schulz singular-value band, the update's RMS, weight decay, the parameter split."""

import math

import numpy as np
import pytest
import torch

from v4stack.optim.adamw import AdamWHyper
from v4stack.optim.hybrid import MuonAdamW
from v4stack.optim.muon import (STAGE1, STAGE2, V4_SCHEDULE, MuonHyper, muon_step_, newton_schulz,
                                ns_scalar, update_scale)
from v4stack.optim.split import muon_items, split_params


def _quintic_critical_points(abc):
    """Positive x where d/dx (a x + b x^3 + c x^5) = 0: a + 3b x^2 + 5c x^4 = 0."""
    a, b, c = abc
    roots = np.roots([5 * c, 3 * b, a])
    return sorted(math.sqrt(r.real) for r in roots if abs(r.imag) < 1e-12 and r.real > 0)


def stage1_band():
    """Stage 1's invariant band: [local min value, local max value] of its quintic."""
    x_max, x_min = _quintic_critical_points(STAGE1)
    hi = ns_scalar([STAGE1], x_max)
    lo = ns_scalar([STAGE1], x_min)
    # the band maps into itself: its end points land back inside it
    for e in (lo, hi):
        assert lo - 1e-12 <= ns_scalar([STAGE1], e) <= hi + 1e-12
    return lo, hi


def stage1_floor(lo):
    """Smallest sigma whose 8 stage-1 steps reach the band (the map is increasing below the band)."""
    a, b = 1e-12, lo
    for _ in range(200):
        mid = math.sqrt(a * b)
        if ns_scalar([STAGE1] * 8, mid) >= lo:
            b = mid
        else:
            a = mid
    return b


def two_stage_band(lo, hi):
    xs = np.linspace(lo, hi, 200001)
    ys = ns_scalar([STAGE2] * 2, xs)
    return float(ys.min()), float(ys.max())


def test_stage2_pins_one_with_zero_slope():
    a, b, c = STAGE2
    assert ns_scalar([STAGE2], 1.0) == pytest.approx(1.0, abs=1e-15)
    assert a + 3 * b + 5 * c == pytest.approx(0.0, abs=1e-15)
    assert V4_SCHEDULE == (STAGE1,) * 8 + (STAGE2,) * 2


def _random_matrix(n, m, svals, seed):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    k = min(n, m)
    return (u[:, :k] * torch.as_tensor(svals, dtype=torch.float64)) @ v[:, :k].T


@pytest.mark.parametrize("n,m,seed", [(48, 48, 0), (32, 80, 1), (96, 40, 2)])
def test_newton_schulz_singular_value_band(n, m, seed):
    lo1, hi1 = stage1_band()
    floor = stage1_floor(lo1)
    lo2, hi2 = two_stage_band(lo1, hi1)
    assert 1e-5 < floor < 1e-3  # inputs spanning 1e-3..1 are all above the floor
    k = min(n, m)
    # after Frobenius normalisation the singular values span 1e-4 .. 1 (one dominant direction)
    tail = np.logspace(-4, -1.5, k - 1)
    top = math.sqrt(1.0 - float((tail ** 2).sum()))
    svals = np.concatenate([[top], tail])
    x = _random_matrix(n, m, svals, seed).float()
    s_in = torch.linalg.svdvals(x.double() / torch.linalg.norm(x.double()))
    assert s_in.max() > 0.98 and s_in.min() < 1e-3

    tol = 2e-3  # fp32 rounding over 10 steps
    out = torch.linalg.svdvals(newton_schulz(x).double())
    keep = torch.sort(s_in, descending=True).values >= floor
    s_out = torch.sort(out, descending=True).values[keep]
    assert s_out.numel() >= k - 2
    assert float(s_out.min()) >= lo2 - tol and float(s_out.max()) <= hi2 + tol

    out1 = torch.linalg.svdvals(newton_schulz(x, schedule=(STAGE1,) * 8).double())
    s1 = torch.sort(out1, descending=True).values[keep]
    assert float(s1.min()) >= lo1 - tol and float(s1.max()) <= hi1 + tol
    # the first stage alone is wider, in theory and as measured
    assert hi1 - lo1 > 10 * (hi2 - lo2)
    assert float(s1.max() - s1.min()) > (hi2 - lo2) + 2 * tol


def test_newton_schulz_stack_is_per_matrix():
    g = torch.Generator().manual_seed(3)
    stack = torch.randn(3, 16, 24, generator=g)
    out = newton_schulz(stack)
    for i in range(3):
        torch.testing.assert_close(out[i], newton_schulz(stack[i]), rtol=1e-5, atol=1e-6)


def test_update_rms_and_decoupled_weight_decay():
    g = torch.Generator().manual_seed(4)
    n, m = 64, 256
    w = torch.randn(1, n, m, generator=g)
    grad = torch.randn(1, n, m, generator=g)
    hp = MuonHyper(lr=0.1, weight_decay=0.0, momentum=0.95)
    w0 = w.clone()
    muon_step_(w, grad, torch.zeros_like(w), hp)
    delta = (w0 - w) / hp.lr
    rms = float(delta.pow(2).mean().sqrt())
    # an orthogonal factor of rank min(n,m) has RMS sqrt(min/(n m)); scaled by 0.18 sqrt(max)
    assert rms == pytest.approx(0.18, rel=0.02)
    assert update_scale((n, m)) == pytest.approx(0.18 * math.sqrt(256))
    # decoupled decay: with a zero gradient the momentum-free step is a pure shrink by lr * wd
    hp_wd = MuonHyper(lr=0.1, weight_decay=0.5, momentum=0.0)
    w2 = w0.clone()
    muon_step_(w2, torch.zeros_like(w2), torch.zeros_like(w2), hp_wd)
    torch.testing.assert_close(w2, w0 * (1 - 0.1 * 0.5))


def test_nesterov_momentum_uses_grad_plus_mu_buffer():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1, 8, 8, generator=g)
    g1, g2 = torch.randn(2, 1, 8, 8, generator=g)
    hp = MuonHyper(lr=0.01, weight_decay=0.0)
    buf = torch.zeros_like(w)
    a = w.clone()
    muon_step_(a, g1, buf, hp)
    muon_step_(a, g2, buf, hp)
    b1 = g1.clone()
    b2 = 0.95 * b1 + g2
    expect = w - 0.01 * update_scale((8, 8)) * (newton_schulz(g1 + 0.95 * b1) + newton_schulz(g2 + 0.95 * b2))
    torch.testing.assert_close(a, expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(buf, b2)


NAMES = [
    ("embed.weight", (256, 64)), ("head.weight", (256, 64)), ("norm.weight", (64,)),
    ("hc_head_fn", (4, 256)), ("hc_head_base", (4,)), ("hc_head_scale", (1,)),
    ("layers.0.attn.wq_a.weight", (32, 64)), ("layers.0.attn.q_norm.weight", (32,)),
    ("layers.0.attn.attn_sink", (4,)), ("layers.0.attn.compressor.ape", (4, 64)),
    ("layers.0.attn.compressor.wkv.weight", (64, 64)), ("layers.0.attn.compressor.norm.weight", (32,)),
    ("layers.0.ffn.gate.weight", (8, 64)), ("layers.0.ffn.gate.bias", (8,)),
    ("layers.0.ffn.experts.0.w1.weight", (32, 64)), ("layers.0.ffn.experts.1.w1.weight", (32, 64)),
    ("layers.0.ffn.experts.10.w1.weight", (32, 64)), ("layers.0.ffn.experts.0.w2.weight", (64, 32)),
    ("layers.0.ffn.shared_experts.w1.weight", (32, 64)), ("layers.0.hc_attn_fn", (24, 256)),
    ("layers.0.hc_attn_base", (24,)), ("layers.0.attn_norm.weight", (64,)),
    ("mtp.0.e_proj.weight", (64, 64)), ("mtp.0.enorm.weight", (64,)),
]


def test_split_is_explicit():
    sp = split_params(NAMES)
    assert set(sp.muon) == {
        "layers.0.attn.wq_a.weight", "layers.0.attn.compressor.wkv.weight", "layers.0.ffn.gate.weight",
        "layers.0.ffn.experts.0.w1.weight", "layers.0.ffn.experts.1.w1.weight",
        "layers.0.ffn.experts.10.w1.weight", "layers.0.ffn.experts.0.w2.weight",
        "layers.0.ffn.shared_experts.w1.weight", "mtp.0.e_proj.weight"}
    assert sp.reasons["embed.weight"] == "embedding"
    assert sp.reasons["head.weight"] == "output head"
    assert sp.reasons["layers.0.hc_attn_fn"] == "mHC static bias / gate"
    assert sp.reasons["layers.0.ffn.gate.bias"] == "bias"
    assert sp.reasons["layers.0.attn.compressor.ape"].startswith("compressor")
    text = sp.describe()
    assert "muon: 9 tensors" in text and "adamw: 15 tensors" in text

    items = {it.name: it for it in muon_items(sp.muon)}
    stack = items["layers.0.ffn.experts.*.w1.weight"]
    assert stack.members == ("layers.0.ffn.experts.0.w1.weight", "layers.0.ffn.experts.1.w1.weight",
                             "layers.0.ffn.experts.10.w1.weight")
    assert stack.numel == 3 * 32 * 64
    assert items["layers.0.ffn.experts.*.w2.weight"].k == 1
    assert len(items) == 7


def test_hybrid_lowers_a_quadratic_loss():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(16, 8),
                                 "wq_a": torch.nn.Linear(8, 8, bias=False)})
    opt = MuonAdamW(model, MuonHyper(lr=0.1, weight_decay=0.0), AdamWHyper(lr=0.03, weight_decay=0.0))
    assert set(opt.split.muon) == {"wq_a.weight"}
    target = torch.randn(16, 8)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = (model["wq_a"](model["embed"].weight) - target).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
