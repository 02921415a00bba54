"""Every reduction the model does goes through this package, in one of two modes.

- ``fast`` (the process default): framework defaults, ``core.py``;
- ``invariant``: a fixed reduction order per row that never depends on the batch, ``invariant.py``
  (plain torch, CPU or GPU; on CUDA the GEMM, RMSNorm and attention use the TileLang kernels of
  ``v4stack.kernels`` when TileLang is installed).

What invariant mode promises, and the tests show bitwise: a request's logits are the same alone
or in any batch, at any position in it; the same batch twice gives the same bits; and a prompt
fed in one step, in chunks, or token by token gives the same bits (hidden trailing attention
candidates add exact zeros). The fast mode keeps only determinism.

Pick one with ``ops.set_mode("invariant")`` or ``with ops.mode("invariant"): ...``. GEMM-like ops
take ``fp=``, a ``FloatSemantics`` from ``ops.opt_in(site, tf32=..., fast_math=...)``; without it
they run IEEE fp32 (no TF32, no reduced-precision reductions), and invariant mode refuses any
opt-in.
"""

from __future__ import annotations

import contextlib

import torch

from v4stack.ops import core as _fast
from v4stack.ops import invariant as _inv
from v4stack.ops.mode import (
    IEEE,
    MODES,
    FloatSemantics,
    FloatSemanticsError,
    get_mode,
    mode,
    opt_in,
    recorded,
    set_mode,
)
from v4stack.ops.mode import admit as _admit
from v4stack.ops.mode import cuda_float_flags as _cuda_flags
from v4stack.ops.grouped import grouped_linear
from v4stack.ops.sparse_attention import sparse_attention
from v4stack.ops.quantized import QuantizedWeight


def _impl():
    return _inv if get_mode() == "invariant" else _fast


def _gemm(op: str, x: torch.Tensor, fp: FloatSemantics | None):
    """(implementation, context) for a GEMM-like op with explicit float semantics."""
    fp = _admit(op, fp)
    impl = _impl()
    if x.is_cuda and impl is _fast:
        return impl, _cuda_flags(fp)
    return impl, contextlib.nullcontext()


def linear(x: torch.Tensor, weight, fp: FloatSemantics | None = None) -> torch.Tensor:
    """``x @ weight.T`` over the last dim of ``x``; ``weight`` is dense or a ``QuantizedWeight``
    (block-scaled FP8 / FP4, dequantised once and cached on the CPU path)."""
    if isinstance(weight, QuantizedWeight):
        weight = weight.dense(x.dtype, x.device)
    impl, ctx = _gemm("linear", x, fp)
    with ctx:
        return impl.linear(x, weight)


def hc_mix(flat: torch.Tensor, fn: torch.Tensor, eps: float, fp: FloatSemantics | None = None) -> torch.Tensor:
    """mHC projection: ``(flat @ fn.T) * rsqrt(mean(flat^2) + eps)`` (weightless RMS)."""
    impl, ctx = _gemm("hc_mix", flat, fp)
    with ctx:
        return impl.hc_mix(flat, fn, eps)


def indexer_scores(q, w, k, fp: FloatSemantics | None = None) -> torch.Tensor:
    """Lightning-indexer score ``I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])``."""
    impl, ctx = _gemm("indexer_scores", q, fp)
    with ctx:
        return impl.indexer_scores(q, w, k)


def attention_with_sink(q, keys, mask, sink, scale: float, fp: FloatSemantics | None = None) -> torch.Tensor:
    """Shared-KV attention, q ``[T, H, c]``, keys ``[T, K, c]``, mask ``[T, K]``, sink ``[H]``."""
    impl, ctx = _gemm("attention_with_sink", q, fp)
    with ctx:
        return impl.attention_with_sink(q, keys, mask, sink, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in at least fp32, returned in ``x``'s dtype."""
    return _impl().rms_norm(x, weight, eps)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _impl().softmax(x, dim)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Log-probabilities over ``dim`` (for logprob comparisons and RL losses)."""
    return _impl().log_softmax(x, dim)


def weighted_pool(kv: torch.Tensor, score: torch.Tensor, dim: int) -> torch.Tensor:
    """Gated pooling: ``sum_j softmax_j(score) * kv_j`` along ``dim`` (per channel)."""
    return _impl().weighted_pool(kv, score, dim)


def hc_read(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """mHC read ``sum_j pre_j x_j``: ``x [N, n, d]``, ``pre [N, n]`` -> ``[N, d]``."""
    return _impl().hc_read(x, pre)


def hc_write(x, out, post, comb) -> torch.Tensor:
    """mHC write ``x'_k = post_k * out + sum_j comb[j, k] x_j``."""
    return _impl().hc_write(x, out, post, comb)


def moe_combine(y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Routed expert outputs ``y [N, k, d]`` (expert ids ``idx [N, k]``) summed per token."""
    return _impl().moe_combine(y, idx)


def topk(x: torch.Tensor, k: int, stable: bool = False):
    """(values, indices) of the ``k`` largest along the last dim, descending."""
    return _impl().topk(x, k, stable)


def sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:  # noqa: A001
    return _impl().sum(x, dim, keepdim)


def exp(x):
    return _impl().exp(x)


def sigmoid(x):
    return _impl().sigmoid(x)


def silu(x):
    return _impl().silu(x)


def softplus(x):
    return _impl().softplus(x)


def cos(x):
    return _impl().cos(x)


def sin(x):
    return _impl().sin(x)


__all__ = [
    "IEEE", "MODES", "FloatSemantics", "FloatSemanticsError", "attention_with_sink", "cos", "exp",
    "get_mode", "grouped_linear", "hc_mix", "hc_read", "hc_write", "indexer_scores", "linear", "log_softmax", "mode", "moe_combine",
    "opt_in", "QuantizedWeight", "recorded", "rms_norm", "set_mode", "sigmoid", "silu", "sin", "softmax", "softplus",
    "sparse_attention", "sum", "topk", "weighted_pool",
]
