"""Fused row kernels of the decode path (Triton): mHC coefficients and rotary embedding.

- ``hc_split``: from the mHC projection ``mix [N, n^2 + 2n]`` (fp32) to ``pre``, ``post`` and the
  Sinkhorn-projected ``comb [N, n, n]`` in one kernel. The torch composition launches ~130
  kernels per call site (20 Sinkhorn rounds of row and column sums and divisions); here one
  program holds ``ROWS`` rows' ``n x n`` matrices in registers for every round.
- ``hc_pre``: the projection ``hc_mix`` (``triton_gemm``, read from the streams themselves: no
  fp32 copy of them) then ``hc_split``: the bits of the two ops called one after the other.
- ``rope``: the interleaved rotation of the last ``r`` channels for every row in one kernel
  (angles in fp64 as ``Rotary.cos_sin`` computes them, rotation in fp32), instead of ~8.

Every value is computed from its own row only, in an order fixed by ``n`` (resp. ``r``), so both
kernels are batch-invariant; divisions are ``div_rn`` as in the project's other kernels (a
Sinkhorn normalisation takes one reciprocal per sum and multiplies by it).
"""

import torch
import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import launch, next_pow2
from v4stack.kernels.triton_rows import _store_normed
from v4stack.kernels.triton_slices import FINISH_BN, _finish_rows


@triton.jit
def _sigmoid(x):
    return tl.div_rn(1.0, 1.0 + tl.exp(-x))


@triton.jit
def _split_store(pre, post, c, r, ok, PRE, POST, COMB, eps, NH: tl.constexpr, ITERS: tl.constexpr):
    """pre/post ``[ROWS, NH]`` and comb ``[ROWS, NH, NH]`` pre-activations -> stored coefficients.
    Each Sinkhorn normalisation divides once per row / column sum (``div_rn``) and multiplies."""
    h = tl.arange(0, NH)
    m2 = ok[:, None]
    tl.store(PRE + r[:, None] * NH + h[None, :], _sigmoid(pre) + eps, mask=m2)
    tl.store(POST + r[:, None] * NH + h[None, :], 2.0 * _sigmoid(post), mask=m2)
    c = tl.exp(c - tl.max(c, 2)[:, :, None])
    c = c * tl.div_rn(1.0, tl.sum(c, 2))[:, :, None] + eps
    c = c * tl.div_rn(1.0, tl.sum(c, 1) + eps)[:, None, :]
    for _ in tl.static_range(ITERS - 1):
        c = c * tl.div_rn(1.0, tl.sum(c, 2) + eps)[:, :, None]
        c = c * tl.div_rn(1.0, tl.sum(c, 1) + eps)[:, None, :]
    jk = h[:, None] * NH + h[None, :]
    tl.store(COMB + r[:, None, None] * (NH * NH) + jk[None, :, :], c, mask=ok[:, None, None])


@triton.jit
def hc_split_kernel(MIX, SCALE, BASE, PRE, POST, COMB, N, s_mix, eps,
                    NH: tl.constexpr, ITERS: tl.constexpr, ROWS: tl.constexpr):
    pdl_enter()
    _split_rows(MIX, SCALE, BASE, PRE, POST, COMB, N, s_mix, eps, tl.program_id(0), NH, ITERS, ROWS)


@triton.jit
def _split_rows(MIX, SCALE, BASE, PRE, POST, COMB, N, s_mix, eps, pm, NH: tl.constexpr, ITERS: tl.constexpr,
                ROWS: tl.constexpr):
    r = pm.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = r < N
    h = tl.arange(0, NH)
    jk = h[:, None] * NH + h[None, :]  # [n, n]: row j, column k
    row = MIX + r[:, None] * s_mix
    pre = tl.load(row + h[None, :], mask=ok[:, None], other=0.0) * tl.load(SCALE) + tl.load(BASE + h)[None, :]
    post = tl.load(row + NH + h[None, :], mask=ok[:, None], other=0.0) * tl.load(SCALE + 1) \
        + tl.load(BASE + NH + h)[None, :]
    c = tl.load(MIX + r[:, None, None] * s_mix + 2 * NH + jk[None, :, :], mask=ok[:, None, None], other=0.0) \
        * tl.load(SCALE + 2) + tl.load(BASE + 2 * NH + jk)[None, :, :]
    _split_store(pre, post, c, r, ok, PRE, POST, COMB, eps, NH, ITERS)


