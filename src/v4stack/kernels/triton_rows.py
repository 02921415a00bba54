"""Row-local invariant kernels (Triton): softmax / log_softmax, weighted_pool, moe_combine.

One program owns one row (or one row's column block); every reduction inside it is over that
row only, in a fixed order set by the row width and the block size (a ``BLOCK``-wide vector
accumulated slice by slice, then one tree over the vector). Nothing depends on how many rows
the call has.
"""

import torch
import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import cdiv, launch, next_pow2

ROW_BLOCK = 4096  # widest row one program handles; wider rows run in chunks of this size


@triton.jit
def softmax_kernel(X, Y, N, s_x, s_y, LOG: tl.constexpr, BLOCK: tl.constexpr):
    """A row of at most BLOCK in one program."""
    pdl_enter()
    r = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    x = tl.load(X + r * s_x + o, mask=o < N, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    e = tl.exp(x - m)
    s = tl.sum(e, 0)
    if LOG:
        y = (x - m) - tl.log(s)
    else:
        y = tl.div_rn(e, s)
    tl.store(Y + r * s_y + o, y.to(Y.dtype.element_ty), mask=o < N)


@triton.jit
def chunk_stats_kernel(X, Pm, Ps, N, s_x, S, BLOCK: tl.constexpr):
    """Wide rows, pass 1: chunk c of row r -> its max and its sum of exp(x - max)."""
    pdl_enter()
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    o = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + r * s_x + o, mask=o < N, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    tl.store(Pm + r * S + c, m)
    tl.store(Ps + r * S + c, tl.sum(tl.exp(x - m), 0))


@triton.jit
def chunk_write_kernel(X, Y, Pm, Ps, N, s_x, s_y, S, LOG: tl.constexpr, BLOCK: tl.constexpr, SB: tl.constexpr):
    """Wide rows, pass 2: every chunk merges the row's chunk statistics in the same fixed tree
    (so all chunks agree on the row's max and sum), then writes its own elements."""
    pdl_enter()
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    j = tl.arange(0, SB)
    ms = tl.load(Pm + r * S + j, mask=j < S, other=float("-inf"))
    ss = tl.load(Ps + r * S + j, mask=j < S, other=0.0)
    m = tl.max(ms, 0)
    s = tl.sum(ss * tl.exp(ms - m), 0)
    o = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + r * s_x + o, mask=o < N, other=float("-inf")).to(tl.float32)
    if LOG:
        y = (x - m) - tl.log(s)
    else:
        y = tl.div_rn(tl.exp(x - m), s)
    tl.store(Y + r * s_y + o, y.to(Y.dtype.element_ty), mask=o < N)


def softmax(x, dim=-1, log=False):
    """Softmax / log-softmax of each row. Rows up to ``ROW_BLOCK`` wide: one program per row.
    Wider rows (a vocabulary): chunks of ``ROW_BLOCK`` in parallel, two passes; the chunking
    depends on the row width alone."""
    N = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    y = torch.empty_like(x2, memory_format=torch.contiguous_format)
    if R == 0 or N == 0:
        return y.view(x.shape)
    if N <= ROW_BLOCK:
        block = next_pow2(N)
        launch(softmax_kernel, (R,), x2, y, N, x2.stride(0), N, LOG=log, BLOCK=block,
               num_warps=8 if block >= 2048 else 4)
        return y if x.dim() == 2 else y.view(x.shape)
    S = cdiv(N, ROW_BLOCK)
    pm = torch.empty(R, S, dtype=torch.float32, device=x.device)
    ps = torch.empty_like(pm)
    launch(chunk_stats_kernel, (R, S), x2, pm, ps, N, x2.stride(0), S, BLOCK=ROW_BLOCK, num_warps=8)
    launch(chunk_write_kernel, (R, S), x2, y, pm, ps, N, x2.stride(0), y.stride(0), S, LOG=log, BLOCK=ROW_BLOCK,
           SB=next_pow2(S), num_warps=8)
    return y.view(x.shape)


def log_softmax(x, dim=-1):
    return softmax(x, dim, log=True)


