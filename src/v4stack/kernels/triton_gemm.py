"""Fixed-tile GEMMs (Triton): bf16 / fp32 GEMM, hc_mix, indexer scores, block-scaled FP8 GEMM (the
grouped expert GEMM: ``triton_grouped``).

Invariant by construction: each output element is written by exactly one program, and its
K-sum is one fixed chain - bf16 / fp16: the 16-wide tensor-core MMA steps (Hopper ``wgmma``)
in K order, accumulating into fp32 registers; fp32: ``input_precision="ieee"`` (FMA on the
CUDA cores, no TF32), one FMA per k in order within fixed K slices of ``F32_SPLIT`` whose
partials are added in slice order. Only the M x N tile shape follows M (small tiles so a
few rows still spread over the SMs, large ones for throughput); it never changes an element's
chain. That a row's bits are the same in every tile shape is checked on the GPU
(``bench/ops_gpu_check.py``: rows alone, in the smallest tile, against rows in a batch of 4096).
"""

import triton
import triton.language as tl

from v4stack.kernels.launch import cdiv, launch, next_pow2

from v4stack.kernels.tiles import F32_SPLIT, F32_TILES, FP8_BLOCK, FP8_TILES, HALF_TILES, HC_TILES, pick


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
def linear_kernel(X, W, Y, M, N, K, s_xm, s_wn, s_ym, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  IEEE: tl.constexpr):
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < M
    acc, cols = _mm_tile(X, W, rows, rmask, tl.program_id(1) * BN, s_xm, s_wn, N, K, BN, BK, IEEE, BM)
    tl.store(Y + rows[:, None] * s_ym + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=rmask[:, None] & (cols < N)[None, :])


@triton.jit
def f32_slice_kernel(X, W, P, M, N, K, s_xm, s_wn, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr):
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < M
    s = tl.program_id(2)
    k0 = s * SPLIT
    kend = tl.minimum(k0 + SPLIT, K)
    acc, cols = _mm_tile(X + k0, W + k0, rows, rmask, tl.program_id(1) * BN, s_xm, s_wn, N, kend - k0, BN, BK,
                         True, BM)
    tl.store(P + (s * M + rows)[:, None] * N + cols[None, :], acc, mask=rmask[:, None] & (cols < N)[None, :])


@triton.jit
def f32_fused_kernel(X, W, Y, M, N, K, s_xm, s_wn, s_ym, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr):
    """The K slices of ``f32_slice_kernel`` in one program, each from a zero start, added in slice
    order as ``slice_sum_kernel`` adds them (``((P0 + P1) + P2) + ...``): the same bits, no partials."""
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < M
    n0 = tl.program_id(1) * BN
    total, cols = _mm_tile(X, W, rows, rmask, n0, s_xm, s_wn, N, tl.minimum(SPLIT, K), BN, BK, True, BM)
    for k0 in range(SPLIT, K, SPLIT):
        acc, cols = _mm_tile(X + k0, W + k0, rows, rmask, n0, s_xm, s_wn, N, tl.minimum(k0 + SPLIT, K) - k0, BN, BK,
                             True, BM)
        total = total + acc
    tl.store(Y + rows[:, None] * s_ym + cols[None, :], total, mask=rmask[:, None] & (cols < N)[None, :])


@triton.jit
def slice_sum_kernel(P, Y, MN, S, BLOCK: tl.constexpr):
    o = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    acc = tl.load(P + o, mask=o < MN, other=0.0)
    for s in range(1, S):
        acc += tl.load(P + s * MN + o, mask=o < MN, other=0.0)
    tl.store(Y + o, acc, mask=o < MN)