@triton.jit
def finish_split_kernel(P, PSS, Y, SCALE, BASE, PRE, POST, COMB, M, N, MN, Kf, norm_eps, s_ym, eps,
                        S: tl.constexpr, SP: tl.constexpr, BN: tl.constexpr, NH: tl.constexpr, ITERS: tl.constexpr):
    """``hc_pre``'s two last launches as one, one row a program (one warp): ``finish_kernel``'s sum
    of the projection's partials into ``Y`` (the mix), then ``hc_split_kernel``'s work on that row
    (one row, one warp: ``SPLIT_LAUNCH``'s shape, so the same bits as the two kernels)."""
    pdl_enter()
    pm = tl.program_id(0)
    _finish_rows(P, PSS, Y, M, N, MN, Kf, norm_eps, s_ym, pm, 0, S, SP, 1, BN, True)
    tl.debug_barrier()  # the row's mix, stored by the warp's lanes, is read back by other lanes
    _split_rows(Y, SCALE, BASE, PRE, POST, COMB, M, s_ym, eps, pm, NH, ITERS, 1)


@triton.jit
def _streams_row(X, r, NH: tl.constexpr, D, s_xn, s_xj, NB: tl.constexpr, BD: tl.constexpr):
    """Row ``r``'s streams ``[NB, BD]`` in ``X``'s dtype (``_read_block``'s loads), requested before a
    program's coefficients' work so their bytes arrive during it."""
    d = tl.arange(0, BD)
    j = tl.arange(0, NB)
    return tl.load(X + r * s_xn + j[:, None] * s_xj + d[None, :], mask=(j < NH)[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _read_norm_loaded(xs, pre, X, W, OUT, r, D, Df, s_on, rms_eps, HAS_W: tl.constexpr, BD: tl.constexpr):
    """``_read_norm_row``'s work on the row's loaded streams ``xs`` and its weights ``pre [NB]``: the
    read rounded to the streams' dtype, its RMS norm, stored."""
    y = tl.sum(pre[:, None] * xs.to(tl.float32), 0).to(X.dtype.element_ty).to(tl.float32)
    _store_normed(OUT, W, r, tl.arange(0, BD), y, tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(y * y, 0), Df) + rms_eps)),
                  D, s_on, HAS_W)


@triton.jit
def finish_read_norm_kernel(P, PSS, Y, SCALE, BASE, PRE, POST, COMB, X, W, OUT, M, N, MN, Kf, norm_eps, s_ym, eps,
                            D, Df, s_xn, s_xj, s_on, rms_eps, S: tl.constexpr, SP: tl.constexpr, BN: tl.constexpr,
                            NH: tl.constexpr, ITERS: tl.constexpr, HAS_W: tl.constexpr, NB: tl.constexpr,
                            BD: tl.constexpr):
    """Fast mode's ``hc_pre`` finish and the sublayer's normalised input in one program a row:
    ``finish_split_kernel``'s sum of the partials and split (the mix in ``Y``; pre, post, comb),
    then ``hc_read_norm_kernel``'s one-block read of the streams ``X`` with that pre and its RMS
    norm into ``OUT`` - one launch where there were two (the row's coefficients are short work
    for a program: what the two launches cost was mostly their latency). The row's streams are
    loaded first, so their bytes arrive while the partials are summed and split (at 89db14d, against
    loading them after: 14.66 -> 14.27 us at 256 rows, the same bits; wide_projections_h100_89db14d.json)."""
    pdl_enter()
    pm = tl.program_id(0)
    r = pm.to(tl.int64)
    xs = _streams_row(X, r, NH, D, s_xn, s_xj, NB, BD)
    _finish_rows(P, PSS, Y, M, N, MN, Kf, norm_eps, s_ym, pm, 0, S, SP, 1, BN, True)
    tl.debug_barrier()  # the row's mix, stored by some threads, is read back by others
    _split_rows(Y, SCALE, BASE, PRE, POST, COMB, M, s_ym, eps, pm, NH, ITERS, 1)
    tl.debug_barrier()  # and so is its pre
    j = tl.arange(0, NB)
    p = tl.load(PRE + r * NH + j, mask=j < NH, other=0.0).to(tl.float32)
    _read_norm_loaded(xs, p, X, W, OUT, r, D, Df, s_on, rms_eps, HAS_W, BD)


