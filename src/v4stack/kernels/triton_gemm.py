"""Fixed-tile GEMMs (Triton): bf16 / fp32 GEMM and hc_mix (the fixed-K-slice kernel of
``triton_slices``, and ``triton_tma`` for many bf16 rows), indexer scores, block-scaled FP8 GEMM
(the grouped expert GEMM: ``triton_grouped``).

Invariant by construction: each output element's K-sum follows the K rule of ``triton_slices``
(fixed slices of a width that depends on the dtype alone, each an in-order MMA chain, added in
slice order). Only the M x N tile shape, and whether a tile's slices are summed in one program
or spread over the grid, follow M (small tiles and grid slices so a few rows still spread over
the SMs, large ones for throughput); neither changes an element's chain. That a row's bits are
the same in every candidate tile is checked on the GPU (``bench/gemm_tiles.py``, before timing).
"""

import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import cdiv, launch, next_pow2

from v4stack.kernels.tiles import (F32_SKINNY_N, F32_SKINNY_TILES, F32_SPLIT, F32_TILES, F32_TILES_GRAPH, FP8_BLOCK,
                                   FP8_TILES, HALF_SPLIT, HALF_TILES, HALF_TILES_GRAPH, HC_HALF_TILES,
                                   HC_HALF_TILES_GRAPH, HC_TILES, HC_TILES_GRAPH, pick, pick_call as _tile)
from v4stack.kernels.triton_slices import run


@triton.jit
def _mm_tile(X, W, rows, rmask, n0, s_xm, s_wn, N, K, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
             BM: tl.constexpr):
    """One output tile's full-K MMA chain (the grouped GEMM's, ``triton_grouped``)."""
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


def linear(x, weight, tile=None):
    """``x @ weight.T`` in fixed K slices (``triton_slices``): bf16 / fp16 on the ``wgmma`` chain,
    fp32 as 3xTF32 on the tensor cores. ``tile`` overrides the bucket's tile (the sweep,
    ``bench/gemm_tiles.py``); every tile gives the same bits."""
    import torch

    N, K = weight.shape
    flat = x.dim() == 2
    a = x if flat else x.reshape(-1, K)
    if a.stride(-1) != 1:
        a = a.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    M = a.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y.view(*x.shape[:-1], N)
    if x.dtype != torch.float32:
        t = tile or _tile(HALF_TILES, HALF_TILES_GRAPH, M, a.is_cuda)
        if t.get("tma", False) and K % 8 == 0 and N % 8 == 0 and a.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0:
            from v4stack.kernels.triton_tma import linear_tma

            linear_tma(a, w, y, BM=t["BM"], BN=t["BN"], BK=t["BK"], GROUP_M=t.get("GROUP_M", 8),
                       num_warps=t["num_warps"], num_stages=t["num_stages"], WS=t.get("WS", False), SPLIT=HALF_SPLIT,
                       GRID=t.get("grid", False), UNR=t.get("unroll", 2))
        else:
            run(a, w, y, t, HALF_SPLIT, False)
    else:
        if tile is None and N <= F32_SKINNY_N:  # the MoE gate's logits: narrow tiles (tiles.py)
            tile = pick(F32_SKINNY_TILES, M)
        run(a, w, y, tile or _tile(F32_TILES, F32_TILES_GRAPH, M, a.is_cuda), F32_SPLIT, True)
    return y if flat else y.view(*x.shape[:-1], N)


def hc_mix(flat, fn, eps, tile=None, finish=None):
    """mHC projection ``(flat @ fn.T) * (1 / sqrt(mean(flat^2) + eps))``: 3xTF32 in the fixed fp32
    K slices (``flat`` fp32, or any float dtype read and widened in the kernel: ``hc_pre``).
    ``finish(p, pss, S, y, M, K)``: ``triton_slices.run``'s; then ``(y, what it returned or None)``."""
    import torch

    N, K = fn.shape
    x = flat.reshape(-1, K)
    if x.stride(-1) != 1:
        x = x.contiguous()
    M = x.shape[0]
    y = torch.empty(M, N, dtype=torch.float32, device=flat.device)
    if M:
        tables = (HC_TILES, HC_TILES_GRAPH) if x.dtype == torch.float32 else (HC_HALF_TILES, HC_HALF_TILES_GRAPH)
        t = dict(tile or _tile(*tables, M, x.is_cuda), BN=max(16, next_pow2(N)))
        done = run(x, fn.contiguous(), y, t, F32_SPLIT, True, rms_eps=eps,
                   finish=None if finish is None else lambda p, pss, S: finish(p, pss, S, y, M, K))
        if finish is not None:
            return y, done
    if finish is not None:
        return y, None
    return y.view(*flat.shape[:-1], N)


