"""Batch-invariant implementations of the model's reductions, in plain torch (CPU or GPU).

Invariant by construction:

- every reduction is a pairwise tree of elementwise IEEE adds over the reduced axis, padded with
  the identity to a power of two ``P``; level by level, element ``i`` meets element ``i + P / 2``,
  so trailing identity elements never change a result. An elementwise add rounds each element
  once, the same way in a vector lane or in scalar code, so an output row depends on its own
  inputs only - never on how many rows share the call, where the row sits, or the thread count;
- products are elementwise multiplies in the accumulation dtype (fp32 for bf16/fp16/fp32 inputs,
  whose products are then exact for 16-bit inputs; fp64 for fp64);
- maxima use ``torch.maximum`` trees (exact);
- transcendental pointwise functions run, on CPU, over a contiguous buffer padded to whole blocks
  of 64 elements in calls of a fixed size, so every element takes torch's vectorised formula: its
  CPU kernels use a different scalar formula for a tensor's ragged tail and for strided inputs,
  and for sigmoid, silu and softplus the two differ in the last bit.

Large products are computed in chunks of rows / columns; chunking never changes an element's
arithmetic, only peak memory.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

_BLOCK = 64  # elements: a multiple of every CPU vector width x unroll torch uses (AVX-512: 2 x 16 fp32)
_CHUNK = 16384  # elements per pointwise call: below torch's parallel grain (32768), so never split
_BUDGET = 1 << 22  # elements of one product tensor before the work is chunked


def acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp64 if any input is fp64, else fp32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


# ---- reductions ----------------------------------------------------------------------------


def _tree(t: torch.Tensor, combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Reduce dim 0 of ``t`` with a pairwise tree fixed by ``t.shape[0]`` (an odd last element is
    carried up). Widths that vary with the batch or the chunking (attention candidates) are cut into
    fixed blocks by the caller (``_blocked_sum0``), so the tree's shape never depends on them."""
    while t.shape[0] > 1:
        L = t.shape[0]
        h = L // 2
        s = combine(t[:h], t[h : 2 * h])
        t = torch.cat((s, t[2 * h :])) if L % 2 else s
    return t[0]