# the launch of the two finishes above, one row a program. Their sm_90a builds take 155 registers a
# thread, so one 8-warp program holds an SM and 256 rows are two programs an SM in turn; capped at
# 128 (``maxnreg``, no spills) two fit at once, which measured no faster: 14.34 against 14.25 us at
# 256 rows, 12.19 / 12.28 at 64, the partials' launch included, the same bits (an H100 at b7d789c,
# bench/results/register_cap_h100_b7d789c.json) - the program's time is its chain, not the waves
ROW_LAUNCH = dict(num_warps=8)


def finish_read_norm(p, pss, S: int, K: int, mix, scale, base, out, iters: int, eps: float, norm_eps: float,
                     x, weight, rms_eps: float, y):
    """``finish_read_norm_kernel`` over a projection's slice partials ``p [S, M, N]`` / ``pss [S,
    M]`` and the streams ``x [M, n, D]`` (contiguous, D <= ``triton_rows.READ_NORM_ONE``): the mix
    into ``mix [M, N]``, pre, post, comb into ``out``, the normalised read into ``y [M, D]``."""
    M, N = mix.shape
    D = x.shape[2]
    n = out[0].shape[1]
    launch(finish_read_norm_kernel, (M,), p, pss, mix, scale, base, *out, x, weight if weight is not None else y, y,
           M, N, M * N, float(K), float(norm_eps), mix.stride(0), float(eps), D, float(D), x.stride(0), x.stride(1),
           y.stride(0), float(rms_eps), S=S, SP=next_pow2(S), BN=FINISH_BN, NH=n, ITERS=iters,
           HAS_W=weight is not None, NB=max(2, next_pow2(n)), BD=next_pow2(D), num_stages=1, **ROW_LAUNCH)
    return y


def _outputs(N, n, device):
    pre = torch.empty(N, n, dtype=torch.float32, device=device)
    return pre, torch.empty_like(pre), torch.empty(N, n, n, dtype=torch.float32, device=device)


# rows a program and its warps, the same for every N (bench/results/hc_split_rows_h200.json: one row
# a program 4.0 us at 256 rows and 3.7 at 64, against 5.65 / 5.63 for 16 rows; the shape sets the
# reduction trees, so it is fixed, not chosen by N)
SPLIT_LAUNCH = dict(rows=1, warps=1)


def hc_split(mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int, eps: float,
             launch_shape: dict | None = None):
    N = mix.shape[0]
    pre, post, comb = _outputs(N, n, mix.device)
    if N:
        sh = launch_shape or SPLIT_LAUNCH
        rows = sh["rows"]
        launch(hc_split_kernel, (triton.cdiv(N, rows),), mix, scale, base, pre, post, comb, N, mix.stride(0),
               float(eps), NH=n, ITERS=iters, ROWS=rows, num_warps=sh["warps"])
    return pre, post, comb


def hc_pre(x, fn, scale, base, n: int, iters: int, eps: float, norm_eps: float):
    """mHC coefficients straight from the streams ``x [M, n, d]`` (any float dtype, widened in the
    kernel: no fp32 copy of them): the projection is ``triton_gemm.hc_mix`` itself (its fixed K
    slices, 3xTF32, the RMS factor) and the split ``hc_split`` - so the coefficients are those of
    ``hc_split(hc_mix(x))`` bit for bit. Where the projection's tile sums its partials in a second
    launch, that launch does the split too (``finish_split_kernel``): two kernels either way."""
    from v4stack.kernels.triton_gemm import hc_mix

    M = x.shape[0]
    if M == 0:
        return _outputs(M, n, x.device)
    N = fn.shape[0]
    if not (SPLIT_LAUNCH == dict(rows=1, warps=1) and N <= FINISH_BN):
        return hc_split(hc_mix(x.reshape(M, -1), fn, norm_eps), scale, base, n, iters, eps)
    out = _outputs(M, n, x.device)

    def finish(p, pss, S, y, M, K):
        return finish_split(p, pss, S, K, y, scale, base, out, iters, eps, norm_eps)

    mix, done = hc_mix(x.reshape(M, -1), fn, norm_eps, finish=finish)
    return done if done is not None else hc_split(mix, scale, base, n, iters, eps)