@triton.jit
def _indexer_score(q, k, w, IEEE: tl.constexpr):
    if IEEE:
        dots = tl.dot(q, k, input_precision="ieee")
    else:
        dots = tl.dot(q, k)
    return tl.sum(tl.maximum(dots, 0.0) * w[:, None], 0)


@triton.jit
def indexer_query(Q, Wt, t, H, s_qt, s_qh, s_wt, D: tl.constexpr, BH: tl.constexpr):
    """Query ``t``'s heads ``[BH, D]`` (zero past ``H``) and their weights, widened to fp32."""
    h = tl.arange(0, BH)
    d = tl.arange(0, D)
    q = tl.load(Q + t * s_qt + h[:, None] * s_qh + d[None, :], mask=(h < H)[:, None], other=0.0)
    return q, tl.load(Wt + t * s_wt + h, mask=h < H, other=0.0).to(tl.float32)


@triton.jit
def fp8_key_tile(Kc, r, ok, s_ks, d, D: tl.constexpr, dtype: tl.constexpr):
    """Keys ``[D, BS]`` of pool rows ``r`` in V4's packed form (``ops/fp8_keys.py``: D e4m3 codes,
    then an exponent byte a 32 dims), in ``dtype``: each code times its block's scale ``2^(byte -
    127)`` - exact for a key the cache holds exactly (a row not ``ok`` reads as zeros)."""
    NB: tl.constexpr = (D + 31) // 32
    BLK: tl.constexpr = D // NB
    row = Kc + r[None, :] * s_ks
    code = tl.load(row + d[:, None], mask=ok[None, :], other=0)
    e = tl.load(row + D + tl.arange(0, NB)[:, None], mask=ok[None, :], other=127)  # [NB, BS]
    scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], [NB, BLK, r.shape[0]]), [D, r.shape[0]])
    return (code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale).to(dtype)


@triton.jit
def indexer_kernel(Q, Wt, Kc, Rows, Y, S, H, NK, s_qt, s_qh, s_wt, s_kt, s_ks, s_rt, s_yt, D: tl.constexpr,
                   BH: tl.constexpr, BS: tl.constexpr, IEEE: tl.constexpr, INDEXED: tl.constexpr,
                   CH: tl.constexpr = 1, FP8: tl.constexpr = False):
    """A program scores ``CH`` chunks of ``BS`` keys of one query (the query and its weights loaded once).
    ``FP8``: the pool holds V4's packed keys, widened exactly to the query's dtype before the same MMA."""
    pdl_enter()
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    q, w = indexer_query(Q, Wt, t, H, s_qt, s_qh, s_wt, D, BH)
    for c in range(CH):
        s = (tl.program_id(1) * CH + c) * BS + tl.arange(0, BS)
        if INDEXED:  # key rows of the pool by index: -1 (or any row outside [0, NK)) is no entry
            r = tl.load(Rows + t * s_rt + s, mask=s < S, other=-1).to(tl.int64)
            ok = (r >= 0) & (r < NK)
            score = tl.full([BS], float("-inf"), tl.float32)
            if tl.sum(ok.to(tl.int32), 0) > 0:  # a chunk with no entry (a table's padding) reads no key
                if FP8:
                    k = fp8_key_tile(Kc, r, ok, s_ks, d, D, q.dtype)
                else:
                    k = tl.load(Kc + r[None, :] * s_ks + d[:, None], mask=ok[None, :], other=0.0)
                score = tl.where(ok, _indexer_score(q, k, w, IEEE), float("-inf"))
        else:
            ok = s < S
            k = tl.load(Kc + t * s_kt + s[None, :].to(tl.int64) * s_ks + d[:, None], mask=ok[None, :], other=0.0)
            score = _indexer_score(q, k, w, IEEE)
        tl.store(Y + t * s_yt + s, score.to(Y.dtype.element_ty), mask=s < S)


