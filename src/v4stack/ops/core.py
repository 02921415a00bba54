"""The ``fast`` implementations of the model's reductions: framework defaults.

A row's result may depend on the batch it shares a call with (CPU ``torch.mm`` changes its fp32
kernel from M = 8 on, cuBLAS picks split-K by shape, torch's CPU pointwise kernels use a scalar
formula for a tensor's ragged tail). ``invariant.py`` holds the batch-invariant versions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` over the last dim of ``x``."""
    return F.linear(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in at least fp32, returned in ``x``'s dtype."""
    xf = x if x.dtype == torch.float64 else x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(x, dim=dim)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.log_softmax(x, dim=dim)


def hc_mix(flat: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """mHC projection: ``(flat @ fn.T) * rsqrt(mean(flat^2) + eps)`` (weightless RMS)."""
    rs = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
    return F.linear(flat, fn) * rs


def weighted_pool(kv: torch.Tensor, score: torch.Tensor, dim: int) -> torch.Tensor:
    """Gated pooling: ``sum_j softmax_j(score) * kv_j`` along ``dim`` (per channel)."""
    return (torch.softmax(score, dim=dim) * kv).sum(dim)


def indexer_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer score ``I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])``.

    q [T, h, d], w [T, h], k [S, d] (or per-row keys [T, S, d]) -> [T, S].
    """
    if k.dim() == 3:
        dots = torch.einsum("thd,tsd->ths", q, k).relu()
        return (dots * w.unsqueeze(-1)).sum(1)
    dots = torch.einsum("thd,sd->ths", q, k).relu()
    return (dots * w.unsqueeze(-1)).sum(1)


def attention_with_sink(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """Shared-KV attention with a per-head sink logit added to the denominator only.

    q [T, H, c]; keys [T, K, c] (key == value, one KV head; each query row has its own candidate
    list); mask [T, K] bool (True = visible); sink [H]. Returns [T, H, c].
    """
    scores = torch.einsum("thc,tkc->thk", q, keys) * scale
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    sink = sink.to(scores.dtype).view(1, -1, 1)
    m = torch.maximum(scores.amax(-1, keepdim=True), sink)
    p = torch.exp(scores - m)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink - m)
    return torch.einsum("thk,tkc->thc", p / denom, keys)


def sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:  # noqa: A001
    return x.sum(dim, keepdim=keepdim)


exp = torch.exp
sigmoid = torch.sigmoid
silu = F.silu
softplus = F.softplus
cos = torch.cos
sin = torch.sin


def hc_read(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Sublayer input before its norm: ``sum_j pre_j x_j`` -> ``[N, d]`` in x's dtype."""
    return (pre.unsqueeze(-1) * x.to(pre.dtype)).sum(1).to(x.dtype)


def hc_write(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams ``x'_k = post_k * out + sum_j comb[j, k] x_j``."""
    cd = post.dtype
    mixed = torch.einsum("njk,njd->nkd", comb, x.to(cd))
    return (post.unsqueeze(-1) * out.to(cd).unsqueeze(1) + mixed).to(x.dtype)


def moe_combine(y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Routed outputs ``y [N, k, d]`` summed over the k slots in at least fp32."""
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    return y.to(acc).sum(1)


def topk(x: torch.Tensor, k: int, stable: bool = False):
    """Largest ``k`` along the last dim, descending; ``stable`` breaks ties to the lower index."""
    if stable:
        vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
        return vals[..., :k], idx[..., :k]
    r = torch.topk(x, k, dim=-1)
    return r.values, r.indices
