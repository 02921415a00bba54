"""Every reduction the model does goes through this package, in one of two modes.

- ``fast`` (the process default): framework defaults, ``core.py``;
- ``invariant``: a fixed reduction order per row that never depends on the batch, ``invariant.py``
  (plain torch, CPU or GPU; on CUDA the GEMM, RMSNorm and attention use the TileLang kernels of
  ``v4stack.kernels`` when TileLang is installed).

What invariant mode promises, and the tests show bitwise: a request's logits are the same alone
or in any batch, at any position in it; the same batch twice gives the same bits; and a prompt
fed in one step, in chunks, or token by token gives the same bits (hidden trailing attention
candidates add exact zeros). The fast mode keeps only determinism.

Which implementation serves a call is decided by one table, ``ops.dispatch``: (op, mode,
format, device) -> implementation, the first whose contract accepts the call. ``ops.counters()``
says which implementation served each op (or call site, ``ops.call_site("name")``) since
``ops.reset_counters()``; ``ops.table()`` lists the registrations.

Pick one with ``ops.set_mode("invariant")`` or ``with ops.mode("invariant"): ...``. GEMM-like ops
take ``fp=``, a ``FloatSemantics`` from ``ops.opt_in(site, tf32=..., fast_math=...)``; without it
they run IEEE fp32 (no TF32, no reduced-precision reductions), and invariant mode refuses any
opt-in.
"""

from __future__ import annotations

import torch

from v4stack.ops import dispatch as _dispatch
from v4stack.ops import registry as _registry  # noqa: F401  (fills the table)
from v4stack.ops.dispatch import NoImplementation, call_site, counters, register, reset_counters, resolve, table
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
from v4stack.ops.mode import ieee_cuda_flags as _ieee_flags
from v4stack.ops.quantized import QuantizedWeight
from v4stack.ops import fp8_keys

_call = _dispatch.call


_FMT: dict = {}


def _fmt(t: torch.Tensor) -> str:
    f = _FMT.get(t.dtype)
    if f is None:
        f = _FMT[t.dtype] = str(t.dtype)[6:]  # "torch.bfloat16" -> "bfloat16"
    return f


def _dev(t: torch.Tensor) -> str:
    return "cuda" if t.is_cuda else t.device.type  # ``t.device`` builds an object per call


def _run(op: str, t: torch.Tensor, *args, **kw):
    return _call(op, get_mode(), _fmt(t), "cuda" if t.is_cuda else t.device.type, *args, **kw)


def _gemm(op: str, x: torch.Tensor, wfmt: torch.Tensor, fp: FloatSemantics | None, *args, **kw):
    """Run a GEMM-like op under explicit float semantics (TF32 / reduced precision off unless
    the call site opted in, and never in invariant mode)."""
    fp = _admit(op, fp)
    m = get_mode()
    if m == "fast" and x.is_cuda and (fp.relaxed or not _ieee_flags()):
        with _cuda_flags(fp):
            return _call(op, m, _fmt(wfmt), _dev(x), *args, **kw)
    return _call(op, m, _fmt(wfmt), _dev(x), *args, **kw)


def linear(x: torch.Tensor, weight, fp: FloatSemantics | None = None) -> torch.Tensor:
    """``x @ weight.T`` over the last dim of ``x``. ``weight`` is dense or a ``QuantizedWeight``
    (V4's block-scaled FP8 / FP4 as stored); the implementation is keyed by the weight's format
    (its dtype, or ``"fp8"`` / ``"fp4"``): on CUDA an FP8 weight runs the block-scaled FP8 GEMM,
    elsewhere it is dequantised once (cached) and runs the dense GEMM of the mode."""
    if isinstance(weight, QuantizedWeight):
        fp = _admit("linear", fp)
        return _call("linear", get_mode(), weight.fmt, _dev(x), x, weight)
    if weight.shape[-1] != x.shape[-1]:
        raise ValueError(f"weight has in_features {weight.shape[-1]}, input has {x.shape[-1]}")
    return _gemm("linear", x, weight, fp, x, weight)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                   fp: FloatSemantics | None = None) -> torch.Tensor:
    """Per-expert GEMM: rows ``offsets[e]:offsets[e+1]`` of ``x [T, K]`` times ``w[e].T`` (``w
    [E, N, K]``) -> ``[T, N]`` in ``x``'s dtype, fp32 accumulation. A row's result never depends
    on how many rows share its expert in invariant mode (fixed tiles, no split-K)."""
    if w.dim() != 3 or x.dim() != 2 or w.shape[2] != x.shape[1]:
        raise ValueError(f"grouped_linear: x [T, K] and w [E, N, K] expected, got {tuple(x.shape)}, {tuple(w.shape)}")
    if offsets.dim() != 1 or offsets.shape[0] != w.shape[0] + 1:
        raise ValueError(f"grouped_linear: offsets must be [E + 1] = [{w.shape[0] + 1}], got {tuple(offsets.shape)}")
    return _gemm("grouped_linear", x, w, fp, x, w, offsets)


