"""The activation rounding V4 runs at inference (``model/quant.py``), as kernels (Triton).

``kv_round``: a KV row's non-RoPE dims rounded to e4m3 on a power-of-two scale a 64 dims (the last
block narrower), the RoPE dims passed through - ``ops.quantized.fp8_round``'s composition is ~7
kernels a block (8 blocks at V4's width) and a concatenation; this is one, with its bits: the
block's amax, the clamp and the division by 448 in the row's dtype (``div_rn``, then rounded to the
dtype as a half-precision tensor op rounds it), the power of two read off the quotient's bits, and
e4m3's round-to-nearest-even done in fp32 arithmetic (``round_e4m3``), so no conversion rounds.

``fp4_round``: the same for the indexer's queries and keys after their Hadamard rotation - e2m1 on a
power-of-two scale a 32 dims (``quantized.fp4_round``, whose nearest-code search is ~15 kernels a
block), ties to even and the saturation at 6 as there.
"""

import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import launch, next_pow2


@triton.jit
def round_e4m3(v):
    """``|v|`` (fp32, |v| <= 448) rounded to e4m3's grid, ties to even, in fp32 - so the conversion that
    follows is exact whatever rounding it does: one fp32 addition of ``2^(E + 20)`` (E: |v|'s exponent,
    at least e4m3's smallest normal, -6) leaves a multiple of ``2^(E - 3)``, three mantissa bits."""
    a = tl.abs(v)
    E = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    big = ((E + 147) << 23).to(tl.float32, bitcast=True)
    return (a + big) - big


@triton.jit
def e4m3_byte(v):
    """``v``'s e4m3 code (ties to even) as a byte: the magnitude's code, the sign bit set from ``v``'s
    own (so -0.0 and a negative value that rounds to zero keep it, as a cast does)."""
    mag = round_e4m3(v).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return mag | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)


@triton.jit
def round_e2m1(a):
    """``a`` (fp32, >= 0) rounded to e2m1's magnitudes (0, 0.5 ... 4, 6), ties to even, saturating at 6:
    one fp32 addition of ``2^(E + 22)`` (E: a's exponent, at least 0) leaves a multiple of ``2^(E - 1)``."""
    E = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, 0)
    big = ((E + 149) << 23).to(tl.float32, bitcast=True)
    return tl.minimum((a + big) - big, 6.0)


@triton.jit
def to_dtype_grid(q, dt: tl.constexpr):
    """fp32 ``q`` rounded (to nearest, ties to even) to the half dtype ``dt`` and widened back, as a
    tensor op of that dtype rounds its result; bf16 in integer arithmetic (a cast in Triton's
    interpreter truncates)."""
    if dt == tl.bfloat16:
        b = q.to(tl.int32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    elif dt == tl.float16:
        return q.to(tl.float16).to(tl.float32)
    else:
        return q


@triton.jit
def pow2_ceil_exp(q):
    """The biased exponent of the smallest power of two >= ``q`` (fp32, > 0), at least 1."""
    b = q.to(tl.int32, bitcast=True)
    return tl.maximum(((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).to(tl.int32), 1)


@triton.jit
def round_rows_kernel(X, Y, s_x, s_y, NOPE, D, lo, BLK: tl.constexpr, NB: tl.constexpr, FP4: tl.constexpr):
    """Row ``n`` of ``X [N, D]``: dims below ``NOPE`` rounded in blocks of BLK (NB blocks cover them) to
    e4m3 (``FP4``: e2m1), the rest copied, into row ``n`` of ``Y``."""
    pdl_enter()
    n = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NB)[:, None] * BLK + tl.arange(0, BLK)[None, :]  # [NB, BLK]
    x = tl.load(X + n * s_x + i, mask=i < D, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    nope = i < NOPE
    amax = tl.max(tl.where(nope, tl.abs(xf), 0.0), 1)
    amax = tl.maximum(amax, lo)  # the clamp: ``lo`` in the row's dtype
    q = to_dtype_grid(tl.div_rn(amax, tl.full(amax.shape, 6.0 if FP4 else 448.0, tl.float32)), dt)
    e = pow2_ceil_exp(q)
    s = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    if FP4:
        r = round_e2m1(tl.abs(xf * inv[:, None]))
    else:
        r = round_e4m3(xf * inv[:, None])  # |.|, then the sign bit of x (a negation would be 0 - r: -0.0 lost)
    sign = xf.to(tl.int32, bitcast=True) & -2147483648
    r = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True) * s[:, None]
    tl.store(Y + n * s_y + i, tl.where(nope, r.to(dt), x), mask=i < D)


_LO: dict = {}  # (format, dtype) -> the clamp's floor as the dtype holds it (made once: no host op a call)


def _round_rows(x, nope: int, block: int, fp4: bool):
    import torch

    D = x.shape[-1]
    rows = x.reshape(-1, D)
    y = torch.empty_like(rows)
    if rows.shape[0]:
        blk = block if nope > block else next_pow2(nope)  # a narrower row is one block
        lo = _LO.get((fp4, x.dtype))
        if lo is None:
            lo = _LO[fp4, x.dtype] = float(torch.tensor(6.0 * 2.0 ** -126 if fp4 else 1e-4, dtype=x.dtype))
        launch(round_rows_kernel, (rows.shape[0],), rows, y, rows.stride(0), y.stride(0), nope, D, lo, BLK=blk,
               NB=next_pow2(-(-D // blk)), FP4=fp4, num_warps=2)
    return y.view(x.shape)


def kv_round(kv, rope_dims: int, block: int):
    """``ops.fused.kv_round`` on CUDA: rows ``kv [..., D]`` (contiguous) -> a new tensor."""
    return _round_rows(kv, kv.shape[-1] - rope_dims, block, False)


def fp4_round(x, block: int):
    """``ops.fused.fp4_round`` on CUDA: rows ``x [..., D]`` (contiguous) -> a new tensor."""
    return _round_rows(x, x.shape[-1], block, True)


def builds() -> dict:
    """name -> (jit function, signature, constexprs) for the ahead-of-time Hopper build check (a
    V4-Flash KV row: 448 non-RoPE dims in blocks of 64, 64 RoPE dims)."""
    sig = dict(X="*bf16", Y="*bf16", s_x="i32", s_y="i32", NOPE="i32", D="i32", lo="fp32")
    return {"kv_round": (round_rows_kernel, sig, dict(BLK=64, NB=8, FP4=False)),
            "fp4_round": (round_rows_kernel, sig, dict(BLK=32, NB=4, FP4=True))}
