"""Indexer keys in V4's cache format: e4m3 codes with a power-of-two scale per 32 dims.

A key of ``d`` dims is one row of ``width(d)`` bytes: the ``d`` e4m3 codes, then one e8m0 exponent
byte per block of 32 dims (the last block narrower where ``d`` is not a multiple of 32, as the
activation rounding cuts them; ``model/quant.py``), then zeros up to a multiple of 16 bytes, so that
the codes of every row start 16-byte aligned and a kernel loads them 16 bytes at a time (at 132
bytes a row the indexer kernel could not: 255 registers with spills against 113 at 144). At V4's
width (128) that is 144 bytes a key against 256 in bf16 - the report's 132 plus alignment.

A block's scale is ``2^ceil(log2(amax / 448))`` (1 for an all-zero block; exponents kept in
``[-126, 127]``). Keys that V4's activation rounding produced (Hadamard, then FP4 e2m1 on a
power-of-two scale per 32 dims) are held exactly: such a block's values are e2m1 codes times its
FP4 scale, at most 6 of that scale, so divided by this block's scale they are at most 384 and
keep their two significant bits, which e4m3 represents. ``unpack`` then gives the stored keys
back bit for bit, and everything computed from them is what the half-precision pool gives. Other
keys round to e4m3.
"""

from __future__ import annotations

import math

import torch

from v4stack.ops.quantized import FP8_MAX, pow2_ceil

BLOCK = 32


def blocks(d: int) -> int:
    return math.ceil(d / BLOCK)


def width(d: int) -> int:
    """Bytes of one packed key of ``d`` dims (codes, exponents, zeros to a multiple of 16)."""
    return -(-(d + blocks(d)) // 16) * 16


def is_packed(keys: torch.Tensor) -> bool:
    return keys.dtype == torch.uint8


def holds(keys: torch.Tensor, d: int) -> bool:
    """Whether ``keys`` is a pool of ``d``-dim keys: packed rows of ``width(d)`` bytes, or ``d`` values."""
    return keys.shape[-1] == (width(d) if is_packed(keys) else d)


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
    d = keys.shape[-1]
    pad = x.new_zeros(*x.shape[:-1], width(d) - d - blocks(d), dtype=torch.uint8)
    return torch.cat(codes + exps + [pad], dim=-1)


def scales(packed: torch.Tensor, d: int) -> torch.Tensor:
    """Each block's scale ``[..., blocks(d)]`` as float32."""
    e = packed[..., d : d + blocks(d)].to(torch.int32) - 127
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=packed.device), e)


def unpack(packed: torch.Tensor, dtype: torch.dtype, d: int) -> torch.Tensor:
    """Packed rows ``[..., width(d)]`` -> keys ``[..., d]`` in ``dtype``: codes times their block's
    scale, in float32 (exact), then cast."""
    if packed.shape[-1] != width(d):
        raise ValueError(f"packed keys of {d} dims are rows of {width(d)} bytes, got {packed.shape[-1]}")
    vals = packed[..., :d].contiguous().view(torch.float8_e4m3fn).float()
    s = scales(packed, d).repeat_interleave(BLOCK, dim=-1)[..., :d]
    return (vals * s).to(dtype)