def linear(x, weight, tile=None):
    """``x @ weight.T``: bf16 / fp16 on tensor cores, fp32 as IEEE FMA in fixed K slices (``tile``
    overrides the bucket's tile: the tile sweep, ``bench/gemm_tiles.py``)."""
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
        t = tile or pick(HALF_TILES, M)
        if t.get("tma", False) and K % 8 == 0 and N % 8 == 0 and a.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0:
            from v4stack.kernels.triton_tma import linear_tma

            linear_tma(a, w, y, BM=t["BM"], BN=t["BN"], BK=t["BK"], GROUP_M=t.get("GROUP_M", 8),
                       num_warps=t["num_warps"], num_stages=t["num_stages"], WS=t.get("WS", False))
            return y if flat else y.view(*x.shape[:-1], N)
        launch(linear_kernel, (cdiv(M, t["BM"]), cdiv(N, t["BN"])), a, w, y, M, N, K, a.stride(0),
               w.stride(0), y.stride(0), BM=t["BM"], BN=t["BN"], BK=t["BK"], IEEE=False, num_warps=t["num_warps"],
               num_stages=t["num_stages"])
        return y if flat else y.view(*x.shape[:-1], N)
    t = tile or pick(F32_TILES, M)
    S = cdiv(K, F32_SPLIT)
    if t.get("fused", False):
        launch(f32_fused_kernel, (cdiv(M, t["BM"]), cdiv(N, t["BN"])), a, w, y, M, N, K, a.stride(0),
               w.stride(0), y.stride(0), SPLIT=F32_SPLIT, BM=t["BM"], BN=t["BN"], BK=t["BK"], num_warps=t["num_warps"],
               num_stages=t.get("num_stages", 3))
        return y.view(*x.shape[:-1], N)
    p = y if S == 1 else torch.empty(S, M, N, dtype=torch.float32, device=x.device)
    launch(f32_slice_kernel, (cdiv(M, t["BM"]), cdiv(N, t["BN"]), S), a, w, p, M, N, K, a.stride(0),
           w.stride(0), SPLIT=F32_SPLIT, BM=t["BM"], BN=t["BN"], BK=t["BK"], num_warps=t["num_warps"],
           num_stages=t.get("num_stages", 3))
    if S > 1:
        launch(slice_sum_kernel, (cdiv(M * N, 1024),), p, y, M * N, S, BLOCK=1024)
    return y if flat else y.view(*x.shape[:-1], N)


HC_SPLIT = 1024  # K per split of hc_mix: a constant, so a row's sum order depends on K alone


@triton.jit
def hc_mix_kernel(X, W, Pacc, Pss, M, N, K, s_xm, s_wn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  SPLIT: tl.constexpr):
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    s = tl.program_id(1)
    rmask = rows < M
    cols = tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    ss = tl.zeros([BM], tl.float32)
    for k0 in range(s * SPLIT, tl.minimum(s * SPLIT + SPLIT, K), BK):
        kmask = (k0 + kk) < K
        a = tl.load(X + rows[:, None] * s_xm + (k0 + kk)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(W + cols[None, :] * s_wn + (k0 + kk)[:, None], mask=(cols < N)[None, :] & kmask[:, None],
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
        ss += tl.sum(a * a, 1)
    base = s * M + rows
    tl.store(Pacc + base[:, None] * BN + cols[None, :], acc, mask=rmask[:, None])
    tl.store(Pss + base, ss, mask=rmask)


@triton.jit
def hc_fused_kernel(X, W, Y, M, N, K, Kf, eps, s_xm, s_wn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    SPLIT: tl.constexpr):
    """``hc_mix_kernel`` then ``hc_finish_kernel`` in one program: each SPLIT slice from a zero start,
    the slices added in order from zero as the finish kernel adds them - the same bits."""
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < M
    cols = tl.arange(0, BN)
    kk = tl.arange(0, BK)
    tot = tl.zeros([BM, BN], tl.float32)
    tss = tl.zeros([BM], tl.float32)
    for s0 in range(0, K, SPLIT):
        acc = tl.zeros([BM, BN], tl.float32)
        ss = tl.zeros([BM], tl.float32)
        for k0 in range(s0, tl.minimum(s0 + SPLIT, K), BK):
            kmask = (k0 + kk) < K
            a = tl.load(X + rows[:, None] * s_xm + (k0 + kk)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(W + cols[None, :] * s_wn + (k0 + kk)[:, None], mask=(cols < N)[None, :] & kmask[:, None],
                        other=0.0)
            acc = tl.dot(a, b, acc, input_precision="ieee")
            ss += tl.sum(a * a, 1)
        tot += acc
        tss += ss
    r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tss, Kf) + eps))
    tl.store(Y + rows[:, None] * N + cols[None, :], tot * r[:, None], mask=rmask[:, None] & (cols < N)[None, :])


@triton.jit
def hc_finish_kernel(Pacc, Pss, Y, M, N, Kf, S, eps, BM: tl.constexpr, BN: tl.constexpr):
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < M
    cols = tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    ss = tl.zeros([BM], tl.float32)
    for s in range(0, S):
        base = s * M + rows
        acc += tl.load(Pacc + base[:, None] * BN + cols[None, :], mask=rmask[:, None], other=0.0)
        ss += tl.load(Pss + base, mask=rmask, other=0.0)
    r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, Kf) + eps))
    tl.store(Y + rows[:, None] * N + cols[None, :], acc * r[:, None], mask=rmask[:, None] & (cols < N)[None, :])


