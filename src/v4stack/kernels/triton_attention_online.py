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
from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import cdiv, launch
from v4stack.kernels.triton_attention import (_LIVE_BI, ROWS_PER_LAUNCH, _dot, _live_chunks, _logits, _q_blocks, _rows,
                                              _store_blocks, blocks)

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
def online_kernel(Q, s_qt, s_qh, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1, Sink, O, s_ot, s_oh, H, scale2, NCH,
                  qeps, D: tl.constexpr, BH: tl.constexpr, CH: tl.constexpr, IEEE: tl.constexpr, NB: tl.constexpr,
                  QN: tl.constexpr = False):
    """QN: each head's query is RMS-normalised first (weightless, ``qeps``; fp32, rounded back to
    the query dtype as the normalisation kernel would store it) in the program's registers, so the
    normalised queries are never written and read back."""
    pdl_enter()
    KB: tl.constexpr = D // NB
    t = tl.program_id(1).to(tl.int64)
    h = tl.program_id(0) * BH + tl.arange(0, BH)
    q0, q1, q2, q3 = _q_blocks(Q, t, h, s_qt, s_qh, H, KB, NB)
    if QN:
        sq = _sq(q0)
        if NB > 1:
            sq += _sq(q1)
        if NB > 2:
            sq += _sq(q2) + _sq(q3)
        rs = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sq, tl.full(sq.shape, D, tl.float32)) + qeps))[:, None]
        q0, q1, q2, q3 = _scaled(q0, rs), _scaled(q1, rs), _scaled(q2, rs), _scaled(q3, rs)
    M = tl.load(Sink + h, mask=h < H, other=0.0) * _LOG2E  # the sink, in base 2
    L = tl.full([BH], 1.0, tl.float32)
    A0 = tl.zeros([BH, KB], tl.float32)
    A1 = A0
    A2 = A0
    A3 = A0
    for c in range(0, _live_chunks(t, K0, I1, s_i1, K1, N1, NCH, CH, _LIVE_BI)):
        row, ok = _rows(c * CH, t, P0, I0, s_i0, K0, N0, P1, I1, s_i1, K1, N1, D, CH)
        k0, k1, k2, k3, s = _logits(q0, q1, q2, q3, row, ok, scale2, KB, NB, IEEE)
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


def sparse_attention(q, pools, idx, sink, scale: float, force: bool = False, q_eps: float | None = None):
    """``ops.sparse_attention`` in fast mode on CUDA (or the interpreter): this kernel where
    ``attention_tiles.takes_online`` (or ``force``), else ``triton_attention``'s launch of the bucket table.
    ``q_eps``: ``fused.normed_sparse_attention`` - the queries RMS-normalised per head first."""
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
    t = pick(T, H)
    bh = t["BH"] if not force else min(64, max(16, 1 << max(0, H - 1).bit_length()))
    s_i0 = i0.stride(0) if K0 else 0
    s_i1 = i1.stride(0) if K1 else 0
    nch = cdiv(K0 + K1, CHUNK)
    sink = sink.float().contiguous()
    for r0 in range(0, T, ROWS_PER_LAUNCH):
        n = min(ROWS_PER_LAUNCH, T - r0)
        launch(online_kernel, (cdiv(H, bh), n), q[r0:r0 + n], q.stride(0), q.stride(1), p0, i0[r0:r0 + n], s_i0, K0,
               p0.shape[0], p1, i1[r0:r0 + n], s_i1, K1, p1.shape[0], sink, out[r0:r0 + n], out.stride(0),
               out.stride(1), H, float(scale) * LOG2E, nch, 0.0 if q_eps is None else float(q_eps), D=D, BH=bh,
               CH=CHUNK, IEEE=q.dtype == torch.float32, NB=blocks(D), QN=q_eps is not None, num_warps=t["num_warps"], num_stages=t["num_stages"])
    return out


def normed_sparse_attention(q, pools, idx, sink, scale: float, eps: float):
    """``fused.normed_sparse_attention`` in fast mode on CUDA: the queries' per-head RMS factor
    taken on the loaded queries, in registers."""
    return sparse_attention(q, pools, idx, sink, scale, q_eps=eps)