def finish_split(p, pss, S: int, K: int, y, scale, base, out, iters: int, eps: float, norm_eps: float):
    """``finish_split_kernel`` over a projection's slice partials ``p [S, M, N]`` / ``pss [S, M]``:
    the mix into ``y [M, N]``, then pre, post, comb into ``out`` (``_outputs``'); returns ``out``."""
    M, N = y.shape
    launch(finish_split_kernel, (M,), p, pss, y, scale, base, *out, M, N, M * N, float(K), float(norm_eps),
           y.stride(0), float(eps), S=S, SP=next_pow2(S), BN=FINISH_BN, NH=out[0].shape[1], ITERS=iters, num_warps=1,
           num_stages=1)
    return out


@triton.jit
def hc_head_kernel(MIX, SCALE, BASE, PRE, N, s_mix, eps, NH: tl.constexpr, ROWS: tl.constexpr):
    pdl_enter()
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = r < N
    h = tl.arange(0, NH)
    m = tl.load(MIX + r[:, None] * s_mix + h[None, :], mask=ok[:, None], other=0.0)
    pre = _sigmoid(m * tl.load(SCALE) + tl.load(BASE + h)[None, :]) + eps
    tl.store(PRE + r[:, None] * NH + h[None, :], pre, mask=ok[:, None])


def hc_head_pre(x, fn, scale, base, eps: float, norm_eps: float):
    """The head's stream weights from the streams ``x [M, n, d]`` (read and widened in the
    projection's kernel, ``hc_pre``'s way: no fp32 copy of them): ``hc_mix`` then one kernel for
    ``sigmoid(mix * scale + base) + eps``."""
    from v4stack.kernels.triton_gemm import hc_mix

    M = x.shape[0]
    if M == 0:
        return torch.empty(0, x.shape[1], dtype=torch.float32, device=x.device)
    return head_weights(hc_mix(x.reshape(M, -1), fn, norm_eps), scale, base, eps)


@triton.jit
def finish_head_read_norm_kernel(P, PSS, Y, SCALE, BASE, X, W, OUT, M, N, MN, Kf, norm_eps, s_ym, eps, D, Df, s_xn,
                                 s_xj, s_on, rms_eps, S: tl.constexpr, SP: tl.constexpr, BN: tl.constexpr,
                                 NH: tl.constexpr, HAS_W: tl.constexpr, NB: tl.constexpr, BD: tl.constexpr):
    """The head's stream weights and the final norm in one program a row: ``finish_kernel``'s sum
    of the projection's partials (the mix in ``Y``), ``hc_head_kernel``'s ``sigmoid(mix * scale +
    base) + eps``, then ``hc_read_norm_kernel``'s one-block read of the streams ``X`` with those
    weights and its RMS norm into ``OUT`` - the read never written, nor the weights (four launches
    where there were ``finish_sum``, ``head_weights``, ``hc_read`` and ``rms_norm``). The row's
    streams are loaded first, so their bytes arrive during the finish."""
    pdl_enter()
    pm = tl.program_id(0)
    r = pm.to(tl.int64)
    xs = _streams_row(X, r, NH, D, s_xn, s_xj, NB, BD)
    _finish_rows(P, PSS, Y, M, N, MN, Kf, norm_eps, s_ym, pm, 0, S, SP, 1, BN, True)
    tl.debug_barrier()  # the row's mix, stored by some threads, is read back by others
    j = tl.arange(0, NB)
    m = tl.load(Y + r * s_ym + j, mask=j < NH, other=0.0)
    pre = tl.where(j < NH, _sigmoid(m * tl.load(SCALE) + tl.load(BASE + j, mask=j < NH, other=0.0)) + eps, 0.0)
    _read_norm_loaded(xs, pre, X, W, OUT, r, D, Df, s_on, rms_eps, HAS_W, BD)


