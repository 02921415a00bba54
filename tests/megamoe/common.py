"""Shared set-up for the MegaMoE tests: a seeded tiny MoE layer and per-rank token shards."""

import dataclasses

import torch

from v4stack.config import preset
from v4stack.model.moe import MoE


def make_moe(topk: int = 2, n_experts: int = 8, seed: int = 0) -> MoE:
    cfg = dataclasses.replace(preset("tiny"), num_experts_per_tok=topk, n_routed_experts=n_experts).validate()
    moe = MoE(cfg, layer_id=cfg.num_hash_layers)  # score-routed layer (no hash table)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in moe.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1))
    return moe.eval()


def offsets(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def same_grad(g, want) -> bool:
    """Equal gradients, an unused parameter's ``None`` standing for zeros (the grouped layers give
    an idle expert a zero gradient, the tests' per-expert reference layer none)."""
    if g is None or want is None:
        return all(t is None or not t.any() for t in (g, want))
    return torch.equal(g, want)
