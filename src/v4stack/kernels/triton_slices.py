"""The fixed-K-slice GEMM of the invariant kernels (Triton): bf16 / fp16 linear, fp32 linear and
the mHC projection ``hc_mix`` are one kernel, ``slices_kernel``.

The K rule (a function of K alone, never of M or of the tile): K is cut into slices of
``SPLIT`` (``tiles.HALF_SPLIT`` for bf16 / fp16, ``tiles.F32_SPLIT`` for fp32); each slice is
one tensor-core MMA chain from a zero start, in K order, into fp32 registers; an output element
is ``((0 + P0) + P1) + ...`` over its slices in order, rounded once to the output dtype. Which
program computes a slice, and whether the slices of a tile are summed in registers (``fused``) or
spread over the grid (``grid``: program ``(m, n, s)`` stores slice ``s`` as an fp32 partial; the
tile's last program to arrive sums the partials in slice order), changes no bit of the result.

Float semantics (``FLOAT_SEMANTICS``, checked in the PTX by ``tests/ops/test_triton_builds.py``):

- bf16 / fp16: ``wgmma`` 16-wide steps, fp32 accumulation, one rounding at the end.
- fp32: **3xTF32** on the tensor cores: each operand is split as ``x = hi + lo`` with ``hi`` the
  TF32 truncation of ``x`` and ``lo`` the TF32 rounding of the rest; per K step of ``tiles.F32_BK``
  the products ``lo*hi_w``, ``hi*lo_w``, ``hi*hi_w`` are chained from zero on the tensor cores and
  the step is added to the slice's sum in IEEE fp32 (so the tensor cores' truncating accumulation
  spans one step only). The dropped ``lo*lo`` term and ``lo``'s rounding leave about 2^-21 per
  product; the error is measured against cuBLAS SGEMM's on the GPU (``bench/gemm_tiles.py``) and
  against float64 on the CPU (``tests/ops/test_slices.py``). The split is done in the kernel with
  integer masks, so the tensor cores see TF32-exact inputs (no hardware rounding choice enters).
  ``rms`` (hc_mix) also sums ``x^2`` per row: per lane ``k mod F32_BK`` an fp32 chain over the
  slice's steps, then the lanes summed by an MMA with ones (an order the hardware fixes, the same
  for fp32 and bf16 inputs), the slices in order.

The grid form counts arrivals per output tile in ``counters(device)`` (int32, zero between
launches: the last program resets its tile's count) and keeps its partials in ``workspace(device,
n)``; both are held per stream (the current one's), so grid-form launches on a side stream (a CSA
layer's indexer, ``model.side``) never share them with the main stream's, which run concurrently.
"""

import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter

FLOAT_SEMANTICS = {
    "linear_half": "wgmma bf16/fp16 products, fp32 accumulation in fixed K slices (tiles.HALF_SPLIT), one rounding",
    "linear_fp32": "3xTF32 (lo*hi + hi*lo + hi*hi per K step of tiles.F32_BK on the tensor cores, TF32-exact "
                   "operands split in the kernel), steps and slices (tiles.F32_SPLIT) added in IEEE fp32; no fast math",
    "hc_mix": "as linear_fp32; sum of squares: per-lane fp32 chains over a slice, lanes summed by a 2xTF32 MMA "
              "with ones, slices in order; 1/sqrt correctly rounded",
}

COUNTERS = 1 << 16  # output tiles one grid-form launch may count; more tiles take the fused form
WORKSPACE = 1 << 23  # fp32 partials kept per device between calls (32 MiB); larger ones are allocated per call
_counters: dict = {}
_workspace: dict = {}
_retired: list = []


def _stream_key(device):
    """``(device, the current stream's handle)``: the grid form's scratch is the current stream's."""
    import torch

    dev = torch.device(device)
    return dev, (torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0)


def workspace(device, n: int):
    """``n`` fp32 of scratch for the grid form's partials. Up to ``WORKSPACE`` one buffer per device
    and stream is reused (calls on one stream run one after another); a grown buffer keeps the old
    one alive, so a CUDA graph captured with it never points at freed memory."""
    import torch

    if n > WORKSPACE:
        return torch.empty(n, dtype=torch.float32, device=device)
    key = _stream_key(device)
    w = _workspace.get(key)
    if w is None or w.numel() < n:
        if w is not None:
            _retired.append(w)
        w = _workspace[key] = torch.empty(min(WORKSPACE, max(n, 2 * (w.numel() if w is not None else 0), 1 << 16)),
                                          dtype=torch.float32, device=device)
    return w


