"""Manifold-constrained hyper-connections: ``n_hc`` residual streams per token.

Each sublayer reads a weighted sum of the streams (``pre``) and writes its output into every
stream (``post``) on top of a doubly-stochastic mix of the old streams (``comb``, projected by
Sinkhorn). The hyper-connection head mixes the streams once more before the final norm.

Parameters live on the owning module under the official flat names (``hc_attn_fn``,
``hc_attn_base``, ``hc_attn_scale``, ...); these functions take them as arguments.
"""

from __future__ import annotations

import torch
from torch import nn

from v4stack import ops
from v4stack.model.linear import compute_dtype


def hc_parameters(n: int, dim: int, head: bool = False) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """(fn, base, scale) for a sublayer (width n^2 + 2n, 3 scales) or the head (width n, 1 scale)."""
    width = n if head else n * n + 2 * n
    return (
        nn.Parameter(torch.empty(width, n * dim, dtype=torch.float32)),
        nn.Parameter(torch.empty(width, dtype=torch.float32)),
        nn.Parameter(torch.empty(1 if head else 3, dtype=torch.float32)),
    )


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project ``[..., n, n]`` logits onto (approximately) doubly-stochastic matrices.

    Row-softmax (+eps) and a column normalisation first, then ``iters - 1`` rounds of row then
    column normalisation.
    """
    m = ops.softmax(logits, dim=-1) + eps
    m = m / (ops.sum(m, -2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (ops.sum(m, -1, keepdim=True) + eps)
        m = m / (ops.sum(m, -2, keepdim=True) + eps)
    return m


def _mix(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    cd = compute_dtype(x.dtype)
    flat = x.reshape(x.shape[0], -1).to(cd)
    return ops.hc_mix(flat, fn.to(cd), norm_eps)


def hc_coefficients(x, fn, base, scale, iters: int, eps: float, norm_eps: float):
    """``x [N, n, d]`` -> pre ``[N, n]``, post ``[N, n]``, comb ``[N, n, n]`` (compute dtype)."""
    n = x.shape[1]
    mix = _mix(x, fn, norm_eps)
    base, scale = base.to(mix.dtype), scale.to(mix.dtype)
    pre = ops.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * ops.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = (mix[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n)
    return pre, post, sinkhorn(comb, iters, eps)


def hc_read(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Sublayer input before its norm: ``sum_j pre_j x_j`` -> ``[N, d]`` in x's dtype."""
    return ops.hc_read(x, pre)


def hc_write(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams ``x'_k = post_k * out + sum_j comb[j, k] x_j``."""
    return ops.hc_write(x, out, post, comb)


def hc_head(x, fn, base, scale, eps: float, norm_eps: float) -> torch.Tensor:
    """Final stream mixing ``pre = sigmoid(mix * scale + base) + eps`` (no Sinkhorn) -> ``[N, d]``."""
    mix = _mix(x, fn, norm_eps)
    pre = ops.sigmoid(mix * scale.to(mix.dtype) + base.to(mix.dtype)) + eps
    return hc_read(x, pre)
