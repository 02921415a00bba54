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
from v4stack.model import rowwise
from v4stack.ops.fused import hc_head_pre, hc_head_read_norm, hc_pre, hc_pre_read_norm, hc_read_norm, sinkhorn  # noqa: F401  (sinkhorn: the projection hc_pre applies)


def hc_parameters(n: int, dim: int, head: bool = False) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """(fn, base, scale) for a sublayer (width n^2 + 2n, 3 scales) or the head (width n, 1 scale)."""
    width = n if head else n * n + 2 * n
    return (
        nn.Parameter(torch.empty(width, n * dim, dtype=torch.float32)),
        nn.Parameter(torch.empty(width, dtype=torch.float32)),
        nn.Parameter(torch.empty(1 if head else 3, dtype=torch.float32)),
    )


def hc_coefficients(x, fn, base, scale, iters: int, eps: float, norm_eps: float):
    """``x [N, n, d]`` -> pre ``[N, n]``, post ``[N, n]``, comb ``[N, n, n]`` (compute dtype)."""
    return hc_pre(x, fn, scale, base, x.shape[1], iters, eps, norm_eps)


def read_norm(x: torch.Tensor, pre: torch.Tensor, norm) -> torch.Tensor:
    """A sublayer's normalised input: ``norm(hc_read(x, pre))`` for an ``RMSNorm`` ``norm``, one row
    step over its weight (one kernel on CUDA, ``fused.hc_read_norm``)."""
    return rowwise.step(hc_read_norm, x, pre, norm.weight, norm.eps, params=(2,))


def coefficients_read_norm(x, fn, base, scale, iters: int, eps: float, norm_eps: float, norm_weight,
                           rms_eps: float):
    """``hc_coefficients`` then ``read_norm`` with its pre -> (the sublayer's input, post, comb)
    (fast mode on CUDA: one launch for the coefficients' finish and the read, ``fused.hc_pre_read_norm``)."""
    return hc_pre_read_norm(x, fn, scale, base, x.shape[1], iters, eps, norm_eps, norm_weight, rms_eps)


def hc_write(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams ``x'_k = post_k * out + sum_j comb[j, k] x_j``."""
    return ops.hc_write(x, out, post, comb)


def head_input(x, fn, base, scale, eps: float, norm_eps: float, norm) -> torch.Tensor:
    """The output head's input from the streams ``x [N, n, d]``: the final stream mixing with ``pre =
    sigmoid(mix * scale + base) + eps`` (no Sinkhorn), then the RMS norm ``norm`` - the stream
    weights, then the read with its norm - one op where no trainer hook splits them (fast mode on
    CUDA: one launch after the weights' projection, ``fused.hc_head_read_norm``), two row steps
    under a hook; the same ops either way."""
    if not rowwise.hooked():
        return hc_head_read_norm(x, fn, scale, base, eps, norm_eps, norm.weight, norm.eps)
    pre = rowwise.step(hc_head_pre, x, fn, scale, base, eps, norm_eps, params=(1, 2, 3))
    return read_norm(x, pre, norm)