def finish_head_read_norm(p, pss, S: int, K: int, mix, scale, base, eps: float, norm_eps: float, x, weight,
                          rms_eps: float, y):
    """``finish_head_read_norm_kernel`` over the head projection's slice partials ``p [S, M, N]`` /
    ``pss [S, M]`` and the streams ``x [M, n, D]`` (contiguous, D <= ``triton_rows.READ_NORM_ONE``):
    the mix into ``mix [M, n]``, the normalised read into ``y [M, D]``."""
    M, N = mix.shape
    D = x.shape[2]
    launch(finish_head_read_norm_kernel, (M,), p, pss, mix, scale, base, x, weight if weight is not None else y, y,
           M, N, M * N, float(K), float(norm_eps), mix.stride(0), float(eps), D, float(D), x.stride(0), x.stride(1),
           y.stride(0), float(rms_eps), S=S, SP=next_pow2(S), BN=FINISH_BN, NH=N, HAS_W=weight is not None,
           NB=max(2, next_pow2(N)), BD=next_pow2(D), num_stages=1, **ROW_LAUNCH)
    return y


def head_weights(mix, scale, base, eps: float):
    """``sigmoid(mix * scale + base) + eps`` for the head's projection ``mix [M, n]`` (fp32), one kernel."""
    M, n = mix.shape
    pre = torch.empty(M, n, dtype=torch.float32, device=mix.device)
    rows = 16
    launch(hc_head_kernel, (triton.cdiv(M, rows),), mix, scale, base, pre, M, mix.stride(0), float(eps), NH=n,
           ROWS=rows, num_warps=1)
    return pre


@triton.jit
def rope_kernel(X, Y, POS, FREQ, CS, DEST, M, D, SIGN: tl.constexpr, HALF: tl.constexpr, BM: tl.constexpr,
                BD: tl.constexpr, HAS_DEST: tl.constexpr, COPY: tl.constexpr = True, BARRIER: tl.constexpr = True,
                TABLE: tl.constexpr = False):
    """Token ``t`` = program 0, rows ``[BM * program 1, ...)`` of its ``M`` rows of width ``D``;
    written to token ``t``'s rows of ``Y``, or with ``HAS_DEST`` to its rows at ``DEST[t]``.
    ``COPY`` False (``Y`` is ``X``): only the rotated tail is written, in place - after a barrier:
    Triton does not promise that the thread storing a pair is the only one that loaded it (a block
    smaller than the thread count is held by several threads), and one thread's store must not
    land before another's load of the same channels. ``BARRIER`` False is built only for the test
    that checks the barrier is there. ``TABLE``: the cosines and sines are read from ``CS [T, 2,
    HALF]`` (``rope_table_kernel``'s, the same fp32 values) instead of computed here in fp64.
    """
    pdl_enter()
    _rope_rows(X, Y, POS, FREQ, CS, DEST, M, D, tl.program_id(0).to(tl.int64), tl.program_id(1), SIGN, HALF, BM, BD,
               HAS_DEST, COPY, BARRIER, TABLE)


@triton.jit
def _rope_rows(X, Y, POS, FREQ, CS, DEST, M, D, t, pm, SIGN: tl.constexpr, HALF: tl.constexpr, BM: tl.constexpr,
               BD: tl.constexpr, HAS_DEST: tl.constexpr, COPY: tl.constexpr, BARRIER: tl.constexpr,
               TABLE: tl.constexpr):
    """``rope_kernel``'s work for token ``t``, row block ``pm`` (also run by ``rope_pair_kernel``)."""
    mr = pm * BM + tl.arange(0, BM)
    base = (t * M + mr[:, None]) * D
    ybase = base
    if HAS_DEST:
        ybase = (tl.load(DEST + t).to(tl.int64) * M + mr[:, None]) * D
    okm = (mr < M)[:, None]
    i = tl.arange(0, HALF)
    if TABLE:
        cos = tl.load(CS + t * (2 * HALF) + i)[None, :]
        sin = (tl.load(CS + t * (2 * HALF) + HALF + i) * SIGN)[None, :]
    else:
        ang = tl.load(POS + t).to(tl.float64) * tl.load(FREQ + i)
        cos = tl.cos(ang).to(tl.float32)[None, :]
        sin = (tl.sin(ang).to(tl.float32) * SIGN)[None, :]
    tail = D - 2 * HALF
    # the tail read as one contiguous [BM, 2 HALF] block (vector loads and stores), its pairs
    # taken apart in registers: (2i, 2i + 1) -> a_i, b_i
    c2 = tl.arange(0, 2 * HALF)
    x = tl.load(X + base + tail + c2[None, :], mask=okm, other=0.0).to(tl.float32)
    a, b = tl.split(tl.reshape(x, [BM, HALF, 2]))
    ya = a * cos - b * sin
    yb = a * sin + b * cos
    y = tl.reshape(tl.join(ya, yb), [BM, 2 * HALF])
    if not COPY:
        if BARRIER:
            tl.debug_barrier()  # every load of the program's rows is done before any store
    tl.store(Y + ybase + tail + c2[None, :], y.to(Y.dtype.element_ty), mask=okm)
    if COPY:
        for d0 in range(0, tail, BD):  # the channels before the rotated tail are copied
            d = d0 + tl.arange(0, BD)
            mk = okm & (d < tail)[None, :]
            tl.store(Y + ybase + d[None, :], tl.load(X + base + d[None, :], mask=mk), mask=mk)


