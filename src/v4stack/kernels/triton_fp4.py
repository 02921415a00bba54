"""FP4 (e2m1, 1 x 32 block-scaled) expert GEMM (Triton): weights stay packed in memory.

Weights as V4 stores its routed experts (``ops/quantized.py``): two e2m1 codes per byte
``[E, N, K/2]`` (low nibble = even column) and one scale per 32 columns ``[E, N, K/32]``. Each
program owns one (expert row tile, N tile) - the tile table of the grouped GEMM, built on the
device without a host sync - and walks K one 32-column scale block at a time: it decodes the
block's 16 bytes per weight row in registers (code -> value from the bit fields; exact in bf16,
e2m1 has two significant bits), runs two tensor-core MMAs (even columns against the low
nibbles, odd against the high: no interleaving shuffle), and adds the block's partial times its
power-of-two scale into fp32. So the result is ``x @ dequant(w).T`` up to fp32 summation order;
the weight bytes read are a quarter of bf16's.
"""

import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import launch


@triton.jit
def _e2m1(code):
    """e2m1 code (int32, 0..15) -> float32: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    mag = code & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    p2 = (1 << tl.maximum(e - 1, 0)).to(tl.float32)
    val = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * p2)
    return tl.where(code >= 8, -val, val)


@triton.jit
def fp4_grouped_kernel(X, Wp, Sc, Y, TileE, TileR0, Off, N, K, s_xm, s_we, s_wn, s_se, s_sn, s_ym,
                       BM: tl.constexpr, BN: tl.constexpr):
    pdl_enter()
    p = tl.program_id(0)
    e = tl.load(TileE + p)
    if e >= 0:
        r0 = tl.load(TileR0 + p)
        r1 = tl.load(Off + e + 1)
        rows = (r0 + tl.arange(0, BM)).to(tl.int64)
        rmask = rows < r1
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cmask = cols < N
        W = Wp + e.to(tl.int64) * s_we
        S = Sc + e.to(tl.int64) * s_se
        j = tl.arange(0, 16)  # byte j of a 32-column block holds columns 2j (low) and 2j + 1 (high)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, 32):
            pk = tl.load(W + cols[:, None] * s_wn + (k0 // 2 + j)[None, :], mask=cmask[:, None], other=0)
            pk = pk.to(tl.int32) & 0xFF
            xe = tl.load(X + rows[:, None] * s_xm + (k0 + 2 * j)[None, :], mask=rmask[:, None], other=0.0)
            xo = tl.load(X + rows[:, None] * s_xm + (k0 + 2 * j + 1)[None, :], mask=rmask[:, None], other=0.0)
            part = tl.dot(xe, tl.trans(_e2m1(pk & 15).to(xe.dtype)))
            part = tl.dot(xo, tl.trans(_e2m1(pk >> 4).to(xo.dtype)), part)
            sc = tl.load(S + cols * s_sn + k0 // 32, mask=cmask, other=0.0)
            acc += part * sc[None, :]  # the block's scale (a power of two) on its partial
        tl.store(Y + rows[:, None] * s_ym + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


def scale_f32(scale):
    """Block scales as float32 (e8m0 bytes are 2^(byte - 127), exact)."""
    import torch

    if scale.dtype == torch.float8_e8m0fnu:
        e = scale.view(torch.uint8).to(torch.int32)
        return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127)
    return scale.float().contiguous()


def accepts(x, packed, scale) -> bool:
    """The kernel's shape contract: half-precision rows, K a multiple of 32, scales per 32 columns."""
    import torch

    K = x.shape[-1]
    return (x.dtype in (torch.bfloat16, torch.float16) and packed.dtype in (torch.int8, torch.uint8)
            and K % 32 == 0 and packed.shape[-1] * 2 == K and scale.shape[-1] * 32 == K
            and packed.shape[:-1] == scale.shape[:-1])


def grouped_fp4_linear(x, packed, scale, offsets):
    """Rows ``offsets[e]:offsets[e+1]`` of ``x [T, K]`` times ``dequant(packed[e], scale[e]).T``
    -> ``[T, N]`` in ``x``'s dtype (fp32 accumulation). ``packed [E, N, K/2]`` int8, ``scale
    [E, N, K/32]`` (e8m0 or fp32)."""
    import torch

    T, K = x.shape
    E, N, _ = packed.shape
    if not accepts(x, packed, scale):
        raise ValueError(f"grouped_fp4_linear: unsupported shapes x {tuple(x.shape)} {x.dtype}, packed "
                         f"{tuple(packed.shape)} {packed.dtype}, scale {tuple(scale.shape)}")
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    bm = 16 if T <= 256 else 64
    off = offsets.to(device=x.device, dtype=torch.int64)
    tiles = (off[1:] - off[:-1] + bm - 1) // bm
    first = torch.cumsum(tiles, 0) - tiles
    P = triton.cdiv(T, bm) + E  # a bound on the tile count known without a sync
    pid = torch.arange(P, device=x.device)
    e = torch.searchsorted(first + tiles, pid, right=True)
    ec = e.clamp(max=E - 1)
    r0 = off[ec] + (pid - first[ec]) * bm
    tile_e = torch.where(e < E, ec, -1).to(torch.int32)
    xc, wp, sc = x.contiguous(), packed.contiguous(), scale_f32(scale).contiguous()
    BN = 32 if T <= 64 else 64  # small batches: more programs over N
    launch(fp4_grouped_kernel, (P, triton.cdiv(N, BN)), xc, wp, sc, y, tile_e, r0, off, N, K, xc.stride(0),
           wp.stride(0), wp.stride(1), sc.stride(0), sc.stride(1), y.stride(0), BM=bm, BN=BN, num_warps=4)
    return y


def fp4_linear(x, qw):
    """``ops.linear`` for a ``QuantizedWeight`` in fp4: the grouped kernel with one group."""
    import torch

    K = x.shape[-1]
    a = x.reshape(-1, K)
    sc = getattr(qw, "_scale_f32", None)
    if sc is None:
        sc = qw._scale_f32 = scale_f32(qw.scale)
    off = torch.tensor([0, a.shape[0]], device=x.device)
    y = grouped_fp4_linear(a, qw.data.unsqueeze(0), sc.unsqueeze(0), off)
    return y.view(*x.shape[:-1], qw.data.shape[0])
