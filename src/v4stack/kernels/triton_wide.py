"""Fast mode's narrow fp32-accurate projections of half-precision rows (Triton): the mHC
coefficients ``hc_pre`` and the router's logits, read straight from the bf16 / fp16 rows.

Both are ``x [M, K] @ w [N, K]^T`` with N <= 64 and fp32 results: in invariant mode the project's
fixed-slice 3xTF32 kernel (``triton_slices``) computes them, on rows widened to fp32 (the
router) or widened while loaded (``hc_pre``). That kernel's tile at decode sizes is bound by its
chain of K steps, not by the bytes (10 us for ``hc_pre`` at 256 rows x 16384, where the rows are
8 MiB: 2 us). Here:

- the row operand stays in its half dtype, the MMA's ``A`` as it is loaded (exact: every product
  of two half-precision values is exact in fp32);
- an fp32 weight is split in the kernel into three bf16 parts, ``w = hi + mid + lo`` (each the
  round-to-nearest of what is left: 24 of fp32's 24 significand bits are kept), and the three
  products are chained into one fp32 accumulator (a bf16 weight is one part, no split);
- a program takes ``BM`` rows x one chunk of ``KC`` columns of K (the chunks fill the SMs; K
  steps of 64), stores its fp32 partial ``P[s, M, N]`` (and for ``hc_pre`` the rows' sums of
  squares ``PSS[s, M]``), and a second launch adds the chunks in chunk order:
  ``triton_mhc.finish_split_kernel`` for ``hc_pre`` (the RMS factor, then the Sinkhorn split, one
  row a program), ``triton_slices.finish_kernel`` for the router.

The order of every sum depends on K alone (the chunk, the K step, the MMA's own order inside a
step), never on M or on the row's batch, so a row's bits do not depend on its batch. They are not
the invariant kernel's bits (another summation order); the error against float64 is measured by
``bench/wide_projections.py`` and ``tests/ops/test_wide.py``.
"""

import torch
import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import cdiv, launch, next_pow2
from v4stack.kernels.triton_slices import finish_sum

FLOAT_SEMANTICS = ("half rows as MMA operands; fp32 weights as three bf16 parts (hi + mid + lo) chained into "
                   "one fp32 accumulator per K step of 64; chunks of KC columns summed in order by a second launch")

# (rows, K columns) a program, its warps and stages, one for every M (so a row's bits never depend
# on its batch): the best of 14 at 256 rows in bench/results/wide_projections_h200.json (hc_pre
# 12.0 us against the slice pair's 15.0; 11.1 / 11.3 at one row, 82 / 195 at 4096)
TILE = dict(BM=128, KC=256, BK=64, num_warps=8, num_stages=3)