@triton.jit
def rope_pair_kernel(Q, POS, FREQ, CS, KV, POOL, DEST, MQ, DQ, DK, QB, HALF: tl.constexpr, BMQ: tl.constexpr,
                     BD: tl.constexpr, TABLE: tl.constexpr, BARRIER: tl.constexpr = True):
    """A decode step's two rotations of one layer in one launch: program ``(t, p)`` with ``p < QB``
    rotates row block ``p`` of token ``t``'s queries in place (``rope_``'s work), ``p == QB`` the
    token's window row into the ring row ``DEST[t]`` of ``POOL`` (``rope_into``'s) - the same
    helper with the same constants as the two launches, so the same bits (``BARRIER`` False, the
    in-place branch without its barrier, is built only for the test that checks it is there)."""
    pdl_enter()
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    if p < QB:
        _rope_rows(Q, Q, POS, FREQ, CS, DEST, MQ, DQ, t, p, 1.0, HALF, BMQ, BD, False, False, BARRIER, TABLE)
    else:
        _rope_rows(KV, POOL, POS, FREQ, CS, DEST, 1, DK, t, 0, 1.0, HALF, 1, BD, True, True, False, TABLE)


@triton.jit
def rope_table_kernel(POS, FREQ, CS, T, HALF: tl.constexpr, BT: tl.constexpr):
    """``CS [T, 2, HALF]`` (fp32): per row the cosines, then the sines, of ``POS[t] * FREQ`` (the
    angle in fp64, rounded to fp32 after the function: what ``rope_kernel`` computes)."""
    pdl_enter()
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    ok = (t < T)[:, None]
    i = tl.arange(0, HALF)
    ang = tl.load(POS + t, mask=t < T, other=0).to(tl.float64)[:, None] * tl.load(FREQ + i)[None, :]
    row = CS + t[:, None] * (2 * HALF) + i[None, :]
    tl.store(row, tl.cos(ang).to(tl.float32), mask=ok)
    tl.store(row + HALF, tl.sin(ang).to(tl.float32), mask=ok)