def counters(device):
    """The arrival counters of the grid form, one set per device and stream (allocated zeroed once,
    reset by the kernel)."""
    key = _stream_key(device)
    c = _counters.get(key)
    if c is None:
        import torch

        c = _counters[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return c


@triton.jit
def _tf32_split(x):
    """``x = hi + lo`` (to about 2^-22 relative): ``hi`` the TF32 truncation, ``lo`` the rest rounded
    to TF32 (half away from zero); both exact in TF32."""
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    lo = (((x - hi).to(tl.int32, bitcast=True) + 4096) & -8192).to(tl.float32, bitcast=True)
    return hi, lo


@triton.jit
def _mma(a, b, acc, TF32X3: tl.constexpr):
    """One K step. bf16 / fp16: the MMA chain continues in ``acc``. fp32: the step's three TF32
    products (``lo*hi``, ``hi*lo``, ``hi*hi``) chained from zero, then added to ``acc`` in IEEE fp32
    (the tensor cores' own accumulation then spans one step only). A bf16 / fp16 ``a`` under
    TF32X3 (``hc_pre`` reading the streams) has ``lo = 0``: its first product is all zeros and is
    skipped, the chain then starting from zero at ``hi*lo_w`` as it would after adding zeros."""
    if TF32X3:
        bh, bl = _tf32_split(b)
        if a.dtype == tl.float32:
            ah, al = _tf32_split(a)
            step = tl.dot(al, bh, input_precision="tf32")
            step = tl.dot(ah, bl, step, input_precision="tf32")
        else:  # a bf16 / fp16 value is exact in TF32: its lo, and the lo*hi_w product, are zero
            ah = a.to(tl.float32)
            step = tl.dot(ah, bl, input_precision="tf32")
        step = tl.dot(ah, bh, step, input_precision="tf32")
        acc = acc + step
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _row_sum(sq, BM: tl.constexpr, BK: tl.constexpr):
    """``sum_k sq[m, k]`` as an MMA with a column of ones (``sq`` split as in 3xTF32: ``hi`` then
    ``lo``, both exact in TF32): the hardware fixes the order, whatever register layout ``sq`` has
    (a ``tl.sum`` tree follows the layout, which differs between an fp32 and a bf16 load)."""
    hi, lo = _tf32_split(sq)
    ones = tl.full([BK, 16], 1.0, tl.float32)
    d = tl.dot(lo, ones, input_precision="tf32")
    d = tl.dot(hi, ones, d, input_precision="tf32")
    return tl.sum(tl.where(tl.arange(0, 16)[None, :] == 0, d, 0.0), 1)  # column 0 (+ exact zeros)


@triton.jit
def _slice(X, W, rows, rmask, cols, cmask, k0, kend, s_xm, s_wn, BM: tl.constexpr, BN: tl.constexpr,
           BK: tl.constexpr, TF32X3: tl.constexpr, RMS: tl.constexpr):
    """One K slice ``[k0, kend)`` of the tile from zero: its MMA chain, and if RMS ``sum x^2`` of
    its rows (per lane ``k mod BK`` an fp32 chain over the steps, then ``_row_sum``)."""
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    sq = tl.zeros([BM, BK], tl.float32)
    for k in range(k0, kend, BK):
        km = (k + kk) < kend
        a = tl.load(X + rows[:, None] * s_xm + (k + kk)[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        b = tl.load(W + cols[None, :] * s_wn + (k + kk)[:, None], mask=cmask[None, :] & km[:, None], other=0.0)
        acc = _mma(a, b, acc, TF32X3)
        if RMS:
            af = a.to(tl.float32)
            sq = sq + af * af
    if RMS:
        ss = _row_sum(sq, BM, BK)
    else:
        ss = tl.zeros([BM], tl.float32)
    return acc, ss


@triton.jit
def _finish(total, tss, Kf, eps, RMS: tl.constexpr):
    if RMS:
        total = total * tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tss, Kf) + eps))[:, None]
    return total


@triton.jit
def fold(P, PSS, rows, rmask, cols, omask, M, N, S, BM: tl.constexpr, BN: tl.constexpr, RMS: tl.constexpr,
         UNR: tl.constexpr, CG: tl.constexpr):
    """``((0 + P[0]) + P[1]) + ...`` over the S slice partials of the elements (rows, cols), in
    slice order (and the same for ``PSS`` of the rows if RMS): UNR partials' loads issued, then
    added one after another. CG: the loads' cache modifier (``.cg`` within the launch that wrote
    the partials, where they are ordered after the arrival's acquire; plain in a later launch,
    which lets the compiler issue them together)."""
    total = tl.zeros([BM, BN], tl.float32)
    tss = tl.zeros([BM], tl.float32)
    for j0 in range(0, S, UNR):
        for u in tl.static_range(UNR):
            j = j0 + u
            live = j < S
            part = tl.load(P + (j * M + rows)[:, None] * N + cols[None, :], mask=omask & live, other=0.0,
                           cache_modifier=CG)
            total = tl.where(live, total + part, total)
            if RMS:
                pss = tl.load(PSS + j * M + rows, mask=rmask & live, other=0.0, cache_modifier=CG)
                tss = tl.where(live, tss + pss, tss)
    return total, tss


