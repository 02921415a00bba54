"""Sparse attention over candidate indices (Triton): rows are read from the cache pools by index,
never gathered into a copy.

The arithmetic is fixed by the candidate list alone. Candidates (pool 0's columns, then pool
1's) are cut into chunks of ``CHUNK`` = 64. Each chunk is one block: its scores
``q . k * scale`` (one MMA over the head width), a chunk maximum ``m_c = max(sink, scores)``,
``p = exp(s - m_c)``, ``l_c = sum p`` (a pairwise tree with fixed pairs), ``acc_c = p @ v`` (one
MMA over the chunk). Chunks are then merged in order, starting from the sink alone
``(M, L, A) = (sink, 1, 0)``: ``M' = max(M, m_c)``, ``L' = L e^(M - M') + l_c e^(m_c - M')``,
``A' = A e^(M - M') + acc_c e^(m_c - M')``; the output is ``A / L``. A hidden candidate (``-1``)
scores ``-inf`` and adds exact zeros, and an all-hidden chunk merges as the identity, so trailing
``-1`` columns change no bit - and the fused launch does not run them: a row stops at the chunk of
its last visible candidate (a 1k-token context's padded top-k list then costs its 256 entries,
not 512).

Launch shapes (``attention_tiles``) change which program computes a (row, head) and never its
arithmetic: ``split`` (few query rows, e.g. decode) runs one program per (head group, chunk,
row) and a second kernel merges the chunks in order - so one row fills the SMs; ``fused`` (many
rows) runs one program per (head group, column block, row) that merges as it goes. A row's
programs are adjacent in launch order, so the candidate rows it reads come from memory once and
from L2 for its other head groups. Which shape runs depends on the batch, the bits do not
(checked on the GPU by ``bench/attention_tiles.py`` for every candidate, and by
``bench/ops_gpu_check.py`` through the dispatch table).
"""
import triton
import triton.language as tl

from v4stack.kernels.attention_tiles import CHUNK, LIVE_BI, pick
from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import cdiv, launch

_LIVE_BI = tl.constexpr(LIVE_BI)