@triton.jit
def pool_kernel(KV, S, Y, P, C, s_kr, s_kp, s_sr, s_sp, s_yr, BP: tl.constexpr, BC: tl.constexpr):
    pdl_enter()
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    p = tl.arange(0, BP)
    m2 = (p < P)[:, None] & (c < C)[None, :]
    s = tl.load(S + r * s_sr + p[:, None] * s_sp + c[None, :], mask=m2, other=float("-inf")).to(tl.float32)
    kv = tl.load(KV + r * s_kr + p[:, None] * s_kp + c[None, :], mask=m2, other=0.0).to(tl.float32)
    m = tl.max(s, 0)
    e = tl.exp(s - m[None, :])
    w = tl.div_rn(e, tl.sum(e, 0)[None, :])
    y = tl.sum(w * kv, 0)
    tl.store(Y + r * s_yr + c, y.to(Y.dtype.element_ty), mask=c < C)


# a program's [P, columns] tile of each operand holds at most this many elements: the columns are
# POOL_ELEMS / P (at most 256). An HCA entry's 128 rows at 256 columns held 32768 fp32 values of
# each operand in a program's registers and spilled (a CPU test reads ptxas's report): one closing
# took 41.9 us for two entries on the H100 (bench/results/serve_profile_stagger128_h100_f7651c7.json).
# The columns depend on P and C alone, never on the rows, so a row's bits do not depend on its batch.
POOL_ELEMS = 4096


