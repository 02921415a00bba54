"""Fast mode's sparse attention for many query rows (Triton): the fused launch with one output
accumulator per column block, rescaled and accumulated in place.

``triton_attention``'s fused kernel fixes the arithmetic for every launch shape: a chunk's
``p @ v`` runs from zero and is folded into the row's sums afterwards, so the split launch (few
rows) and the fused one give a row the same bits. That costs a second ``[heads, D]`` block of
fp32 live per chunk: at 64 heads a program the kernel spills at 255 registers. Fast mode does
not ask for bits that hold across launch shapes, so this kernel keeps the textbook online
softmax instead: ``M' = max(M, max s)``, ``p = 2^(s - M')``, ``L' = L 2^(M - M') + sum p``,
``A' = A 2^(M - M') + p @ v`` with ``A`` the MMA's own accumulator, scores in base 2 (the
scale carries ``log2 e``). Measured on the H200 at V4-Flash widths (64 heads of 512, bf16,
256 rows of 128 + 512 candidates): 176 -> 130 us a call; at 64 rows the table's 16-head
launch stays faster, so this runs only where the bucket table itself picks the 64-head fused
launch (``bench/results/attention_online_h200.json``, ``bench/attention_online.py``).

The reads and writes are ``fused_kernel``'s (the same helpers: index loads per chunk, pool
rows only where ``0 <= idx < N``, stores of the program's heads), so its memory contract is
the one ``specs.sparse_attention`` proves for that launch shape. It stops at a row's last
visible chunk as the fused kernel does.
"""

import triton
import triton.language as tl

from v4stack.kernels.attention_tiles import CHUNK, pick, takes_online
from v4stack.kernels.launch import cdiv, launch
from v4stack.kernels.triton_attention import (_LIVE_BI, ROWS_PER_LAUNCH, _dot, _live_chunks, _logits, _q_blocks, _rows,
                                              _store_blocks, _store_out, blocks)

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _sq(q):
    f = q.to(tl.float32)
    return tl.sum(f * f, 1)


@triton.jit
def _scaled(q, rs):
    return (q.to(tl.float32) * rs).to(q.dtype)


@triton.jit
def _queries(Q, t, h, s_qt, s_qh, H, qeps, D: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr, QN: tl.constexpr):
    q0, q1, q2, q3 = _q_blocks(Q, t, h, s_qt, s_qh, H, KB, NB)
    if QN:
        sq = _sq(q0)
        if NB > 1:
            sq += _sq(q1)
        if NB > 2:
            sq += _sq(q2) + _sq(q3)
        rs = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sq, tl.full(sq.shape, D, tl.float32)) + qeps))[:, None]
        q0, q1, q2, q3 = _scaled(q0, rs), _scaled(q1, rs), _scaled(q2, rs), _scaled(q3, rs)
    return q0, q1, q2, q3


@triton.jit
def _q_scale(Q, t, h, s_qt, s_qh, H, qeps, D: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr, QN: tl.constexpr):
    """The heads' RMS factors ``[BH, 1]`` (1 without QN), the queries read once for them."""
    if QN:
        q0, q1, q2, q3 = _q_blocks(Q, t, h, s_qt, s_qh, H, KB, NB)
        sq = _sq(q0)
        if NB > 1:
            sq += _sq(q1)
        if NB > 2:
            sq += _sq(q2) + _sq(q3)
        rs = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sq, tl.full(sq.shape, D, tl.float32)) + qeps))[:, None]
    else:
        rs = tl.full([h.shape[0], 1], 1.0, tl.float32)
    return rs


@triton.jit
def _chunk_scores(Q, t, h, s_qt, s_qh, H, q0, q1, q2, q3, rs, row, ok, scale2, KB: tl.constexpr, NB: tl.constexpr,
                  IEEE: tl.constexpr, QR: tl.constexpr, QN: tl.constexpr):
    """The chunk's key blocks and base-2 scores. QR: the queries are read again for the chunk (from
    L1 / L2, into shared memory beside the keys, not held in registers across the loop) and the
    RMS factor multiplies the scores instead of the queries."""
    if QR:
        r0, r1, r2, r3 = _q_blocks(Q, t, h, s_qt, s_qh, H, KB, NB)
        k0, k1, k2, k3, s = _logits(r0, r1, r2, r3, row, ok, scale2, KB, NB, IEEE)
        if QN:
            s = s * rs
    else:
        k0, k1, k2, k3, s = _logits(q0, q1, q2, q3, row, ok, scale2, KB, NB, IEEE)
    return k0, k1, k2, k3, s