@triton.jit
def _halve(x, N: tl.constexpr):
    a, b = tl.split(tl.reshape(x, [x.shape[0], N // 2, 2]))
    return a + b


@triton.jit
def _row_sum(p, CH: tl.constexpr):
    """``sum(p, 1)`` as a pairwise tree with fixed pairs ((0 + 1) + (2 + 3)) + ...: each level adds
    two values (commutative, so exact whatever the layout), so the bits never depend on how the
    compiler spreads the chunk over threads - any launch shape gives the same row sum."""
    tl.static_assert(CH == 64)
    x = _halve(_halve(_halve(_halve(_halve(p, 64), 32), 16), 8), 4)
    a, b = tl.split(x)
    return a + b


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _rows(c0, t, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1, D: tl.constexpr, CH: tl.constexpr):
    """Chunk ``[c0, c0 + CH)``'s candidates: each one's pool-row pointer and whether it is one."""
    j = c0 + tl.arange(0, CH)
    in0 = j < K0
    in1 = (j >= K0) & (j < K0 + K1)
    r0 = tl.load(I0 + t * s_i0 + j, mask=in0, other=-1).to(tl.int64)
    r1 = tl.load(I1 + t * s_i1 + (j - K0), mask=in1, other=-1).to(tl.int64)
    v0 = in0 & (r0 >= 0) & (r0 < N0)  # an index outside [0, N) is no candidate: never read
    v1 = in1 & (r1 >= 0) & (r1 < N1)
    return tl.where(v0, P0 + r0 * D, P1 + r1 * D), v0 | v1  # one gather: pool 0's row or pool 1's


@triton.jit
def _cols(row, ok, c0, W: tl.constexpr):
    """Columns ``[c0, c0 + W)`` of the chunk's candidate rows (zeros for no candidate)."""
    return tl.load(row[:, None] + (c0 + tl.arange(0, W))[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _logits(q0, q1, q2, q3, row, ok, scale, KB: tl.constexpr, NB: tl.constexpr, IEEE: tl.constexpr):
    """The chunk's ``NB`` column blocks of ``KB`` (together the head width) and its scores
    ``q . k * scale`` (``-inf`` for no candidate) as one MMA chain over the blocks in order (the K
    steps of one MMA over the head width, in the same order)."""
    k0 = _cols(row, ok, 0, KB)
    s = _dot(q0, tl.trans(k0), None, IEEE)
    k1 = k0
    k2 = k0
    k3 = k0
    if NB > 1:
        k1 = _cols(row, ok, KB, KB)
        s = _dot(q1, tl.trans(k1), s, IEEE)
    if NB > 2:
        k2 = _cols(row, ok, 2 * KB, KB)
        s = _dot(q2, tl.trans(k2), s, IEEE)
        k3 = _cols(row, ok, 3 * KB, KB)
        s = _dot(q3, tl.trans(k3), s, IEEE)
    return k0, k1, k2, k3, tl.where(ok[None, :], s * scale, float("-inf"))


@triton.jit
def _scores(q0, q1, q2, q3, row, ok, sink, scale, KB: tl.constexpr, NB: tl.constexpr, IEEE: tl.constexpr):
    """``_logits``' blocks, the chunk maximum ``m = max(sink, scores)`` and ``p = exp(s - m)``."""
    k0, k1, k2, k3, s = _logits(q0, q1, q2, q3, row, ok, scale, KB, NB, IEEE)
    m = tl.maximum(sink, tl.max(s, 1))
    p = tl.exp(s - m[:, None])
    return k0, k1, k2, k3, m, p


@triton.jit
def _pv(p, k, row, ok, c0, VB: tl.constexpr, OWN: tl.constexpr, IEEE: tl.constexpr):
    """``p @ v`` for output columns ``[c0, c0 + VB)``: one MMA over the chunk, from zero. ``OWN``:
    those columns are a block the scores loaded (``k``); else they are read again."""
    v = k
    if not OWN:
        v = _cols(row, ok, c0, VB)
    if IEEE:
        return _dot(p, v, None, IEEE)
    else:
        return _dot(p.to(v.dtype), v, None, IEEE)


@triton.jit
def _fold(A, acc, a, b, keep):
    """One output block's merge, ``A e^(M - M') + acc e^(m - M')``. A chunk with ``l = 0`` (all
    hidden) keeps ``A`` outright, so not even a ``-0`` turns ``+0``: skipping such a chunk is the
    same as merging it."""
    return tl.where(keep[:, None], A * a[:, None] + acc * b[:, None], A)


@triton.jit
def _live_chunks(t, K0, I1, s_i1, K1, N1, NCH, CH: tl.constexpr, BI: tl.constexpr):
    """How many chunks a row must run: up to the chunk of its last candidate that pool 1 can
    show (pool 0's columns all count). The chunks after it are all hidden and merge as the
    identity (``_fold``), so stopping there changes no bit; a short context's padded candidate
    list then costs what its visible entries cost."""
    last = K0
    for b0 in range(0, K1, BI):
        j = b0 + tl.arange(0, BI)
        r = tl.load(I1 + t * s_i1 + j, mask=j < K1, other=-1)
        last = tl.maximum(last, tl.max(tl.where((r >= 0) & (r < N1), K0 + j + 1, 0), 0))
    return tl.minimum(tl.cdiv(last, CH), NCH)


@triton.jit
def _load_q(Q, t, h, s_qt, s_qh, H, c0, KB: tl.constexpr):
    d = c0 + tl.arange(0, KB)
    return tl.load(Q + t * s_qt + h[:, None] * s_qh + d[None, :], mask=(h < H)[:, None], other=0.0)


@triton.jit
def _q_blocks(Q, t, h, s_qt, s_qh, H, KB: tl.constexpr, NB: tl.constexpr):
    q0 = _load_q(Q, t, h, s_qt, s_qh, H, 0, KB)
    q1 = q0
    q2 = q0
    q3 = q0
    if NB > 1:
        q1 = _load_q(Q, t, h, s_qt, s_qh, H, KB, KB)
    if NB > 2:
        q2 = _load_q(Q, t, h, s_qt, s_qh, H, 2 * KB, KB)
        q3 = _load_q(Q, t, h, s_qt, s_qh, H, 3 * KB, KB)
    return q0, q1, q2, q3


@triton.jit
def _store_out(O, t, h, s_ot, s_oh, H, c0, A, L, VB: tl.constexpr):
    d = c0 + tl.arange(0, VB)
    out = tl.div_rn(A, L[:, None])
    tl.store(O + t * s_ot + h[:, None] * s_oh + d[None, :], out.to(O.dtype.element_ty), mask=(h < H)[:, None])


@triton.jit
def _store_blocks(O, t, h, s_ot, s_oh, H, c0, A0, A1, A2, A3, L, VB: tl.constexpr, NB: tl.constexpr):
    """The ``NB`` output blocks of ``VB`` columns from column ``c0``, each divided by ``L``."""
    _store_out(O, t, h, s_ot, s_oh, H, c0, A0, L, VB)
    if NB > 1:
        _store_out(O, t, h, s_ot, s_oh, H, c0 + VB, A1, L, VB)
    if NB > 2:
        _store_out(O, t, h, s_ot, s_oh, H, c0 + 2 * VB, A2, L, VB)
        _store_out(O, t, h, s_ot, s_oh, H, c0 + 3 * VB, A3, L, VB)


@triton.jit
def fused_kernel(Q, s_qt, s_qh, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1, Sink, O, s_ot, s_oh, H, scale, NCH,
                 D: tl.constexpr, BH: tl.constexpr, CH: tl.constexpr, IEEE: tl.constexpr, DV: tl.constexpr,
                 NB: tl.constexpr):
    # program (head group x column block, row): a row's programs are adjacent, so its candidate
    # rows are read from memory once and from L2 by the others. The head width is read in NB
    # column blocks and the output kept as NB accumulators of DV / NB columns, each merged right
    # after its MMA, so no [BH, DV] fp32 block is ever live twice.
    pdl_enter()
    KB: tl.constexpr = D // NB
    VB: tl.constexpr = DV // NB
    OWN: tl.constexpr = DV == D
    t = tl.program_id(1).to(tl.int64)
    h = (tl.program_id(0) // (D // DV)) * BH + tl.arange(0, BH)
    dv0 = (tl.program_id(0) % (D // DV)) * DV
    q0, q1, q2, q3 = _q_blocks(Q, t, h, s_qt, s_qh, H, KB, NB)
    sink = tl.load(Sink + h, mask=h < H, other=0.0)
    M = sink
    L = tl.full([BH], 1.0, tl.float32)
    A0 = tl.zeros([BH, VB], tl.float32)
    A1 = A0
    A2 = A0
    A3 = A0
    for c in range(0, _live_chunks(t, K0, I1, s_i1, K1, N1, NCH, CH, _LIVE_BI)):
        row, ok = _rows(c * CH, t, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1, D, CH)
        k0, k1, k2, k3, m, p = _scores(q0, q1, q2, q3, row, ok, sink, scale, KB, NB, IEEE)
        ls = _row_sum(p, CH)
        Mn = tl.maximum(M, m)
        a = tl.exp(M - Mn)
        b = tl.exp(m - Mn)
        keep = ls > 0
        A0 = _fold(A0, _pv(p, k0, row, ok, dv0, VB, OWN, IEEE), a, b, keep)
        if NB > 1:
            A1 = _fold(A1, _pv(p, k1, row, ok, dv0 + VB, VB, OWN, IEEE), a, b, keep)
        if NB > 2:
            A2 = _fold(A2, _pv(p, k2, row, ok, dv0 + 2 * VB, VB, OWN, IEEE), a, b, keep)
            A3 = _fold(A3, _pv(p, k3, row, ok, dv0 + 3 * VB, VB, OWN, IEEE), a, b, keep)
        L = L * a + ls * b
        M = Mn
    _store_blocks(O, t, h, s_ot, s_oh, H, dv0, A0, A1, A2, A3, L, VB, NB)


@triton.jit
def _store_part(Pa, base, hm, c0, acc, D: tl.constexpr, KB: tl.constexpr):
    d = c0 + tl.arange(0, KB)
    tl.store(Pa + base[:, None] * D + d[None, :], acc, mask=hm[:, None])


@triton.jit
def split_kernel(Q, s_qt, s_qh, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1, Sink, Pm, Pl, Pa, H, scale, NCH,
                 D: tl.constexpr, BH: tl.constexpr, CH: tl.constexpr, IEEE: tl.constexpr, NB: tl.constexpr):
    pdl_enter()
    KB: tl.constexpr = D // NB
    t = tl.program_id(2).to(tl.int64)
    h = tl.program_id(0) * BH + tl.arange(0, BH)
    c = tl.program_id(1)
    hm = h < H
    q0, q1, q2, q3 = _q_blocks(Q, t, h, s_qt, s_qh, H, KB, NB)
    sink = tl.load(Sink + h, mask=hm, other=0.0)
    row, ok = _rows(c * CH, t, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1, D, CH)
    k0, k1, k2, k3, m, p = _scores(q0, q1, q2, q3, row, ok, sink, scale, KB, NB, IEEE)
    base = (t * NCH + c) * H + h
    tl.store(Pm + base, m, mask=hm)
    tl.store(Pl + base, _row_sum(p, CH), mask=hm)
    _store_part(Pa, base, hm, 0, _pv(p, k0, row, ok, 0, KB, True, IEEE), D, KB)
    if NB > 1:
        _store_part(Pa, base, hm, KB, _pv(p, k1, row, ok, KB, KB, True, IEEE), D, KB)
    if NB > 2:
        _store_part(Pa, base, hm, 2 * KB, _pv(p, k2, row, ok, 2 * KB, KB, True, IEEE), D, KB)
        _store_part(Pa, base, hm, 3 * KB, _pv(p, k3, row, ok, 3 * KB, KB, True, IEEE), D, KB)


@triton.jit
def merge_kernel(Pm, Pl, Pa, Sink, O, s_ot, s_oh, H, NCH, D: tl.constexpr, BH: tl.constexpr):
    pdl_enter()
    t = tl.program_id(1).to(tl.int64)
    h = tl.program_id(0) * BH + tl.arange(0, BH)
    d = tl.arange(0, D)
    sink = tl.load(Sink + h, mask=h < H, other=0.0)
    M = sink
    L = tl.full([BH], 1.0, tl.float32)
    A = tl.zeros([BH, D], tl.float32)
    for c in range(0, NCH):
        base = (t * NCH + c) * H + h
        m = tl.load(Pm + base, mask=h < H, other=0.0)
        ls = tl.load(Pl + base, mask=h < H, other=0.0)
        acc = tl.load(Pa + base[:, None] * D + d[None, :], mask=(h < H)[:, None], other=0.0)
        Mn = tl.maximum(M, m)
        a = tl.exp(M - Mn)
        b = tl.exp(m - Mn)
        A = _fold(A, acc, a, b, ls > 0)
        L = L * a + ls * b
        M = Mn
    _store_out(O, t, h, s_ot, s_oh, H, 0, A, L, D)


def blocks(D: int) -> int:
    """Column blocks of the head width (each at least 16 wide, the MMA's K step)."""
    return max(1, min(4, D // 16))


ROWS_PER_LAUNCH = 65535  # grid dims y and z hold the rows: a larger call is launched in row blocks


def sparse_attention(q, pools, idx, sink, scale: float, path: str | None = None, tiles=None):
    """``ops.sparse_attention`` for one or two pools on CUDA (or the interpreter). ``path`` forces
    the launch shape; ``tiles`` replaces the bucket table (the GPU bench times its candidates)."""
    import torch

    T, H, D = q.shape
    p0, i0 = pools[0], idx[0]
    p1, i1 = (pools[1], idx[1]) if len(pools) > 1 else (pools[0], idx[0][:, :0])
    p0, p1 = p0.contiguous(), p1.contiguous()
    i0, i1 = i0.contiguous(), i1.contiguous()
    K0, K1 = i0.shape[1], i1.shape[1]
    nch = cdiv(K0 + K1, CHUNK)
    out = torch.empty_like(q)
    if T == 0:
        return out
    t = pick(T, H, tiles)
    bh, hg = t["BH"], cdiv(H, t["BH"])
    sink = sink.float().contiguous()
    ieee = q.dtype == torch.float32
    s_i0 = i0.stride(0) if K0 else 0
    s_i1 = i1.stride(0) if K1 else 0
    path = path or t["path"]
    nb = blocks(D)
    kw = dict(num_warps=t["num_warps"], num_stages=t["num_stages"])
    for r0 in range(0, T, ROWS_PER_LAUNCH):  # rows never mix: a block's rows get the bits they get alone
        n = min(ROWS_PER_LAUNCH, T - r0)
        qs, os_, j0, j1 = q[r0:r0 + n], out[r0:r0 + n], i0[r0:r0 + n], i1[r0:r0 + n]
        head = (qs, q.stride(0), q.stride(1), p0, j0, s_i0, K0, p0.shape[0], p1, j1, s_i1, K1, p1.shape[0], sink)
        if path == "fused" or nch == 0:
            dv = min(t["DV"] or D, D)
            launch(fused_kernel, (hg * (D // dv), n), *head, os_, out.stride(0), out.stride(1), H, float(scale), nch,
                   D=D, BH=bh, CH=CHUNK, IEEE=ieee, DV=dv, NB=nb, **kw)
            continue
        pm = torch.empty(n, nch, H, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pa = torch.empty(n, nch, H, D, dtype=torch.float32, device=q.device)
        launch(split_kernel, (hg, nch, n), *head, pm, pl, pa, H, float(scale), nch, D=D, BH=bh, CH=CHUNK, IEEE=ieee,
               NB=nb, **kw)
        launch(merge_kernel, (hg, n), pm, pl, pa, sink, os_, out.stride(0), out.stride(1), H, nch, D=D, BH=bh,
               num_warps=t["merge_warps"])
    return out


def attention_with_sink(q, keys, mask, sink, scale: float, tiles=None):
    """Dense candidates ``keys [T, K, D]`` with ``mask [T, K]`` as one pool of ``T * K`` rows,
    each row's candidates its own ``K`` rows (``-1`` where hidden): the same kernel, no copy."""
    import torch

    T, K, D = keys.shape
    rows = torch.arange(T * K, device=q.device, dtype=torch.int32).view(T, K)
    idx = torch.where(mask, rows, torch.full_like(rows, -1))
    return sparse_attention(q, [keys.reshape(T * K, D)], [idx], sink, scale, tiles=tiles)