def sparse_attention(q: torch.Tensor, pools, idx, sink: torch.Tensor, scale: float,
                     fp: FloatSemantics | None = None) -> torch.Tensor:
    """Shared-KV attention over candidates given as row indices into cache pools.

    q ``[T, H, D]``; ``pools[i]`` ``[N_i, D]`` (key = value); ``idx[i]`` int ``[T, K_i]`` rows of
    ``pools[i]``, -1 = none; sink ``[H]`` fp32 (denominator only). Softmax over the union of all
    valid candidates (pool 0's in column order, then pool 1's, ...) plus the sink, fp32
    accumulation, output in ``q``'s dtype."""
    pools, idx = tuple(pools), tuple(idx)
    if len(pools) != len(idx) or not pools:
        raise ValueError(f"sparse_attention: one index tensor per pool, got {len(pools)} pools, {len(idx)} indices")
    T, _, D = q.shape
    for i, (p, j) in enumerate(zip(pools, idx)):
        if p.dim() != 2 or p.shape[1] != D or j.dim() != 2 or j.shape[0] != T:
            raise ValueError(f"sparse_attention: pools[{i}] must be [N, {D}] and idx[{i}] [{T}, K], "
                             f"got {tuple(p.shape)}, {tuple(j.shape)}")
    return _gemm("sparse_attention", q, q, fp, q, pools, idx, sink, scale)


def hc_mix(flat: torch.Tensor, fn: torch.Tensor, eps: float, fp: FloatSemantics | None = None) -> torch.Tensor:
    """mHC projection: ``(flat @ fn.T) * rsqrt(mean(flat^2) + eps)`` (weightless RMS)."""
    return _gemm("hc_mix", flat, fn, fp, flat, fn, eps)


def indexer_scores(q, w, k, fp: FloatSemantics | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Lightning-indexer score ``I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])``; q ``[T, h, d]``,
    w ``[T, h]``, keys shared ``k [S, d]`` or per row ``k [T, S, d]`` -> ``[T, S]``. With ``rows``
    (int ``[T, E]``) the keys are a pool ``k [N, d]`` and query ``t`` scores the pool rows
    ``rows[t]`` (``-1``: no entry, scored ``-inf``) -> ``[T, E]``, read by index on the GPU (no
    gathered copy); the same bits as passing the gathered keys ``k[rows]``. The pool may hold V4's
    packed e4m3 keys (uint8 rows, ``ops/fp8_keys.py``): scored as their unpacked values."""
    if rows is not None:
        if q.dim() != 3 or rows.dim() != 2 or rows.shape[0] != q.shape[0] or k.dim() != 2 or not fp8_keys.holds(k, q.shape[2]):
            raise ValueError(f"indexer_scores: q [T, h, d], pool [N, d] and rows [T, E] expected, got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(rows.shape)}")
        return _gemm("indexer_scores_rows", q, q, fp, q, w, k, rows)
    return _gemm("indexer_scores", q, q, fp, q, w, k)


def attention_with_sink(q, keys, mask, sink, scale: float, fp: FloatSemantics | None = None) -> torch.Tensor:
    """Shared-KV attention, q ``[T, H, c]``, keys ``[T, K, c]``, mask ``[T, K]``, sink ``[H]``."""
    return _gemm("attention_with_sink", q, q, fp, q, keys, mask, sink, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in at least fp32, returned in ``x``'s dtype."""
    return _run("rms_norm", x, x, weight, eps)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _run("softmax", x, x, dim)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Log-probabilities over ``dim`` (for logprob comparisons and RL losses)."""
    return _run("log_softmax", x, x, dim)


def weighted_pool(kv: torch.Tensor, score: torch.Tensor, dim: int) -> torch.Tensor:
    """Gated pooling: ``sum_j softmax_j(score) * kv_j`` along ``dim`` (per channel)."""
    return _run("weighted_pool", kv, kv, score, dim)


def hc_read(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """mHC read ``sum_j pre_j x_j``: ``x [N, n, d]``, ``pre [N, n]`` -> ``[N, d]``."""
    return _run("hc_read", x, x, pre)


def hc_write(x, out, post, comb) -> torch.Tensor:
    """mHC write ``x'_k = post_k * out + sum_j comb[j, k] x_j``."""
    return _run("hc_write", x, x, out, post, comb)


def moe_combine(y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Routed expert outputs ``y [N, k, d]`` (expert ids ``idx [N, k]``) summed per token."""
    return _run("moe_combine", y, y, idx)


def topk(x: torch.Tensor, k: int, stable: bool = False):
    """(values, indices) of the ``k`` largest along the last dim, descending."""
    return _run("topk", x, x, k, stable)


def sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:  # noqa: A001
    return _run("sum", x, x, dim, keepdim)


def exp(x):
    return _run("exp", x, x)


def sigmoid(x):
    return _run("sigmoid", x, x)


def silu(x):
    return _run("silu", x, x)


def softplus(x):
    return _run("softplus", x, x)


def cos(x):
    return _run("cos", x, x)


def sin(x):
    return _run("sin", x, x)


__all__ = [
    "IEEE", "MODES", "FloatSemantics", "FloatSemanticsError", "NoImplementation", "QuantizedWeight", "attention_with_sink",
    "call_site", "counters", "grouped_linear", "register", "reset_counters", "resolve", "sparse_attention", "table", "cos", "exp",
    "get_mode", "hc_mix", "hc_read", "hc_write", "indexer_scores", "linear", "log_softmax", "mode", "moe_combine",
    "opt_in", "recorded", "rms_norm", "set_mode", "sigmoid", "silu", "sin", "softmax", "softplus",
    "sum", "topk", "weighted_pool",
]
