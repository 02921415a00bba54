"""The registrations of ``ops``' dispatch table: torch references for every op in both modes
(any device), then the GPU kernels of ``v4stack.kernels`` ahead of them on CUDA.

A GPU kernel's ``accepts`` is its contract check (``v4stack.kernels.contract``): a call outside
the contract (a width the tiles do not divide, an unsupported dtype) falls through to the next
registered implementation - the torch reference of the same mode, which is invariant on any
device. Kernel modules are imported on first use, so the package imports without TileLang or
Triton.
"""

from __future__ import annotations

from v4stack.ops import core, grouped, indexer_rows, invariant, sparse_attention
from v4stack.ops.dispatch import register

REFERENCE_OPS = ("linear", "rms_norm", "softmax", "log_softmax", "hc_mix", "weighted_pool", "indexer_scores",
                 "attention_with_sink", "hc_read", "hc_write", "moe_combine", "topk", "sum", "exp", "sigmoid",
                 "silu", "softplus", "cos", "sin")

for _op in REFERENCE_OPS:
    register(_op, "torch", getattr(core, _op), mode="fast")
    register(_op, "torch_invariant", getattr(invariant, _op), mode="invariant")

register("sparse_attention", "torch_gather", sparse_attention.fast, mode="fast")
register("sparse_attention", "torch_gather_invariant", sparse_attention.reference, mode="invariant")
register("indexer_scores_rows", "torch_gather", indexer_rows.fast, mode="fast")
register("indexer_scores_rows", "torch_gather_invariant", indexer_rows.reference, mode="invariant")
register("grouped_linear", "torch_loop", grouped.fast, mode="fast")
register("grouped_linear", "torch_loop_invariant", grouped.reference, mode="invariant")


def _dequantized(x, qw):
    """A block-scaled weight dequantised once per (dtype, device) (cached on the weight), then the
    dense GEMM of the active mode."""
    from v4stack.ops import _gemm

    return _gemm("linear", x, x, None, x, qw.dense(x.dtype, x.device))


for _fmt in ("fp8", "fp4"):
    register("linear", "dequantize_cached", _dequantized, fmt=_fmt)

from v4stack.kernels import gpu  # noqa: E402  (the CUDA registrations; imports no GPU library)

gpu.register_all(register)