@triton.jit
def _parts(w):
    """``w`` (fp32) -> three bf16 parts whose sum is ``w`` to fp32's precision."""
    hi = w.to(tl.bfloat16)
    r = w - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def wide_partials_kernel(X, W, P, PSS, M, N, K, s_xm, s_wn, KC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, SPLIT_W: tl.constexpr, RMS: tl.constexpr):
    """Program ``(m, s)``: rows ``[m BM, ...)`` x columns ``[s KC, (s + 1) KC)`` of K -> ``P[s, rows, :N]``
    (and ``PSS[s, rows]``: the rows' sums of squares over the chunk)."""
    pdl_enter()
    pm = tl.program_id(0)
    s = tl.program_id(1)
    rows = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    cols = tl.arange(0, BN)
    rmask = rows < M
    cmask = cols < N
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    sq = tl.zeros([BM, BK], tl.float32)
    k0 = s * KC
    for k in range(k0, k0 + KC, BK):
        km = (k + kk) < K
        a = tl.load(X + rows[:, None] * s_xm + (k + kk)[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        w = tl.load(W + cols[None, :] * s_wn + (k + kk)[:, None], mask=cmask[None, :] & km[:, None], other=0.0)
        if SPLIT_W:
            hi, mid, lo = _parts(w)
            acc = tl.dot(a.to(tl.bfloat16), lo, acc)
            acc = tl.dot(a.to(tl.bfloat16), mid, acc)
            acc = tl.dot(a.to(tl.bfloat16), hi, acc)
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
        if RMS:
            af = a.to(tl.float32)
            sq += af * af
    tl.store(P + (s * M + rows)[:, None] * N + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])
    if RMS:
        tl.store(PSS + s * M + rows, tl.sum(sq, 1), mask=rmask)


def partials(x: torch.Tensor, w: torch.Tensor, rms: bool, tile: dict | None = None):
    """``x [M, K]`` (bf16 / fp16, rows contiguous), ``w [N, K]`` (fp32, or x's dtype) -> ``(P [S, M,
    N], PSS [S, M] or None, S)``: the per-chunk fp32 partials of ``x @ w.T``."""
    t = tile or TILE
    M, K = x.shape
    N = w.shape[0]
    S = cdiv(K, t["KC"])
    p = torch.empty(S * M * N, dtype=torch.float32, device=x.device)
    pss = torch.empty(S * M, dtype=torch.float32, device=x.device) if rms else p
    if M:
        launch(wide_partials_kernel, (cdiv(M, t["BM"]), S), x, w, p, pss, M, N, K, x.stride(0), w.stride(0),
               KC=t["KC"], BM=t["BM"], BN=max(16, next_pow2(N)), BK=t["BK"], SPLIT_W=w.dtype == torch.float32,
               RMS=rms, num_warps=t["num_warps"], num_stages=t["num_stages"])
    return p, (pss if rms else None), S


def hc_pre(x, fn, scale, base, n: int, iters: int, eps: float, norm_eps: float, tile: dict | None = None):
    """``ops.fused.hc_pre`` in fast mode: the streams ``x [M, n, d]`` (bf16) -> pre, post, comb."""
    from v4stack.kernels.triton_mhc import _outputs, finish_split

    M = x.shape[0]
    out = _outputs(M, n, x.device)
    if M == 0:
        return out
    p, pss, S = partials(x.reshape(M, -1), fn, True, tile)
    y = torch.empty(M, fn.shape[0], dtype=torch.float32, device=x.device)
    return finish_split(p, pss, S, fn.shape[1], y, scale, base, out, iters, eps, norm_eps)


def hc_pre_read_norm(x, fn, scale, base, n: int, iters: int, eps: float, norm_eps: float, weight, rms_eps: float,
                     tile: dict | None = None):
    """``ops.fused.hc_pre_read_norm`` in fast mode: the streams ``x [M, n, d]`` (bf16) -> the
    sublayer's normalised input ``[M, d]``, post, comb: ``hc_pre``'s partials, then one launch for
    the finish, the split and the read with its norm (``triton_mhc.finish_read_norm``)."""
    from v4stack.kernels.triton_mhc import _outputs, finish_read_norm

    M = x.shape[0]
    out = _outputs(M, n, x.device)
    y = torch.empty(M, x.shape[2], dtype=x.dtype, device=x.device)
    if M:
        p, pss, S = partials(x.reshape(M, -1), fn, True, tile)
        mix = torch.empty(M, fn.shape[0], dtype=torch.float32, device=x.device)
        finish_read_norm(p, pss, S, fn.shape[1], mix, scale, base, out, iters, eps, norm_eps, x, weight, rms_eps, y)
    return y, out[1], out[2]


def linear_widened(x: torch.Tensor, w: torch.Tensor, wide: torch.Tensor | None = None,
                   tile: dict | None = None) -> torch.Tensor:
    """``ops.fused.linear_widened`` in fast mode: ``x.float() @ w.float().T`` (``x [M, K]`` half,
    ``w [N, K]`` half or fp32, N <= 64) -> ``[M, N]`` fp32, without the widened copy of ``x``
    (``wide``, the caller's widened ``w``, is not read)."""
    M = x.shape[0]
    y = torch.empty(M, w.shape[0], dtype=torch.float32, device=x.device)
    if M:
        p, _, S = partials(x, w, False, tile)
        finish_sum(p, p, y, S, x.shape[1])
    return y


def router(x, w, wide, bias, table, token_ids, k: int, scale: float, tile: dict | None = None):
    """``ops.fused.router`` in fast mode: the logits' partials of the bf16 rows (``linear_widened``'s
    first launch), then ``triton_route``'s gate kernel adding them in slice order itself - the
    logits ``linear_widened`` would have written, without the launch that writes them."""
    from v4stack.kernels.triton_route import moe_gate_partials

    M, N = x.shape[0], w.shape[0]
    if M == 0:
        return (torch.empty(0, k, dtype=torch.int64, device=x.device),
                torch.empty(0, k, dtype=torch.float32, device=x.device))
    p, _, S = partials(x, w, False, tile)
    return moe_gate_partials(p.view(S, M, N), S, bias, table, token_ids, k, scale)


def hc_head_pre(x, fn, scale, base, eps: float, norm_eps: float, tile: dict | None = None):
    """``ops.fused.hc_head_pre`` in fast mode: the head's stream weights from the streams ``x [M, n,
    d]`` (bf16): the partials, ``finish_kernel``'s ordered sum with the RMS factor, then
    ``triton_mhc.head_weights``' ``sigmoid(mix * scale + base) + eps``."""
    from v4stack.kernels.triton_mhc import head_weights

    M = x.shape[0]
    if M == 0:
        return torch.empty(0, x.shape[1], dtype=torch.float32, device=x.device)
    mix = torch.empty(M, fn.shape[0], dtype=torch.float32, device=x.device)
    p, pss, S = partials(x.reshape(M, -1), fn, True, tile)
    finish_sum(p, pss, mix, S, fn.shape[1], norm_eps)
    return head_weights(mix, scale, base, eps)


def hc_head_read_norm(x, fn, scale, base, eps: float, norm_eps: float, weight, rms_eps: float,
                      tile: dict | None = None):
    """``ops.fused.hc_head_read_norm`` in fast mode: the streams ``x [M, n, d]`` (bf16) -> the head's
    normalised input ``[M, d]``: ``hc_head_pre``'s partials, then one launch for the finish, the
    stream weights, the read and its norm (``triton_mhc.finish_head_read_norm``)."""
    from v4stack.kernels.triton_mhc import finish_head_read_norm

    M = x.shape[0]
    y = torch.empty(M, x.shape[2], dtype=x.dtype, device=x.device)
    if M:
        p, pss, S = partials(x.reshape(M, -1), fn, True, tile)
        mix = torch.empty(M, fn.shape[0], dtype=torch.float32, device=x.device)
        finish_head_read_norm(p, pss, S, fn.shape[1], mix, scale, base, eps, norm_eps, x, weight, rms_eps, y)
    return y
