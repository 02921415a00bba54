"""FP8 (e4m3) dispatch with one fp32 scale per 128 channels of a row.

``quantize_rows`` maps each 128-wide block to ``[-448, 448]`` by its absolute maximum;
``dequantize_rows`` gives back fp32. Both are deterministic and per row, so a row dequantized
on the expert's rank equals the same row dequantized anywhere else.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
BLOCK = 128
E4M3_MAX = 448.0


def n_scales(hidden: int) -> int:
    return (hidden + BLOCK - 1) // BLOCK


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, h]`` -> (``q [N, h]`` e4m3, ``scales [N, ceil(h/128)]`` fp32)."""
    n, h = x.shape
    nb = n_scales(h)
    xf = torch.zeros(n, nb * BLOCK, dtype=torch.float32, device=x.device)
    xf[:, :h] = x.float()
    blocks = xf.view(n, nb, BLOCK)
    amax = blocks.abs().amax(-1)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scales.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.view(n, nb * BLOCK)[:, :h].contiguous(), scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, h = q.shape
    nb = scales.shape[1]
    xf = torch.zeros(n, nb * BLOCK, dtype=torch.float32, device=q.device)
    xf[:, :h] = q.float()
    return (xf.view(n, nb, BLOCK) * scales.unsqueeze(-1)).view(n, nb * BLOCK)[:, :h]


def pack_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [N, h]`` -> bytes ``[N, h + 4 * ceil(h/128)]``: the e4m3 row, then its fp32 scales."""
    q, s = quantize_rows(x)
    return torch.cat([q.view(torch.uint8), s.view(torch.uint8).view(x.shape[0], -1)], 1)


def unpack_rows(b: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``pack_rows``, dequantized and rounded to ``dtype`` (what the experts read)."""
    q = b[:, :hidden].contiguous().view(FP8)
    s = b[:, hidden:].contiguous().view(torch.float32)
    return dequantize_rows(q, s).to(dtype)