def hc_mix(flat, fn, eps, tile=None):
    """mHC projection in fp32 on the CUDA cores: K cut into fixed ``HC_SPLIT`` slices (so one row
    fills the GPU), slices summed in order by a second kernel, ``1 / sqrt`` correctly rounded."""
    import torch

    N, K = fn.shape
    x = flat.reshape(-1, K).contiguous()
    M = x.shape[0]
    y = torch.empty(M, N, dtype=torch.float32, device=flat.device)
    if M == 0:
        return y.view(*flat.shape[:-1], N)
    S = cdiv(K, HC_SPLIT)
    bn = max(16, next_pow2(N))
    w = fn.contiguous()
    t = tile or pick(HC_TILES, M)  # the K order (BK lanes, then the slices) never changes
    bm = t["BM"]
    if t.get("fused", False):
        launch(hc_fused_kernel, (cdiv(M, bm),), x, w, y, M, N, K, float(K), float(eps), x.stride(0), w.stride(0),
               BM=bm, BN=bn, BK=t["BK"], SPLIT=HC_SPLIT, num_warps=t["num_warps"])
        return y.view(*flat.shape[:-1], N)
    pacc = torch.empty(S, M, bn, dtype=torch.float32, device=flat.device)
    pss = torch.empty(S, M, dtype=torch.float32, device=flat.device)
    launch(hc_mix_kernel, (cdiv(M, bm), S), x, w, pacc, pss, M, N, K, x.stride(0), w.stride(0), BM=bm, BN=bn,
           BK=t["BK"], SPLIT=HC_SPLIT, num_warps=t["num_warps"])
    launch(hc_finish_kernel, (cdiv(M, bm),), pacc, pss, y, M, N, float(K), S, float(eps), BM=bm, BN=bn)
    return y.view(*flat.shape[:-1], N)


@triton.jit
def indexer_kernel(Q, Wt, Kc, Rows, Y, S, H, NK, s_qt, s_qh, s_wt, s_kt, s_ks, s_rt, s_yt, D: tl.constexpr,
                   BH: tl.constexpr, BS: tl.constexpr, IEEE: tl.constexpr, INDEXED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * BS + tl.arange(0, BS)
    h = tl.arange(0, BH)
    d = tl.arange(0, D)
    q = tl.load(Q + t * s_qt + h[:, None] * s_qh + d[None, :], mask=(h < H)[:, None], other=0.0)
    if INDEXED:  # key rows of the pool by index: -1 (or any row outside [0, NK)) is no entry
        r = tl.load(Rows + t * s_rt + s, mask=s < S, other=-1).to(tl.int64)
        ok = (r >= 0) & (r < NK)
        k = tl.load(Kc + r[None, :] * s_ks + d[:, None], mask=ok[None, :], other=0.0)
    else:
        ok = s < S
        k = tl.load(Kc + t * s_kt + s[None, :].to(tl.int64) * s_ks + d[:, None], mask=ok[None, :], other=0.0)
    if IEEE:
        dots = tl.dot(q, k, input_precision="ieee")
    else:
        dots = tl.dot(q, k)
    w = tl.load(Wt + t * s_wt + h, mask=h < H, other=0.0).to(tl.float32)
    score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], 0)
    if INDEXED:
        score = tl.where(ok, score, float("-inf"))
    tl.store(Y + t * s_yt + s, score.to(Y.dtype.element_ty), mask=s < S)


INDEXER_BS = 64  # keys per program


def indexer_scores(q, w, k, rows=None):
    """``I[t, s] = sum_h w[t, h] relu(q[t, h] . k[s])``: one program per (query, 64 keys). Keys are
    shared ``[S, d]``, per row ``[T, S, d]``, or read by index from a pool ``k [N, d]`` with
    ``rows [T, S]`` (``-1``: no entry, scored ``-inf``; nothing is gathered). One arithmetic for all
    three (a row stride of 0 for shared keys; the same MMA on the same key values when indexed), so
    a query gets the same bits whichever form its step passes."""
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
        launch(indexer_kernel, (T, cdiv(S, INDEXER_BS)), qc, wc, kc, rc, out, S, H, kc.shape[0], qc.stride(0),
               qc.stride(1), wc.stride(0), s_kt, kc.stride(-2), s_rt, out.stride(0), D=D,
               BH=max(16, next_pow2(H)), BS=INDEXER_BS, IEEE=q.dtype == torch.float32,
               INDEXED=rows is not None)
    return out


def indexer_scores_rows(q, w, pool, rows):
    """``ops.indexer_scores(q, w, pool, rows=rows)`` on CUDA: keys read by index from the pool."""
    return indexer_scores(q, w, pool, rows)


@triton.jit
def fp8_kernel(X, W, Sc, Y, M, N, K, s_xm, s_wn, s_sn, s_ym, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               SB: tl.constexpr):
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