@triton.jit
def online_cols_kernel(Q, s_qt, s_qh, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1, Sink, O, s_ot, s_oh, H, scale2,
                       NCH, qeps, D: tl.constexpr, BH: tl.constexpr, CH: tl.constexpr, IEEE: tl.constexpr,
                       NB: tl.constexpr, QN: tl.constexpr, DV: tl.constexpr, QR: tl.constexpr = False):
    """``online_kernel`` split by output columns: program (head group x column block, row) keeps
    only the columns ``[j DV, (j + 1) DV)`` of its heads' output (``j`` the column block; a row's
    programs are adjacent, so its candidate rows come from memory once and from L2 for the
    others), reading them again from the chunk's rows for ``p @ v``. The scores run over the
    whole head width in every program: 1 + 1 / (D / DV) of the MMA work, for a ``[BH, DV]``
    accumulator instead of ``[BH, D]``."""
    KB: tl.constexpr = D // NB
    NV: tl.constexpr = D // DV
    t = tl.program_id(1).to(tl.int64)
    h = (tl.program_id(0) // NV) * BH + tl.arange(0, BH)
    dv0 = (tl.program_id(0) % NV) * DV
    if QR:
        rs = _q_scale(Q, t, h, s_qt, s_qh, H, qeps, D, KB, NB, QN)
        q0 = rs
        q1 = rs
        q2 = rs
        q3 = rs
    else:
        q0, q1, q2, q3 = _queries(Q, t, h, s_qt, s_qh, H, qeps, D, KB, NB, QN)
        rs = q0
    M = tl.load(Sink + h, mask=h < H, other=0.0) * _LOG2E
    L = tl.full([BH], 1.0, tl.float32)
    A = tl.zeros([BH, DV], tl.float32)
    for c in range(0, _live_chunks(t, K0, I1, s_i1, K1, N1, NCH, CH, _LIVE_BI)):
        row, ok = _rows(c * CH, t, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1, D, CH)
        k0, k1, k2, k3, s = _chunk_scores(Q, t, h, s_qt, s_qh, H, q0, q1, q2, q3, rs, row, ok, scale2, KB, NB, IEEE,
                                          QR, QN)
        Mn = tl.maximum(M, tl.max(s, 1))
        p = tl.exp2(s - Mn[:, None])
        a = tl.exp2(M - Mn)
        L = L * a + tl.sum(p, 1)
        v = tl.load(row[:, None] + (dv0 + tl.arange(0, DV))[None, :], mask=ok[:, None], other=0.0)
        A = _dot(p.to(v.dtype), v, A * a[:, None], IEEE)
        M = Mn
    _store_out(O, t, h, s_ot, s_oh, H, dv0, A, L, DV)


@triton.jit
def online_kernel(Q, s_qt, s_qh, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1, Sink, O, s_ot, s_oh, H, scale2, NCH,
                  qeps, D: tl.constexpr, BH: tl.constexpr, CH: tl.constexpr, IEEE: tl.constexpr, NB: tl.constexpr,
                  QN: tl.constexpr = False, QR: tl.constexpr = False):
    """QN: each head's query is RMS-normalised first (weightless, ``qeps``; fp32, rounded back to
    the query dtype as the normalisation kernel would store it) in the program's registers, so the
    normalised queries are never written and read back. QR: ``_chunk_scores``' reading of the
    queries per chunk (with QN the factor multiplies the scores: not the rounded normalised
    queries' bits, the same value to the scores' rounding)."""
    KB: tl.constexpr = D // NB
    t = tl.program_id(1).to(tl.int64)
    h = tl.program_id(0) * BH + tl.arange(0, BH)
    if QR:
        rs = _q_scale(Q, t, h, s_qt, s_qh, H, qeps, D, KB, NB, QN)
        q0 = rs
        q1 = rs
        q2 = rs
        q3 = rs
    else:
        q0, q1, q2, q3 = _queries(Q, t, h, s_qt, s_qh, H, qeps, D, KB, NB, QN)
        rs = q0
    M = tl.load(Sink + h, mask=h < H, other=0.0) * _LOG2E  # the sink, in base 2
    L = tl.full([BH], 1.0, tl.float32)
    A0 = tl.zeros([BH, KB], tl.float32)
    A1 = A0
    A2 = A0
    A3 = A0
    for c in range(0, _live_chunks(t, K0, I1, s_i1, K1, N1, NCH, CH, _LIVE_BI)):
        row, ok = _rows(c * CH, t, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1, D, CH)
        k0, k1, k2, k3, s = _chunk_scores(Q, t, h, s_qt, s_qh, H, q0, q1, q2, q3, rs, row, ok, scale2, KB, NB, IEEE,
                                          QR, QN)
        Mn = tl.maximum(M, tl.max(s, 1))
        p = tl.exp2(s - Mn[:, None])
        a = tl.exp2(M - Mn)
        L = L * a + tl.sum(p, 1)
        pv = p.to(k0.dtype)
        A0 = _dot(pv, k0, A0 * a[:, None], IEEE)
        if NB > 1:
            A1 = _dot(pv, k1, A1 * a[:, None], IEEE)
        if NB > 2:
            A2 = _dot(pv, k2, A2 * a[:, None], IEEE)
            A3 = _dot(pv, k3, A3 * a[:, None], IEEE)
        M = Mn
    _store_blocks(O, t, h, s_ot, s_oh, H, 0, A0, A1, A2, A3, L, KB, NB)


def shape_for(T: int, H: int, D: int, force: bool = False) -> dict:
    """The launch of ``T`` rows: heads per program and warps / stages from the bucket table,
    output columns a program (``DV``, 0: all, ``online_kernel``) and candidates a chunk (``CH``)
    from ``SHAPE``."""
    t = pick(T, H)
    bh = t["BH"] if not force else min(64, max(16, 1 << max(0, H - 1).bit_length()))
    dv = SHAPE["DV"]
    ok = 16 <= dv < D and D % dv == 0 and dv & (dv - 1) == 0  # a power-of-two block of the head width
    return dict(BH=bh, DV=dv if ok else 0, CH=SHAPE["CH"], QR=SHAPE.get("QR", False), num_warps=SHAPE.get("num_warps", t["num_warps"]),
                num_stages=SHAPE.get("num_stages", t["num_stages"]))


# DV / CH (and warps / stages, where given) of every online launch
SHAPE = dict(DV=0, CH=CHUNK)


def sparse_attention(q, pools, idx, sink, scale: float, force: bool = False, q_eps: float | None = None,
                     shape: dict | None = None):
    """``ops.sparse_attention`` in fast mode on CUDA (or the interpreter): this kernel where
    ``attention_tiles.takes_online`` (or ``force``), else ``triton_attention``'s launch of the bucket table.
    ``q_eps``: ``fused.normed_sparse_attention`` - the queries RMS-normalised per head first.
    ``shape``: a launch other than ``shape_for``'s (``BH``, ``DV``, ``CH``, ``num_warps``, ``num_stages``)."""
    import torch

    from v4stack.kernels import triton_attention as ta

    T, H, D = q.shape
    if not (force or takes_online(T, H)):
        if q_eps is not None:  # the registration accepts only the online launch's shapes
            raise ValueError(f"sparse_attention: q_eps needs the online launch, not taken at {T} rows x {H} heads")
        return ta.sparse_attention(q, pools, idx, sink, scale)
    p0, i0 = pools[0], idx[0]
    p1, i1 = (pools[1], idx[1]) if len(pools) > 1 else (pools[0], idx[0][:, :0])
    p0, p1 = p0.contiguous(), p1.contiguous()
    i0, i1 = i0.contiguous(), i1.contiguous()
    K0, K1 = i0.shape[1], i1.shape[1]
    out = torch.empty_like(q)
    if T == 0:
        return out
    t = dict(shape_for(T, H, D, force), **(shape or {}))
    bh, dv, ch = t["BH"], t["DV"], t["CH"]
    s_i0 = i0.stride(0) if K0 else 0
    s_i1 = i1.stride(0) if K1 else 0
    nch = cdiv(K0 + K1, ch)
    sink = sink.float().contiguous()
    qr = bool(t.get("QR", False))
    kernel, extra = (online_cols_kernel, dict(DV=dv, QR=qr)) if dv else (online_kernel, dict(QR=qr))
    per_row = cdiv(H, bh) * (D // dv if dv else 1)
    for r0 in range(0, T, ROWS_PER_LAUNCH):
        n = min(ROWS_PER_LAUNCH, T - r0)
        launch(kernel, (per_row, n), q[r0:r0 + n], q.stride(0), q.stride(1), p0, i0[r0:r0 + n], s_i0, K0,
               p0.shape[0], p1, i1[r0:r0 + n], s_i1, K1, p1.shape[0], sink, out[r0:r0 + n], out.stride(0),
               out.stride(1), H, float(scale) * LOG2E, nch, 0.0 if q_eps is None else float(q_eps), D=D, BH=bh,
               CH=ch, IEEE=q.dtype == torch.float32, NB=blocks(D), QN=q_eps is not None, num_warps=t["num_warps"],
               num_stages=t["num_stages"], **extra)
    return out


def normed_sparse_attention(q, pools, idx, sink, scale: float, eps: float):
    """``fused.normed_sparse_attention`` in fast mode on CUDA: the queries' per-head RMS factor
    taken on the loaded queries, in registers."""
    return sparse_attention(q, pools, idx, sink, scale, q_eps=eps)
