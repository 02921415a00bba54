"""Fixed-tile GEMMs (Triton): grouped expert GEMM, fp32 GEMM, block-scaled FP8 GEMM.

Invariant by construction: the tile shape is a constant of the kernel (never chosen from M or
from how many rows an expert got), each output tile is written by exactly one program, and
its K loop runs the ``BK``-wide slices in order with no split-K, accumulating in fp32. A row's
result therefore depends on its own inputs only. fp32 inputs use ``input_precision="ieee"``
(FMA on the CUDA cores: no TF32 rounding).
"""

import triton
import triton.language as tl

GROUPED_TILE = dict(BM=64, BN=128, BK=64)
F32_TILE = dict(BM=32, BN=64, BK=32)


@triton.jit
def _mm_tile(X, W, rows, rmask, n0, s_xm, s_wn, N, K, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
             BM: tl.constexpr):
    cols = n0 + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kmask = (k0 + kk) < K
        a = tl.load(X + rows[:, None] * s_xm + (k0 + kk)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(W + cols[None, :] * s_wn + (k0 + kk)[:, None], mask=(cols < N)[None, :] & kmask[:, None],
                    other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc, cols


@triton.jit
def grouped_kernel(X, W, Y, TileE, TileR0, Off, N, K, s_xm, s_we, s_wn, s_ym,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    p = tl.program_id(0)
    e = tl.load(TileE + p)
    if e >= 0:
        r0 = tl.load(TileR0 + p)
        r1 = tl.load(Off + e + 1)
        rows = r0 + tl.arange(0, BM)
        rmask = rows < r1
        acc, cols = _mm_tile(X, W + e.to(tl.int64) * s_we, rows.to(tl.int64), rmask, tl.program_id(1) * BN, s_xm,
                             s_wn, N, K, BN, BK, IEEE, BM)
        tl.store(Y + rows.to(tl.int64)[:, None] * s_ym + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=rmask[:, None] & (cols < N)[None, :])


def grouped_linear(x, w, offsets):
    """``ops.grouped_linear`` on CUDA: one program per (expert row tile, N tile), no host sync."""
    import torch

    T, K = x.shape
    E, N, _ = w.shape
    bm = GROUPED_TILE["BM"]
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    off = offsets.to(device=x.device, dtype=torch.int64)
    tiles = (off[1:] - off[:-1] + bm - 1) // bm  # row tiles per expert
    first = torch.cumsum(tiles, 0) - tiles  # first tile id of each expert
    P = triton.cdiv(T, bm) + E  # an upper bound on the tile count, known without a sync
    pid = torch.arange(P, device=x.device)
    e = torch.searchsorted(first + tiles, pid, right=True)  # expert of tile pid (E: past the end)
    ec = e.clamp(max=E - 1)
    valid = e < E
    r0 = off[ec] + (pid - first[ec]) * bm
    tile_e = torch.where(valid, ec, -1).to(torch.int32)
    xc, wc = x.contiguous(), w.contiguous()
    grid = (P, triton.cdiv(N, GROUPED_TILE["BN"]))
    grouped_kernel[grid](xc, wc, y, tile_e, r0, off, N, K, xc.stride(0), wc.stride(0), wc.stride(1), y.stride(0),
                         BM=bm, BN=GROUPED_TILE["BN"], BK=GROUPED_TILE["BK"], IEEE=x.dtype == torch.float32)
    return y
