"""Random initialisation that keeps every mechanism alive (nothing starts degenerate).

Deterministic given a seed: a CPU generator draws every tensor in ``named_parameters`` order, so
two models built from one seed are bitwise equal whatever device they later move to. With
``device`` the draws come from that device's generator instead (other numbers, still one stream
per seed): how a check builds a model of V4-Flash widths in seconds where it runs.
"""

from __future__ import annotations

import torch
from torch import nn

# parameters kept in fp32 in the released checkpoints (mHC, sinks, ape, gate bias)
FP32_SUFFIXES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base",
                 "hc_ffn_scale", "hc_head_fn", "hc_head_base", "hc_head_scale", "attn_sink", "ape",
                 "gate.bias")


def is_fp32_param(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, device: str | torch.device | None = None) -> None:
    g = torch.Generator(device=device or "cpu").manual_seed(seed)
    on = g.device

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64, device=on).mul_(std).add_(mean).to(t.dtype))

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            normal(p, 0.1, 1.0)
        elif name == "embed.weight":
            normal(p, 1.0)
        elif leaf.endswith("_fn"):  # mHC projections: mix ~ N(0, 1) on unit-RMS input
            normal(p, p.shape[1] ** -0.5)
        elif leaf.endswith("_base"):
            normal(p, 0.5)
            if p.numel() > 4 * 2 and name.endswith(("hc_attn_base", "hc_ffn_base")):
                n = int(round((p.numel() + 1) ** 0.5)) - 1  # width n^2 + 2n
                p[2 * n :] *= 0.2  # comb logits stay where 20 Sinkhorn rounds converge
        elif leaf.endswith("_scale"):
            p.copy_((torch.rand(p.shape, generator=g, dtype=torch.float64, device=on) * 0.5 + 0.75).to(p.dtype))
            if p.numel() == 3:
                p[2] *= 0.25
        elif leaf == "attn_sink":
            normal(p, 1.0)
        elif leaf == "ape":
            normal(p, 0.5)
        elif name.endswith("gate.bias"):
            normal(p, 0.1)
        elif p.dim() == 2:  # linear weights: unit-variance outputs for unit-variance inputs
            normal(p, p.shape[1] ** -0.5)
        else:
            raise AssertionError(f"no init rule for parameter {name}")
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            vocab, k = b.shape
            n_experts = model.cfg.n_routed_experts
            perm = torch.rand(vocab, n_experts, generator=g, device=on).argsort(dim=1)[:, :k]
            b.copy_(perm.to(b.dtype))