def weighted_pool(kv, score, dim):
    """``sum_j softmax_j(score) * kv_j`` over dim 1 of ``[R, P, C]`` tensors (leading dims flattened)."""
    P, C = kv.shape[-2], kv.shape[-1]
    kv3, s3 = kv.reshape(-1, P, C).contiguous(), score.reshape(-1, P, C).contiguous()
    out_dtype = torch.promote_types(kv.dtype, score.dtype)
    y = torch.empty(kv3.shape[0], C, dtype=out_dtype, device=kv.device)
    if kv3.shape[0] and C:
        bc = min(256, next_pow2(C), max(16, POOL_ELEMS // next_pow2(P)))
        launch(pool_kernel, (kv3.shape[0], cdiv(C, bc)), kv3, s3, y, P, C, kv3.stride(0), kv3.stride(1), s3.stride(0),
                                                         s3.stride(1), y.stride(0), BP=next_pow2(P),
                                                         BC=bc)
    return y.view(*kv.shape[:-2], C)


@triton.jit
def combine_kernel(Yin, Idx, Out, k, D, s_yn, s_yk, s_in, s_on, BK: tl.constexpr, BD: tl.constexpr):
    pdl_enter()
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    j = tl.arange(0, BK)
    ids = tl.load(Idx + n * s_in + j, mask=j < k, other=0)
    # rank of slot j in (expert id, slot) order: how many slots sort before it
    before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (j[None, :] < j[:, None]))
    rank = tl.sum((before & (j < k)[None, :]).to(tl.int32), 1)
    acc = tl.zeros([BD], tl.float32)
    for r in range(0, k):
        slot = tl.sum(tl.where((rank == r) & (j < k), j, 0), 0)
        acc += tl.load(Yin + n * s_yn + slot * s_yk + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(Out + n * s_on + d, acc, mask=d < D)


def moe_combine(y, idx):
    """Per token, ``y [N, k, d]`` summed left to right in ascending expert id (ties in slot order), fp32."""
    N, k, D = y.shape
    yc, ic = y.contiguous(), idx.contiguous()
    out = torch.empty(N, D, dtype=torch.float32, device=y.device)
    if N and D:
        bd = min(1024, next_pow2(D))
        launch(combine_kernel, (N, cdiv(D, bd)), yc, ic, out, k, D, yc.stride(0), yc.stride(1), ic.stride(0),
                                                out.stride(0), BK=max(2, next_pow2(k)), BD=bd)
    return out


@triton.jit
def rms_norm_kernel(X, W, Y, N, Nf, s_x, s_y, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    pdl_enter()
    _rms_row(X, W, Y, tl.program_id(0).to(tl.int64), N, Nf, s_x, s_y, eps, HAS_W, BLOCK)


@triton.jit
def rms_norm_pair_kernel(XA, WA, YA, NA, NAf, s_xa, s_ya, XB, WB, YB, NB, NBf, s_xb, s_yb, eps, BA: tl.constexpr,
                         BB: tl.constexpr):
    """Two weighted RMS norms of a token's rows in one launch: program ``(r, 0)`` norms row ``r`` of
    ``XA``, ``(r, 1)`` of ``XB``, each as ``rms_norm_kernel`` with its own block (the same bits)."""
    pdl_enter()
    r = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _rms_row(XA, WA, YA, r, NA, NAf, s_xa, s_ya, eps, True, BA)
    else:
        _rms_row(XB, WB, YB, r, NB, NBf, s_xb, s_yb, eps, True, BB)


@triton.jit
def _rms_row(X, W, Y, r, N, Nf, s_x, s_y, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for c in range(0, N, BLOCK):
        x = tl.load(X + r * s_x + c + o, mask=c + o < N, other=0.0).to(tl.float32)
        acc += x * x
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(acc, 0), Nf) + eps))
    for c in range(0, N, BLOCK):
        x = tl.load(X + r * s_x + c + o, mask=c + o < N, other=0.0).to(tl.float32)
        y = x * inv
        if HAS_W:
            y = y * tl.load(W + c + o, mask=c + o < N, other=0.0).to(tl.float32)
        tl.store(Y + r * s_y + c + o, y.to(Y.dtype.element_ty), mask=c + o < N)


def rms_norm(x, weight, eps):
    """RMSNorm of each row: fp32 sum of squares in a fixed order, ``1 / sqrt`` correctly rounded."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] and N:
        w = weight.contiguous() if weight is not None else x2
        launch(rms_norm_kernel, (x2.shape[0],), x2, w, y, N, float(N), x2.stride(0), y.stride(0), float(eps),
               HAS_W=weight is not None, BLOCK=min(ROW_BLOCK, next_pow2(N)))
    return y.view(x.shape)


def rms_norm_pair(a, wa, b, wb, eps):
    """``(rms_norm(a, wa, eps), rms_norm(b, wb, eps))`` for two ``[T, N]`` row sets with unit
    column strides (``fused.rms_norm_pair``): one launch, each norm's bits."""
    T = a.shape[0]
    ya = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    yb = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    if T:
        NA, NB = a.shape[1], b.shape[1]
        launch(rms_norm_pair_kernel, (T, 2), a, wa.contiguous(), ya, NA, float(NA), a.stride(0), ya.stride(0), b,
               wb.contiguous(), yb, NB, float(NB), b.stride(0), yb.stride(0), float(eps),
               BA=min(ROW_BLOCK, next_pow2(NA)), BB=min(ROW_BLOCK, next_pow2(NB)))
    return ya, yb


@triton.jit
def hc_read_kernel(X, Pre, Y, n, D, s_xn, s_xj, s_pn, s_yn, NB: tl.constexpr, BD: tl.constexpr):
    pdl_enter()
    r = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    j = tl.arange(0, NB)
    m2 = (j < n)[:, None] & (d < D)[None, :]
    x = tl.load(X + r * s_xn + j[:, None] * s_xj + d[None, :], mask=m2, other=0.0).to(tl.float32)
    p = tl.load(Pre + r * s_pn + j, mask=j < n, other=0.0).to(tl.float32)
    y = tl.sum(p[:, None] * x, 0)
    tl.store(Y + r * s_yn + d, y.to(Y.dtype.element_ty), mask=d < D)


def hc_read(x, pre):
    """mHC read ``sum_j pre_j x_j`` per token and channel block (a fixed tree over the streams)."""
    N, n, D = x.shape
    xc, pc = x.contiguous(), pre.contiguous()
    y = torch.empty(N, D, dtype=x.dtype, device=x.device)
    if N and D:
        bd = min(1024, next_pow2(D))
        launch(hc_read_kernel, (N, cdiv(D, bd)), xc, pc, y, n, D, xc.stride(0), xc.stride(1), pc.stride(0),
               y.stride(0), NB=max(2, next_pow2(n)), BD=bd)
    return y


@triton.jit
def _read_block(X, Pre, r, d0, n, D, s_xn, s_xj, s_pn, NB: tl.constexpr, BD: tl.constexpr):
    """``hc_read_kernel``'s columns ``[d0, d0 + BD)`` of row ``r``, rounded to the streams' dtype."""
    d = d0 + tl.arange(0, BD)
    j = tl.arange(0, NB)
    m2 = (j < n)[:, None] & (d < D)[None, :]
    x = tl.load(X + r * s_xn + j[:, None] * s_xj + d[None, :], mask=m2, other=0.0).to(tl.float32)
    p = tl.load(Pre + r * s_pn + j, mask=j < n, other=0.0).to(tl.float32)
    return tl.sum(p[:, None] * x, 0).to(X.dtype.element_ty).to(tl.float32), d


@triton.jit
def hc_read_norm_kernel(X, Pre, W, Y, n, D, Df, s_xn, s_xj, s_pn, s_yn, eps, HAS_W: tl.constexpr, NB: tl.constexpr,
                        BD: tl.constexpr, ONE: tl.constexpr):
    """One row a program: the mHC read (``hc_read_kernel``'s sum over the streams, rounded to the
    streams' dtype as it stores it) and its RMS norm, without writing the read. ONE (the row in
    one block of BD columns): the read is loaded once and kept; else two passes over the blocks,
    the sum of squares (per lane, then one tree) and the read again (the same bits) scaled."""
    pdl_enter()
    r = tl.program_id(0).to(tl.int64)
    if ONE:
        _read_norm_row(X, Pre, W, Y, r, n, D, Df, s_xn, s_xj, s_pn, s_yn, eps, HAS_W, NB, BD)
    else:
        acc = tl.zeros([BD], tl.float32)
        for d0 in range(0, D, BD):
            y, d = _read_block(X, Pre, r, d0, n, D, s_xn, s_xj, s_pn, NB, BD)
            acc += y * y
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(acc, 0), Df) + eps))
        for d0 in range(0, D, BD):
            y, d = _read_block(X, Pre, r, d0, n, D, s_xn, s_xj, s_pn, NB, BD)
            _store_normed(Y, W, r, d, y, inv, D, s_yn, HAS_W)


