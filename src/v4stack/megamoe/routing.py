"""Synthetic routings for tests and benchmarks: uniform, Zipf-skewed, and restricted to a subset
of experts (the rest receive nothing). Deterministic given a generator; k distinct experts per
token; weights are positive and sum to 1 per token, in fp32."""

from __future__ import annotations

import torch

KINDS = ("uniform", "zipf", "subset")


def routing(kind: str, n_tokens: int, n_experts: int, topk: int, gen: torch.Generator,
            *, zipf_s: float = 1.2, subset: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (expert indices ``[n, k]`` int64, weights ``[n, k]`` fp32)."""
    if kind not in KINDS:
        raise ValueError(f"routing kind must be one of {KINDS}, got {kind!r}")
    if not 0 < topk <= n_experts:
        raise ValueError(f"topk must lie in [1, n_experts={n_experts}], got {topk}")
    p = torch.ones(n_experts, dtype=torch.float64)
    if kind == "zipf":
        # popularity 1/rank^s over a fixed random permutation of the experts
        perm = torch.randperm(n_experts, generator=gen)
        p[perm] = 1.0 / torch.arange(1, n_experts + 1, dtype=torch.float64) ** zipf_s
    elif kind == "subset":
        m = subset if subset is not None else topk
        if not topk <= m <= n_experts:
            raise ValueError(f"subset must lie in [topk={topk}, n_experts={n_experts}], got {m}")
        p[m:] = 0
    if n_tokens == 0:
        return torch.zeros(0, topk, dtype=torch.long), torch.zeros(0, topk, dtype=torch.float32)
    idx = torch.multinomial(p.expand(n_tokens, -1), topk, replacement=False, generator=gen)
    w = torch.rand(n_tokens, topk, generator=gen, dtype=torch.float32) + 0.1
    return idx, w / w.sum(-1, keepdim=True)


def histogram(idx: torch.Tensor, n_experts: int) -> list[int]:
    return torch.bincount(idx.reshape(-1), minlength=n_experts).tolist()