@triton.jit
def _add_in_order(t, x, A: tl.constexpr, B: tl.constexpr, W: tl.constexpr):
    """``t + x[..., 0] + x[..., 1] + ... + x[..., W - 1]``, added in that order (``x [A, B, W]``, W a
    power of two). The columns are taken apart by reshapes and splits (exact moves, no
    arithmetic), halves first: the leaves come out in column order."""
    if W == 1:
        return t + tl.reshape(x, [A, B])
    else:
        lo, hi = tl.split(tl.permute(tl.reshape(x, [A, B, 2, W // 2]), (0, 1, 3, 2)))
        return _add_in_order(_add_in_order(t, lo, A, B, W // 2), hi, A, B, W // 2)


@triton.jit
def finish_kernel(P, PSS, Y, M, N, MN, Kf, eps, s_ym, S: tl.constexpr, SP: tl.constexpr, FR: tl.constexpr,
                  BN: tl.constexpr, RMS: tl.constexpr):
    """The second launch of the TWO grid form: program (m, n) adds the S partials of FR rows x BN
    columns in slice order, one element per thread. All S loads of an element are one [.., SP]
    load (SP = S rounded up to a power of two; the slices past S read as +0.0, which changes no
    sum: a sum started from +0.0 is never -0.0), so they are in flight together; the adds then
    take the columns in order (``_add_in_order``). MN = M * N, the partials' slice stride."""
    pdl_enter()
    _finish_rows(P, PSS, Y, M, N, MN, Kf, eps, s_ym, tl.program_id(0), tl.program_id(1), S, SP, FR, BN, RMS)


@triton.jit
def _finish_rows(P, PSS, Y, M, N, MN, Kf, eps, s_ym, pm, pn, S: tl.constexpr, SP: tl.constexpr, FR: tl.constexpr,
                 BN: tl.constexpr, RMS: tl.constexpr):
    """``finish_kernel``'s work for its program ``(pm, pn)`` (also run by ``triton_mhc``'s fused split)."""
    rows = (pm * FR + tl.arange(0, FR)).to(tl.int64)
    cols = pn * BN + tl.arange(0, BN)
    rmask = rows < M
    omask = rmask[:, None] & (cols < N)[None, :]
    j = tl.arange(0, SP).to(tl.int64)
    jm = (j < S)[None, None, :]
    x = tl.load(P + (rows[:, None] * N + cols[None, :])[:, :, None] + j[None, None, :] * MN,
                mask=omask[:, :, None] & jm, other=0.0)
    total = _add_in_order(tl.zeros([FR, BN], tl.float32), x, FR, BN, SP)
    if RMS:  # each row's slices, loaded per element too (one address across a row's threads)
        q = tl.load(PSS + rows[:, None, None] + cols[None, :, None] * 0 + j[None, None, :] * M,
                    mask=omask[:, :, None] & jm, other=0.0)
        tss = _add_in_order(tl.zeros([FR, BN], tl.float32), q, FR, BN, SP)
        total = total * tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tss, Kf) + eps))
    tl.store(Y + rows[:, None] * s_ym + cols[None, :], total.to(Y.dtype.element_ty), mask=omask)


@triton.jit
def slices_kernel(X, W, Y, P, PSS, CNT, M, N, K, Kf, eps, s_xm, s_wn, s_ym, SPLIT: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, TF32X3: tl.constexpr, RMS: tl.constexpr, GRID: tl.constexpr,
                  UNR: tl.constexpr, TWO: tl.constexpr):
    """``Y[M, N] = X[M, K] @ W[N, K]^T`` (times ``1 / sqrt(mean x^2 + eps)`` per row if RMS).
    GRID: program (m, n, s) computes slice s into ``P[s, M, N]`` (``PSS[s, M]``), the tile's last
    arrival sums them in slice order (``UNR`` partials' loads in flight at once), or with TWO
    ``finish_kernel`` does; else program (m, n) sums its slices in registers."""
    pdl_enter()
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rows = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    cols = pn * BN + tl.arange(0, BN)
    rmask = rows < M
    cmask = cols < N
    omask = rmask[:, None] & cmask[None, :]
    total = tl.zeros([BM, BN], tl.float32)
    tss = tl.zeros([BM], tl.float32)
    if GRID:
        s = tl.program_id(2)
        S = tl.num_programs(2)
        k0 = s * SPLIT
        acc, ss = _slice(X, W, rows, rmask, cols, cmask, k0, tl.minimum(k0 + SPLIT, K), s_xm, s_wn, BM, BN, BK,
                         TF32X3, RMS)
        tl.store(P + (s * M + rows)[:, None] * N + cols[None, :], acc, mask=omask)
        if RMS:
            tl.store(PSS + s * M + rows, ss, mask=rmask)  # RMS: one N tile (N <= BN), one writer
        if not TWO:  # TWO: ``finish_kernel``, launched next, adds the partials
            tl.debug_barrier()  # every thread's partial is written before the arrival is released
            tile = CNT + pm * tl.num_programs(1) + pn
            if tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == S - 1:  # the last of the S slices
                tl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")  # zero again for the next launch
                total, tss = fold(P, PSS, rows, rmask, cols, omask, M, N, S, BM, BN, RMS, UNR, ".cg")
                total = _finish(total, tss, Kf, eps, RMS)
                tl.store(Y + rows[:, None] * s_ym + cols[None, :], total.to(Y.dtype.element_ty), mask=omask)
    else:
        for k0 in range(0, K, SPLIT):
            acc, ss = _slice(X, W, rows, rmask, cols, cmask, k0, tl.minimum(k0 + SPLIT, K), s_xm, s_wn, BM, BN, BK,
                             TF32X3, RMS)
            total += acc
            if RMS:
                tss += ss
        total = _finish(total, tss, Kf, eps, RMS)
        tl.store(Y + rows[:, None] * s_ym + cols[None, :], total.to(Y.dtype.element_ty), mask=omask)


FINISH_BN = 32  # columns per program of ``finish_kernel``


def run(a, w, y, tile: dict, split: int, tf32x3: bool, rms_eps=None, finish=None):
    """Launch ``slices_kernel`` for ``y = a @ w.T`` (``a [M, K]``, ``w [N, K]`` rows contiguous,
    ``y [M, N]``); ``rms_eps``: hc_mix's RMS factor with that eps. The grid form is used when the
    tile asks for it, K has more than one slice and the tiles fit the counters; with ``two`` its
    partials are added by ``finish_kernel`` (``fr`` rows per program) instead of each tile's last
    program. ``unroll``: partials the last program loads at once while adding them. ``finish``: a
    callable ``(p, pss, S)`` that launches its own kernel for that sum instead; then its return
    value is returned (None where the tile does not take the two-launch form)."""
    from v4stack.kernels.launch import cdiv, launch, next_pow2

    M, K = a.shape
    N = w.shape[0]
    gm, gn, S = cdiv(M, tile["BM"]), cdiv(N, tile["BN"]), cdiv(K, split)
    grid = tile.get("grid", False) and S > 1 and gm * gn <= COUNTERS
    two = grid and tile.get("two", False)
    rms = rms_eps is not None
    unr = tile.get("unroll", 8)
    if grid:
        dev = a.device
        ws = workspace(dev, S * M * (N + 1))
        p, pss, cnt = ws, ws[S * M * N:], counters(dev)
    else:
        p = pss = cnt = y
    launch(slices_kernel, (gm, gn, S) if grid else (gm, gn), a, w, y, p, pss, cnt, M, N, K, float(K),
           float(rms_eps or 0.0), a.stride(0), w.stride(0), y.stride(0), SPLIT=split, BM=tile["BM"], BN=tile["BN"],
           BK=tile["BK"], TF32X3=tf32x3, RMS=rms, GRID=grid, UNR=8 if two else unr, TWO=two, num_warps=tile["num_warps"],
           num_stages=tile["num_stages"])
    if two and finish is not None:
        return finish(p, pss, S)
    if two:
        finish_sum(p, pss, y, S, K, rms_eps, tile.get("fr", 4))
    return y if finish is None else None


def finish_sum(p, pss, y, S: int, K: int, rms_eps=None, fr: int = 4):
    """``finish_kernel`` over partials ``p [S, M, N]`` (and ``pss [S, M]`` with ``rms_eps``: the RMS
    factor) into ``y [M, N]``: each element's S slices added in slice order, ``fr`` rows a program."""
    from v4stack.kernels.launch import cdiv, launch, next_pow2

    M, N = y.shape
    launch(finish_kernel, (cdiv(M, fr), cdiv(N, FINISH_BN)), p, pss, y, M, N, M * N, float(K),
           float(rms_eps or 0.0), y.stride(0), S=S, SP=next_pow2(S), FR=fr, BN=FINISH_BN, RMS=rms_eps is not None,
           num_warps=max(1, fr * FINISH_BN // 32), num_stages=1)