@triton.jit
def _read_norm_row(X, Pre, W, Y, r, n, D, Df, s_xn, s_xj, s_pn, s_yn, eps, HAS_W: tl.constexpr, NB: tl.constexpr,
                   BD: tl.constexpr):
    """Row ``r``'s read in one block of ``BD >= D`` columns, RMS-normalised and stored (also run by
    ``triton_mhc.finish_read_norm_kernel``)."""
    y, d = _read_block(X, Pre, r, 0, n, D, s_xn, s_xj, s_pn, NB, BD)
    _store_normed(Y, W, r, d, y, tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(y * y, 0), Df) + eps)), D, s_yn, HAS_W)


@triton.jit
def _store_normed(Y, W, r, d, y, inv, D, s_yn, HAS_W: tl.constexpr):
    y = y * inv
    if HAS_W:
        y = y * tl.load(W + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(Y + r * s_yn + d, y.to(Y.dtype.element_ty), mask=d < D)


READ_NORM_ONE = 4096  # widest row read in one block (one load of the streams, no second pass)


def hc_read_norm(x, pre, weight, eps):
    """``rms_norm(hc_read(x, pre), weight, eps)`` per token in one launch (``fused.hc_read_norm``).
    Rows up to ``READ_NORM_ONE`` wide are one block of eight warps: one round trip to memory a row
    (a program per row is few programs at decode batch sizes, so the latency of each counts)."""
    N, n, D = x.shape
    xc, pc = x.contiguous(), pre.contiguous()
    y = torch.empty(N, D, dtype=x.dtype, device=x.device)
    if N and D:
        w = weight.contiguous() if weight is not None else y
        one = D <= READ_NORM_ONE
        launch(hc_read_norm_kernel, (N,), xc, pc, w, y, n, D, float(D), xc.stride(0), xc.stride(1), pc.stride(0),
               y.stride(0), float(eps), HAS_W=weight is not None, NB=max(2, next_pow2(n)),
               BD=next_pow2(D) if one else 1024, ONE=one, num_warps=8 if one else 4)
    return y


@triton.jit
def hc_write_kernel(X, Out, Post, Comb, Y, n, D, s_xn, s_xj, s_on, s_pn, s_cn, s_cj, s_yn, s_yk,
                    NB: tl.constexpr, BD: tl.constexpr):
    pdl_enter()
    r = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    o = tl.load(Out + r * s_on + d, mask=d < D, other=0.0).to(tl.float32)
    write_streams(X, o, Post, Comb, Y, r, d, n, D, s_xn, s_xj, s_pn, s_cn, s_cj, s_yn, s_yk, NB)


@triton.jit
def write_streams(X, o, Post, Comb, Y, r, d, n, D, s_xn, s_xj, s_pn, s_cn, s_cj, s_yn, s_yk, NB: tl.constexpr):
    """Row ``r``'s new streams over columns ``d`` from its sublayer output ``o`` (fp32): ``hc_write``'s
    arithmetic (also run by ``triton_route.moe_hc_write_kernel``)."""
    j = tl.arange(0, NB)
    m2 = (j < n)[:, None] & (d < D)[None, :]
    x = tl.load(X + r * s_xn + j[:, None] * s_xj + d[None, :], mask=m2, other=0.0).to(tl.float32)
    for k in range(0, n):
        c = tl.load(Comb + r * s_cn + j * s_cj + k, mask=j < n, other=0.0).to(tl.float32)
        pk = tl.load(Post + r * s_pn + k).to(tl.float32)
        y = pk * o + tl.sum(c[:, None] * x, 0)
        tl.store(Y + r * s_yn + k * s_yk + d, y.to(Y.dtype.element_ty), mask=d < D)


@triton.jit
def embed_streams_kernel(IDS, Wt, Y, n, D, V, s_w, s_yn, s_yj, BD: tl.constexpr):
    """Token ``t``'s embedding row over columns ``d``, stored in each of its ``n`` streams (an id
    outside ``[0, V)`` reads nothing and writes zeros)."""
    pdl_enter()
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = d < D
    i = tl.load(IDS + t).to(tl.int64)
    v = tl.load(Wt + i * s_w + d, mask=dm & (i >= 0) & (i < V), other=0.0)
    for j in range(0, n):
        tl.store(Y + t * s_yn + j * s_yj + d, v, mask=dm)


def embed_streams(ids, weight, n: int):
    """``ops.fused.embed_streams`` on CUDA: the streams' first copies ``[T, n, d]`` of the embedding
    rows of ``ids`` in one launch (a gather and a concatenation otherwise)."""
    T = ids.shape[0]
    V, D = weight.shape
    y = torch.empty(T, n, D, dtype=weight.dtype, device=weight.device)
    if T and D:
        bd = min(1024, next_pow2(D))
        launch(embed_streams_kernel, (T, cdiv(D, bd)), ids.contiguous(), weight, y, n, D, V, weight.stride(0),
               y.stride(0), y.stride(1), BD=bd, num_warps=4)
    return y


def hc_write(x, out, post, comb):
    """mHC write ``x'_k = post_k * out + sum_j comb[j, k] x_j`` (a fixed tree over j)."""
    N, n, D = x.shape
    xc, oc, pc, cc = x.contiguous(), out.contiguous(), post.contiguous(), comb.contiguous()
    y = torch.empty(N, n, D, dtype=x.dtype, device=x.device)
    if N and D:
        bd = min(1024, next_pow2(D))
        launch(hc_write_kernel, (N, cdiv(D, bd)), xc, oc, pc, cc, y, n, D, xc.stride(0), xc.stride(1),
               oc.stride(0), pc.stride(0), cc.stride(0), cc.stride(1), y.stride(0), y.stride(1),
               NB=max(2, next_pow2(n)), BD=bd)
    return y
