"""Grouped (per-expert) GEMM with its tile table computed in the kernel (Triton).

Rows are sorted by expert (``offsets [E + 1]``, on the device). Expert ``e`` owns
``ceil(n_e / BM)`` row tiles; tile ids run expert after expert. Program ``p`` finds its tile
itself: it loads the ``E + 1`` offsets, counts every expert's tiles, takes their running sum
(``tl.cumsum``, exact integers) and picks the expert whose range holds ``p`` - so a call is one
launch and no host sync, whatever the routing. ``min(E, T) + T // BM`` programs along the first
grid axis bound the tile count (``ceil(n / BM) <= n // BM + 1`` for each of at most ``min(E, T)``
non-empty experts); programs past the last tile exit.

The K chain of an output element is ``triton_gemm._mm_tile``'s (the same MMA steps in K order
from a zero start), so bits do not depend on the tile shape bucket or on which program runs it.
"""

import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import cdiv, launch, next_pow2
from v4stack.kernels.tiles import GRAPH_ROWS, GROUPED_FALLBACK, GROUPED_TILES, GROUPED_TILES_GRAPH, pick_call
from v4stack.kernels.triton_gemm import _mm_tile


@triton.jit
def grouped_table_kernel(X, W, Y, Off, E, N, K, s_xm, s_we, s_wn, s_ym, EB: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    pdl_enter()
    p = tl.program_id(0)
    e = tl.arange(0, EB)
    lo = tl.load(Off + e, mask=e < E, other=0)
    hi = tl.load(Off + e + 1, mask=e < E, other=0)
    tiles = (hi - lo + BM - 1) // BM
    ends = tl.cumsum(tiles, 0)  # tile id one past each expert's last tile
    mine = tl.sum((ends <= p).to(tl.int32), 0)  # experts wholly before tile p: p's expert
    if mine < E:
        sel = e == mine
        first = tl.sum(tl.where(sel, ends - tiles, 0), 0)
        r0 = tl.sum(tl.where(sel, lo, 0), 0) + (p - first) * BM
        r1 = tl.sum(tl.where(sel, hi, 0), 0)
        rows = (r0 + tl.arange(0, BM)).to(tl.int64)
        rmask = rows < r1
        acc, cols = _mm_tile(X, W + mine.to(tl.int64) * s_we, rows, rmask, tl.program_id(1) * BN, s_xm, s_wn, N, K,
                             BN, BK, IEEE, BM)
        tl.store(Y + rows[:, None] * s_ym + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=rmask[:, None] & (cols < N)[None, :])


def grouped_linear(x, w, offsets, tile=None):
    """``ops.grouped_linear`` on CUDA: one launch, the tile table computed by each program (the
    persistent TMA kernel, ``triton_grouped_tma``, where the tile asks for it and its terms hold)."""
    import torch

    T, K = x.shape
    E, N, _ = w.shape
    # by rows per expert (graph-captured calls up to the rows the serving sweep measured - the engine's
    # decode steps - by their own table): every tile gives a row the same bits
    t = tile or pick_call(GROUPED_TILES, GROUPED_TILES_GRAPH, cdiv(T, E), x.is_cuda, T,
                          GRAPH_ROWS.get("GROUPED_TILES_GRAPH", 0))
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    off = offsets if offsets.dtype == torch.int64 else offsets.to(torch.int64)
    xc = x if x.is_contiguous() else x.contiguous()
    wc = w if w.is_contiguous() else w.contiguous()
    if t.get("tma", False):
        from v4stack.kernels import triton_grouped_tma as tma

        if tma.usable(xc, wc):
            return tma.grouped_linear_tma(xc, wc, off, y, t)
        t = GROUPED_FALLBACK  # its rows' bits are the TMA tiles' (the sweep checks)
    bm = t["BM"]
    grid = (min(E, T) + T // bm, cdiv(N, t["BN"]))
    launch(grouped_table_kernel, grid, xc, wc, y, off, E, N, K, xc.stride(0), wc.stride(0), wc.stride(1), y.stride(0),
           EB=max(16, next_pow2(E)), BM=bm, BN=t["BN"], BK=t["BK"], IEEE=x.dtype == torch.float32,
           num_warps=t["num_warps"], num_stages=t["num_stages"])
    return y
