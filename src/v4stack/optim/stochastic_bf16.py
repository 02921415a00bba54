"""Stochastic rounding of fp32 to bf16: add 16 uniform random bits to the fp32 pattern, truncate.

bf16 keeps the top 16 bits of an fp32 number. Adding a uniform integer u in [0, 2^16) to the bit
pattern and clearing the low 16 bits rounds the magnitude up with probability (low bits) / 2^16 and
down otherwise, so E[round(x)] = x: the two neighbours are weighted by distance. The float format is
sign-magnitude, so the same holds for negative numbers (the magnitude bits grow, the sign stays).
Non-finite inputs pass through unchanged; a finite value within one bf16 step of the largest one can
round up to infinity, as with any rounding upward.
"""

from __future__ import annotations

import torch

_LOW16 = 0xFFFF
_HIGH16 = -65536  # 0xFFFF0000 as a signed int32


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 ``x`` -> bf16, unbiased. ``generator`` (CPU) makes the noise reproducible."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 expects float32, got {x.dtype}")
    x = x.contiguous()
    bits = x.view(torch.int32)
    noise = torch.randint(0, _LOW16 + 1, x.shape, dtype=torch.int32, generator=generator,
                          device="cpu").to(x.device)
    rounded = torch.bitwise_and(bits + noise, _HIGH16).view(torch.float32)
    rounded = torch.where(torch.isfinite(x), rounded, x)
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero


def round_bf16(x: torch.Tensor, stochastic: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    return stochastic_round_bf16(x, generator) if stochastic else x.to(torch.bfloat16)
