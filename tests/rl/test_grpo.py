"""The GRPO update on the tiny model: direction, clipping, and what the mask leaves out."""

from __future__ import annotations

import numpy as np
import torch

from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.optim.hybrid import MuonAdamW
from v4stack.optim.muon import MuonHyper
from v4stack.rl.grpo import grpo_loss


def _heavy(model, seqs, prompt_len=3, obs=(5, 6)):
    out = []
    with torch.no_grad():
        for s in seqs:
            lp = torch.log_softmax(model(torch.tensor([s]))[0].float(), -1)
            gen = s[prompt_len:]
            lps = np.array([float(lp[prompt_len + i - 1, t]) for i, t in enumerate(gen)], np.float32)
            mask = np.ones(len(gen), np.uint8)
            mask[obs[0] - prompt_len : obs[1] - prompt_len] = 0
            out.append({"tokens": np.array(s, np.int32), "prompt_len": prompt_len, "lp": lps, "mask": mask})
    return out


def _seq_lp(model, h):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([h["tokens"].tolist()]))[0].float(), -1)
    p = h["prompt_len"]
    return sum(float(lp[p + i - 1, int(t)]) for i, t in enumerate(h["tokens"][p:]) if h["mask"][i])


def test_update_moves_sampled_tokens_by_the_sign_of_the_advantage():
    model = V4Model(preset("tiny"), seed=0)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (12,), generator=g).tolist() for _ in range(2)]
    heavy = _heavy(model, seqs)
    before = [_seq_lp(model, h) for h in heavy]
    loss, stats = grpo_loss(model, heavy, torch.tensor([1.0, -1.0]), clip=0.2)
    assert abs(stats["ratio_mean"] - 1) < 1e-4 and stats["tokens"] == 2 * (9 - 1)  # obs token not counted
    loss.backward()
    opt = MuonAdamW(model, MuonHyper(lr=0.002))
    opt.step()
    after = [_seq_lp(model, h) for h in heavy]
    assert after[0] > before[0] and after[1] < before[1]
    # inverse control: zero advantages leave no gradient at all
    model.zero_grad()
    loss, _ = grpo_loss(model, heavy, torch.zeros(2), clip=0.2)
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_clipped_tokens_carry_no_gradient():
    model = V4Model(preset("tiny"), seed=0)
    seqs = [list(range(10, 22))]
    heavy = _heavy(model, seqs)
    heavy[0]["lp"] = heavy[0]["lp"] - 1.0  # the rollout policy gave these tokens much less mass: ratio e > 1.2
    loss, stats = grpo_loss(model, heavy, torch.tensor([1.0]), clip=0.2)
    assert stats["clipped"] == 1.0
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    # inverse control: a negative advantage is not clipped from below at that ratio
    model.zero_grad()
    loss, _ = grpo_loss(model, heavy, torch.tensor([-1.0]), clip=0.2)
    loss.backward()
    assert any(p.grad is not None and p.grad.any() for p in model.parameters())