def rope_table(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``[T, 2, len(freqs)]`` fp32: the cosines and sines of ``positions [T]`` (int64) times
    ``freqs`` (fp64) that ``rope_kernel`` rotates by, for a step's calls to share."""
    T, h = positions.shape[0], freqs.shape[0]
    cs = torch.empty(T, 2, h, dtype=torch.float32, device=positions.device)
    if T:
        bt = max(1, min(4, 2048 // h))  # many small programs: the fp64 functions are slow
        launch(rope_table_kernel, (triton.cdiv(T, bt),), positions, freqs, cs, T, HALF=h, BT=bt, num_warps=4)
    return cs


def rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool) -> torch.Tensor:
    """``x [T, ..., D]`` (contiguous), ``positions [T]`` int64, ``freqs [r/2]`` fp64."""
    T, D = x.shape[0], x.shape[-1]
    y = torch.empty_like(x)
    M = x.numel() // max(1, T * D)
    if x.numel():
        bm = min(16, triton.next_power_of_2(M))
        launch(rope_kernel, (T, triton.cdiv(M, bm)), x, y, positions, freqs, freqs, positions, M, D,
               SIGN=-1.0 if inverse else 1.0, HALF=freqs.shape[0], BM=bm, BD=128, HAS_DEST=False, COPY=True,
               BARRIER=False, TABLE=False, num_warps=4)
    return y


def rope_(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool, table=None) -> torch.Tensor:
    """``rope`` in place: only the rotated tail of each row is read and written (a decode step's
    queries and outputs, which nothing else holds), the same bits as ``rope`` (the kernel's, not
    the torch composition's: the two differ in the last bit, so both must be served by the same
    kind - ``bench/model_check.py --phases mixed_rope`` shows what a mix does)."""
    T, D = x.shape[0], x.shape[-1]
    M = x.numel() // max(1, T * D)
    if x.numel():
        bm = min(16, triton.next_power_of_2(M))
        launch(rope_kernel, (T, triton.cdiv(M, bm)), x, x, positions, freqs, freqs if table is None else table,
               positions, M, D, SIGN=-1.0 if inverse else 1.0, HALF=freqs.shape[0], BM=bm, BD=128, HAS_DEST=False,
               COPY=False, BARRIER=True, TABLE=table is not None, num_warps=4)
    return x


def rope_into(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, pool: torch.Tensor,
              dest: torch.Tensor, table=None) -> None:
    """``rope(x, positions, freqs, False)`` written straight into rows ``dest [T]`` of ``pool [P,
    numel / T]`` (x's dtype, contiguous): the same bits as the rotation then ``index_copy_``."""
    T, D = x.shape[0], x.shape[-1]
    M = x.numel() // max(1, T * D)
    if x.numel():
        bm = min(16, triton.next_power_of_2(M))
        launch(rope_kernel, (T, triton.cdiv(M, bm)), x, pool, positions, freqs, freqs if table is None else table,
               dest, M, D, SIGN=1.0, HALF=freqs.shape[0], BM=bm, BD=128, HAS_DEST=True, COPY=True, BARRIER=False,
               TABLE=table is not None, num_warps=4)


def rope_pair(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, pool: torch.Tensor,
              dest: torch.Tensor, table=None) -> torch.Tensor:
    """``rope_(q, ...)`` and ``rope_into(kv, ..., pool, dest)`` in one launch (``q [T, H, Dq]``, ``kv
    [T, Dk]``, both contiguous, one row of ``kv`` a token); returns ``q``."""
    T, Dq = q.shape[0], q.shape[-1]
    MQ = q.numel() // max(1, T * Dq)
    if T:
        bm = min(16, triton.next_power_of_2(MQ))
        qb = triton.cdiv(MQ, bm)
        launch(rope_pair_kernel, (T, qb + 1), q, positions, freqs, freqs if table is None else table, kv, pool, dest,
               MQ, Dq, kv.shape[-1], qb, HALF=freqs.shape[0], BMQ=bm, BD=128, TABLE=table is not None, BARRIER=True,
               num_warps=4)
    return q


@triton.jit
def swiglu_act_kernel(G, U, WT, Y, N, limit, CLAMP: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    pdl_enter()
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    g = tl.load(G + t * N + o, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + t * N + o, mask=m, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    a = tl.div_rn(g, 1.0 + tl.exp(-g)) * u
    if HAS_W:
        a = a * tl.load(WT + t)
    tl.store(Y + t * N + o, a.to(Y.dtype.element_ty), mask=m)


def swiglu_act(gate: torch.Tensor, up: torch.Tensor, limit: float, weight, out_dtype) -> torch.Tensor:
    """``(silu(clamp(gate)) * clamp(up)) [* weight]`` per row in fp32, written in ``out_dtype``."""
    T, N = gate.shape
    y = torch.empty(T, N, dtype=out_dtype, device=gate.device)
    if T and N:
        block = 1024
        launch(swiglu_act_kernel, (T, triton.cdiv(N, block)), gate, up, weight if weight is not None else gate, y, N,
               float(limit), CLAMP=limit > 0, HAS_W=weight is not None, BLOCK=block, num_warps=4)
    return y
