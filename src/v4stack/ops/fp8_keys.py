"""Indexer keys in V4's cache format: e4m3 codes with a power-of-two scale per 32 dims.

A key of ``d`` dims is one row of ``d + ceil(d / 32)`` bytes: the ``d`` e4m3 codes, then one e8m0
exponent byte per block of 32 dims (the last block narrower where ``d`` is not a multiple of 32,
as the activation rounding cuts them; ``model/quant.py``). At V4's width (128) that is 132 bytes
a key against 256 in bf16 - the size of the report's indexer keys.

A block's scale is ``2^ceil(log2(amax / 448))`` (1 for an all-zero block; exponents kept in
``[-126, 127]``). Keys that V4's activation rounding produced (Hadamard, then FP4 e2m1 on a
power-of-two scale per 32 dims) are held exactly: such a block's values are e2m1 codes times its
FP4 scale, at most 6 of that scale, so divided by this block's scale they are at most 384 and
keep their two significant bits, which e4m3 represents. ``unpack`` then gives the stored keys
back bit for bit, and everything computed from them is what the half-precision pool gives. Other
keys round to e4m3 (the engine stores keys so only where the model runs V4's rounding).
"""

from __future__ import annotations

import math

import torch

from v4stack.ops.quantized import FP8_MAX, pow2_ceil

BLOCK = 32


def blocks(d: int) -> int:
    return math.ceil(d / BLOCK)


def width(d: int) -> int:
    """Bytes of one packed key of ``d`` dims."""
    return d + blocks(d)


def is_packed(keys: torch.Tensor) -> bool:
    return keys.dtype == torch.uint8


def dims(keys: torch.Tensor) -> int:
    """The key width ``d`` of a pool, packed or not."""
    if not is_packed(keys):
        return keys.shape[-1]
    w = keys.shape[-1]
    d = w - math.ceil(w / (BLOCK + 1))
    if width(d) != w:
        raise ValueError(f"a packed key row of {w} bytes fits no key width")
    return d


def _split(x: torch.Tensor) -> list[torch.Tensor]:
    return [x[..., i : i + BLOCK] for i in range(0, x.shape[-1], BLOCK)]


def pack(keys: torch.Tensor) -> torch.Tensor:
    """Keys ``[..., d]`` (any float dtype) -> packed rows ``[..., width(d)]`` uint8."""
    x = keys.float()
    codes, exps = [], []
    for b in _split(x):
        amax = b.abs().amax(-1, keepdim=True)
        s = torch.where(amax > 0, pow2_ceil(amax.clamp(min=2.0 ** -140) / FP8_MAX), torch.ones_like(amax))
        s = s.clamp(2.0 ** -126, 2.0 ** 127)
        codes.append((b / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8))
        exps.append((torch.frexp(s)[1] - 1 + 127).to(torch.uint8))  # s = 2^(byte - 127)
    return torch.cat(codes + exps, dim=-1)


def scales(packed: torch.Tensor) -> torch.Tensor:
    """Each block's scale ``[..., blocks]`` as float32."""
    d = dims(packed)
    e = packed[..., d:].to(torch.int32) - 127
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=packed.device), e)


def unpack(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows ``[..., width(d)]`` -> keys ``[..., d]`` in ``dtype``: codes times their block's
    scale, in float32 (exact), then cast."""
    d = dims(packed)
    vals = packed[..., :d].contiguous().view(torch.float8_e4m3fn).float()
    s = scales(packed).repeat_interleave(BLOCK, dim=-1)[..., :d]
    return (vals * s).to(dtype)
