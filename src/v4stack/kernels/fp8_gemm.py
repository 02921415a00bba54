"""V4's block-scaled FP8 weight format: e4m3 values, one fp32 factor per 128 x 128 block."""

import torch

BLOCK = 128


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``weight [N, K]`` (float8_e4m3fn) times its block factors ``scale [ceil(N/128), ceil(K/128)]``."""
    N, K = weight.shape
    s = scale.float().repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return (weight.float() * s).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scale ``w [N, K]`` into (e4m3 weight, fp32 scales) with each block's max at 448."""
    N, K = w.shape
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    pad = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    pad[:N, :K] = w.float()
    blocks = pad.view(nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(nb * BLOCK, kb * BLOCK)[:N, :K].contiguous(), scale
