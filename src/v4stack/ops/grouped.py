"""Grouped (per-expert) linear: the torch references.

``grouped_linear(x, w, offsets)``: rows ``offsets[e]:offsets[e+1]`` of ``x [T, K]`` (sorted by
expert) times ``w[e].T`` (``w [E, N, K]``) -> ``[T, N]``, fp32 accumulation, ``x``'s dtype. The
invariant reference runs ``invariant.linear`` (a fixed K tree per output) per expert, so a row's
bits depend on its own inputs only. GPU kernels: ``v4stack.kernels.grouped_gemm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from v4stack.ops import invariant


def _check(x, w, offsets) -> list[int]:
    off = [int(v) for v in offsets.tolist()]
    if off[0] != 0 or off[-1] != x.shape[0] or any(b < a for a, b in zip(off, off[1:])):
        raise ValueError(f"grouped_linear: offsets must rise from 0 to T={x.shape[0]}, got {off}")
    return off


def _loop(x, w, offsets, mm) -> torch.Tensor:
    off = _check(x, w, offsets)
    y = x.new_empty(x.shape[0], w.shape[1])
    for e in range(w.shape[0]):
        a, b = off[e], off[e + 1]
        if b > a:
            y[a:b] = mm(x[a:b], w[e])
    return y


def fast(x, w, offsets):
    return _loop(x, w, offsets, lambda a, b: F.linear(a, b if b.dtype == a.dtype else b.to(a.dtype)))


def reference(x, w, offsets):
    return _loop(x, w, offsets, invariant._linear_tree)
