"""Grouped linear: one call for many experts, rows sorted by expert.

    grouped_linear(x [T, K], w [E, N, K], offsets [E + 1]) -> y [T, N]

Rows ``offsets[e]:offsets[e + 1]`` use ``w[e]``. Accumulation is fp32 (fp64 for fp64 inputs) and
the output has ``x``'s dtype. A row's result never depends on how many rows share its expert in
invariant mode: each expert's rows go through ``ops.linear`` (fixed trees, no split-K). The
weights are used in their own dtype; only the per-expert slice is upcast inside the product, never
a cached copy of all weights.

On CUDA in fast mode with bf16 inputs and ``torch._grouped_mm`` available, one grouped GEMM runs
(offsets stay on the device, so no host sync).
"""

from __future__ import annotations

import torch

from v4stack.ops.mode import get_mode


def _offsets_host(offsets: torch.Tensor) -> list[int]:
    return [int(v) for v in offsets.tolist()]


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    from v4stack import ops

    T, K = x.shape
    E, N, K2 = w.shape
    if K2 != K:
        raise ValueError(f"grouped_linear: weight has in_features {K2}, input has {K}")
    if offsets.numel() != E + 1:
        raise ValueError(f"grouped_linear: offsets must have {E + 1} entries, got {offsets.numel()}")
    if (x.is_cuda and get_mode() == "fast" and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and hasattr(torch, "_grouped_mm") and T > 0):
        try:
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets[1:].to(torch.int32),
                                     out_dtype=torch.bfloat16)
        except (RuntimeError, TypeError):  # shape / arch the grouped kernel does not take
            pass
    y = x.new_empty(T, N)
    off = _offsets_host(offsets)
    for e in range(E):
        a, b = off[e], off[e + 1]
        if b > a:
            y[a:b] = ops.linear(x[a:b], w[e].to(x.dtype) if w.dtype != x.dtype else w[e])
    return y