INDEXER_BS = 64  # keys per chunk
# half-precision launches: (keys a chunk, chunks a program, warps, stages); bench/results/indexer_h200.json
# (128 keys: 96 / 28 us against 116 / 34 for 64 at 256 / 64 queries of 4096 entries); two chunks a program:
# 98.3 / 99.1 / 28.6 us against one's 102.5 / 104.7 / 29.9 on an H200 (256 queries of 4096, 256 of a 16k
# step's 4608-wide table, 64 of 4096; bench/results/indexer_select_h200_b171000.json), 109.4 / 108.7 /
# 31.6 against 109.2 / 110.7 / 32.0 on an H100 (indexer_select_h100.json); the same bits (specs.py proves it)
INDEXER_TILE = {"BS": 128, "CH": 2, "num_warps": 4, "num_stages": 3}


def indexer_scores(q, w, k, rows=None, tile=None):
    """``I[t, s] = sum_h w[t, h] relu(q[t, h] . k[s])``: one program per (query, 64 keys). Keys are
    shared ``[S, d]``, per row ``[T, S, d]``, or read by index from a pool ``k [N, d]`` with
    ``rows [T, S]`` (``-1``: no entry, scored ``-inf``; nothing is gathered). One arithmetic for all
    three (a row stride of 0 for shared keys; the same MMA on the same key values when indexed), so
    a query gets the same bits whichever form its step passes. A pool may hold V4's packed e4m3
    keys (uint8 rows, ``ops/fp8_keys.py``): the same bits as the pool of their unpacked values."""
    import torch

    T, H, D = q.shape
    S = k.shape[-2] if rows is None else rows.shape[1]
    out = torch.empty(T, S, dtype=torch.promote_types(q.dtype, w.dtype), device=q.device)
    if T and S:
        qc, wc, kc = q.contiguous(), w.contiguous(), k.contiguous()
        if rows is None:
            rc, s_rt, s_kt = qc, 0, (kc.stride(0) if kc.dim() == 3 else 0)
        else:
            rc = rows.contiguous()
            s_rt, s_kt = rc.stride(0), 0
        ieee = q.dtype == torch.float32
        t = tile or ({"BS": INDEXER_BS, "CH": 1} if ieee else INDEXER_TILE)
        opts = {k_: t[k_] for k_ in ("num_warps", "num_stages") if k_ in t}
        launch(indexer_kernel, (T, cdiv(S, t["BS"] * t["CH"])), qc, wc, kc, rc, out, S, H, kc.shape[0], qc.stride(0),
               qc.stride(1), wc.stride(0), s_kt, kc.stride(-2), s_rt, out.stride(0), D=D,
               BH=max(16, next_pow2(H)), BS=t["BS"], IEEE=ieee, INDEXED=rows is not None, CH=t["CH"],
               FP8=kc.dtype == torch.uint8, **opts)
    return out


def indexer_scores_rows(q, w, pool, rows):
    """``ops.indexer_scores(q, w, pool, rows=rows)`` on CUDA: keys read by index from the pool."""
    return indexer_scores(q, w, pool, rows)


@triton.jit
def fp8_kernel(X, W, Sc, Y, M, N, K, s_xm, s_wn, s_sn, s_ym, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               SB: tl.constexpr):
    pdl_enter()
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    n0 = tl.program_id(1) * BN
    cols = n0 + tl.arange(0, BN)
    rmask = rows < M
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kmask = (k0 + kk) < K
        a = tl.load(X + rows[:, None] * s_xm + (k0 + kk)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(W + cols[None, :] * s_wn + (k0 + kk)[:, None], mask=(cols < N)[None, :] & kmask[:, None],
                    other=0.0)
        sc = tl.load(Sc + (n0 // SB) * s_sn + k0 // SB)  # BN divides SB, BK == SB: one block per slice
        acc += tl.dot(a, b.to(a.dtype)) * sc
    tl.store(Y + rows[:, None] * s_ym + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=rmask[:, None] & (cols < N)[None, :])


def fp8_linear(x, weight, scale):
    """``x @ dequant(weight).T`` for an e4m3 weight with one fp32 scale per 128 x 128 block: each
    128-wide K slice's MMA partial (weights widened to x's dtype, exact for e4m3) is scaled by its
    block factor and added in order."""
    import torch

    N, K = weight.shape
    a = x.reshape(-1, K).contiguous()
    M = a.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        sc = scale.float().contiguous()
        t = pick(FP8_TILES, M)
        launch(fp8_kernel, (cdiv(M, t["BM"]), cdiv(N, t["BN"])), a, weight, sc, y, M, N, K, a.stride(0),
               weight.stride(0), sc.stride(0), y.stride(0), BM=t["BM"], BN=t["BN"], BK=FP8_BLOCK, SB=FP8_BLOCK)
    return y.view(*x.shape[:-1], N)
