"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator.

Each request owns its generator, so the tokens it draws never depend on which other requests
share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def validate(self) -> "SamplingParams":
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        return self


class Sampler:
    """Samples one token at a time for one request."""

    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        self.gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)

    def advance(self, n: int) -> None:
        """Skip the draws of ``n`` tokens already sampled (one uniform each unless greedy), so a
        request resumed from ``n`` durable tokens continues the same random stream."""
        if n < 0:
            raise ValueError(f"advance: n must be >= 0, got {n}")
        if self.params.temperature > 0:
            for _ in range(n):  # the same calls as sampling makes, so the stream matches exactly
                torch.rand((), generator=self.gen, dtype=torch.float64)

    def __call__(self, logits: torch.Tensor) -> int:
        """``logits [V]`` -> token id."""
        p = self.params
        logits = logits.detach().to(torch.float64).cpu()
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        if p.top_p < 1:
            sp, si = torch.sort(probs, descending=True, stable=True)
            keep = sp.cumsum(0) - sp < p.top_p  # smallest prefix whose mass reaches top_p
            probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        u = torch.rand((), generator=self.gen, dtype=torch.float64)
        cdf = probs.cumsum(0)
        return int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=probs.numel() - 1))
