"""Interleaved (GPT-J style) rotary embedding on the last ``r`` dims, with YaRN.

SWA-only layers use ``rope_theta`` without scaling; compressed layers (CSA / HCA, their
compressors and indexers) use ``compress_rope_theta`` with YaRN frequency interpolation (no
attention-scale correction).
"""

from __future__ import annotations

import math

import torch

from v4stack.ops import fused
from v4stack.config import ModelConfig


def _correction_dim(n_rot: float, dim: int, base: float, orig_len: int) -> float:
    return dim * math.log(orig_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))


def rope_frequencies(cfg: ModelConfig, compressed: bool, dim: int | None = None) -> torch.Tensor:
    """Angular frequency of each of the ``dim/2`` rotated pairs (float64, CPU)."""
    dim = dim or cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if compressed:
        rs = cfg.rope_scaling
        low = max(math.floor(_correction_dim(rs.beta_fast, dim, base, rs.original_max_position_embeddings)), 0)
        high = min(math.ceil(_correction_dim(rs.beta_slow, dim, base, rs.original_max_position_embeddings)), dim - 1)
        if high == low:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: high-frequency pairs kept as they are; 0: fully interpolated
        freqs = freqs / rs.factor * (1 - keep) + freqs * keep
    return freqs


class Rotary:
    """Applies the rotation for given integer positions; caches nothing position-dependent."""

    def __init__(self, cfg: ModelConfig, compressed: bool):
        self.dim = cfg.qk_rope_head_dim
        self.freqs = rope_frequencies(cfg, compressed)
        self._on: dict = {}  # device -> freqs there (copied once, not per call)

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last ``dim`` channels of ``x`` (``ops.fused.rope``: one kernel on CUDA).

        ``x`` is ``[N, ..., D]`` and ``positions`` is ``[N]``; pairs are (2i, 2i+1) of the tail.
        """
        return fused.rope(x, positions, self.freqs_on(positions.device), inverse)

    def apply_(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False, table=None) -> torch.Tensor:
        """``apply`` in place (``ops.fused.rope_``: only the rotated channels are read and written),
        for a tensor nothing else reads and autograd does not record; ``table``: ``self.table``
        of these positions."""
        return fused.rope_(x, positions, self.freqs_on(positions.device), inverse, table)

    def table(self, positions: torch.Tensor) -> torch.Tensor:
        """The cosines and sines of ``positions`` (``ops.fused.rope_table``), for rotations to share."""
        return fused.rope_table(positions, self.freqs_on(positions.device))

    def freqs_on(self, device) -> torch.Tensor:
        """The frequencies (fp64) on ``device``, copied there once."""
        f = self._on.get(device)
        if f is None:
            f = self._on[device] = self.freqs.to(device)
        return f