def _reduce(x: torch.Tensor, dim: int, keepdim: bool, combine, empty: float) -> torch.Tensor:
    dim = dim % x.dim()
    t = x.movedim(dim, 0)
    if t.shape[0] == 0:
        r = torch.full(t.shape[1:], empty, dtype=x.dtype, device=x.device)
    else:
        r = _tree(t.contiguous(), combine)
    return r.unsqueeze(dim) if keepdim else r


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dim`` in a fixed pairwise order (in ``x``'s dtype)."""
    return _reduce(x, dim, keepdim, torch.add, 0.0)


def tree_max(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Max over ``dim`` (exact; the tree only fixes which of equal zeros / NaNs comes out)."""
    return _reduce(x, dim, keepdim, torch.maximum, float("-inf"))


def sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:  # noqa: A001
    return tree_sum(x, dim, keepdim)


# ---- pointwise -----------------------------------------------------------------------------


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` elementwise, with every element on the same code path wherever it sits."""
    if x.device.type != "cpu":  # CUDA kernels apply one formula to every element
        return fn(x)
    n = x.numel()
    flat = x.reshape(-1)
    pad = (-n) % _BLOCK
    buf = torch.cat((flat, flat.new_zeros(pad))) if pad else flat.contiguous()
    out = torch.empty_like(buf)
    for s in range(0, buf.numel(), _CHUNK):
        out[s : s + _CHUNK] = fn(buf[s : s + _CHUNK])
    return out[:n].view(x.shape)


def exp(x):
    return pointwise(torch.exp, x)


def sigmoid(x):
    return pointwise(torch.sigmoid, x)


def silu(x):
    return pointwise(F.silu, x)


def softplus(x):
    return pointwise(F.softplus, x)


def cos(x):
    return pointwise(torch.cos, x)


def sin(x):
    return pointwise(torch.sin, x)


def _inv_sqrt(v: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(v)`` as two correctly rounded IEEE operations."""
    return torch.div(torch.ones_like(v), torch.sqrt(v))


# ---- GEMM ----------------------------------------------------------------------------------


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` over the last dim; each output's K-sum is a fixed tree (no split-K).

    GPU kernels are registered for it in the dispatch table (``ops.registry``).
    """
    if weight.shape[-1] != x.shape[-1]:
        raise ValueError(f"weight has in_features {weight.shape[-1]}, input has {x.shape[-1]}")
    return _linear_tree(x, weight)


def _linear_tree(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    K, N = x.shape[-1], weight.shape[0]
    acc = acc_dtype(x.dtype, weight.dtype)
    lead = x.shape[:-1]
    M = lead.numel()
    xt = x.reshape(M, K).to(acc).t()  # [K, M]
    wt = weight.to(acc).t()  # [K, N]
    out = torch.zeros(M, N, dtype=acc, device=x.device)
    if K == 0 or M == 0 or N == 0:
        return out.to(x.dtype).view(*lead, N)
    nc = min(N, 256)
    mc = max(1, min(M, _BUDGET // (K * nc)))
    for m0 in range(0, M, mc):
        for n0 in range(0, N, nc):
            prod = xt[:, m0 : m0 + mc, None] * wt[:, None, n0 : n0 + nc]  # [K, mc, nc]
            out[m0 : m0 + mc, n0 : n0 + nc] = _tree(prod, torch.add)
    return out.to(x.dtype).view(*lead, N)


# ---- the model's fused reductions ----------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.to(acc_dtype(x.dtype))
    ms = tree_sum(xf * xf, -1, keepdim=True) / x.shape[-1]
    y = xf * _inv_sqrt(ms + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    e = exp(x - tree_max(x, dim, keepdim=True))
    return e / tree_sum(e, dim, keepdim=True)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    z = x - tree_max(x, dim, keepdim=True)
    return z - pointwise(torch.log, tree_sum(exp(z), dim, keepdim=True))


def hc_mix(flat: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """mHC projection; the 24-wide GEMM and the RMS reduce in fixed trees over ``n * d``."""
    rs = _inv_sqrt(tree_sum(flat * flat, -1, keepdim=True) / flat.shape[-1] + eps)
    return linear(flat, fn) * rs


def weighted_pool(kv: torch.Tensor, score: torch.Tensor, dim: int) -> torch.Tensor:
    return tree_sum(softmax(score, dim) * kv, dim)


def indexer_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    if k.dim() == 3:  # per-row keys [T, S, d]: the same tree over d as the shared-key GEMM
        T, h, d = q.shape
        acc = acc_dtype(q.dtype, k.dtype)
        dots = torch.empty(T, h, k.shape[1], dtype=acc, device=q.device)
        tc = max(1, min(T, _BUDGET // max(1, h * k.shape[1] * d)))
        for t0 in range(0, T, tc):
            sl = slice(t0, t0 + tc)
            prod = q[sl].to(acc).permute(2, 0, 1).unsqueeze(-1) * k[sl].to(acc).permute(2, 0, 1).unsqueeze(2)
            dots[sl] = _tree(prod.contiguous(), torch.add)
        dots = dots.to(q.dtype).clamp_min(0)
        return tree_sum(dots * w.unsqueeze(-1), 1)
    dots = _linear_tree(q, k).clamp_min(0)  # [T, h, S]; S grows with history: no per-S kernel
    return tree_sum(dots * w.unsqueeze(-1), 1)


def attention_with_sink(q, keys, mask, sink, scale: float) -> torch.Tensor:
    """Per query row: scores over its own candidates, sink in the denominator, weighted sum.

    Query rows never mix: each row's dot products (tree over ``c``) and its sums over candidates
    (trees over ``K``) depend on that row alone; rows are chunked only to bound memory.
    """
    T, H, c = q.shape
    K = keys.shape[1]
    out = torch.empty_like(q)
    if T == 0:
        return out
    tc = max(1, min(T, _BUDGET // max(1, H * K * c)))
    for t0 in range(0, T, tc):
        sl = slice(t0, t0 + tc)
        out[sl] = _attend(q[sl], keys[sl], mask[sl], sink, scale)
    return out


_CAND_BLOCK = 64  # candidates per block: a tree inside a block, blocks added in order


def _blocked_sum0(t: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 (a multiple of ``_CAND_BLOCK`` long): a tree per block, blocks in order.

    Hidden candidates contribute exact zeros, so trailing hidden ones (a block's padding or whole
    blocks) leave every bit unchanged: the result depends on the visible candidates' slots only,
    not on how many hidden ones follow (which changes with how a prompt was chunked).
    """
    nb = t.shape[0] // _CAND_BLOCK
    acc = _tree(t[:_CAND_BLOCK].contiguous(), torch.add)
    for b in range(1, nb):
        acc = acc + _tree(t[b * _CAND_BLOCK : (b + 1) * _CAND_BLOCK].contiguous(), torch.add)
    return acc


def _attend(q, keys, mask, sink, scale):
    K = keys.shape[1]
    pad = (-K) % _CAND_BLOCK if K else _CAND_BLOCK
    if pad:
        keys = torch.cat((keys, keys.new_zeros(keys.shape[0], pad, keys.shape[2])), 1)
        mask = torch.cat((mask, mask.new_zeros(mask.shape[0], pad)), 1)
    qc = q.permute(2, 0, 1).unsqueeze(-1)  # [c, t, H, 1]
    kc = keys.permute(2, 0, 1).unsqueeze(2)  # [c, t, 1, K]
    scores = _tree((qc * kc).contiguous(), torch.add) * scale  # [t, H, K]
    hidden = ~mask.unsqueeze(1)
    scores = scores.masked_fill(hidden, float("-inf"))
    sink = sink.to(scores.dtype).view(1, -1, 1)
    m = torch.maximum(tree_max(scores, -1, keepdim=True), sink)
    p = exp(scores - m).masked_fill(hidden, 0.0)
    denom = _blocked_sum0(p.permute(2, 0, 1)).unsqueeze(-1) + exp(sink - m)  # [t, H, 1]
    w = p / denom
    prod = w.permute(2, 0, 1).unsqueeze(-1) * keys.permute(1, 0, 2).unsqueeze(2)  # [K, t, H, c]
    prod = prod.masked_fill(~mask.t().view(*mask.t().shape, 1, 1), 0.0)  # +0, whatever the key's sign
    return _blocked_sum0(prod)


def hc_read(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_j pre_j x_j`` over the streams, a fixed tree over ``j``."""
    return tree_sum(pre.unsqueeze(-1) * x.to(pre.dtype), 1).to(x.dtype)


def hc_write(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``x'_k = post_k * out + sum_j comb[j, k] x_j`` with the j-sum a fixed tree."""
    cd = post.dtype
    mixed = tree_sum(comb.unsqueeze(-1) * x.to(cd).unsqueeze(2), 1)  # [N, j, k, d] -> [N, k, d]
    return (post.unsqueeze(-1) * out.to(cd).unsqueeze(1) + mixed).to(x.dtype)


def moe_combine(y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per token, the routed outputs ``y [N, k, d]`` summed left to right in ascending expert id
    (ties in slot order), in at least fp32."""
    acc = acc_dtype(y.dtype)
    order = torch.sort(idx, dim=1, stable=True).indices
    ys = y.to(acc).gather(1, order.unsqueeze(-1).expand(-1, -1, y.shape[-1]))
    out = torch.zeros(y.shape[0], y.shape[2], dtype=acc, device=y.device)
    for j in range(ys.shape[1]):
        out = out + ys[:, j]
    return out


def topk(x: torch.Tensor, k: int, stable: bool = False):
    """Largest ``k`` along the last dim, descending, ties to the lower index (a stable sort)."""
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]
