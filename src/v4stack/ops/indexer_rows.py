"""Indexer scores over per-row keys read by index from a key pool: the torch references.

``indexer_scores(q, w, pool, rows=rows)`` (``ops.indexer_scores`` with ``rows``): query ``t``
scores the pool rows ``rows[t]`` (``pool [N, d]``, ``rows [T, E]`` int, ``-1`` = no entry, scored
``-inf``) -> ``[T, E]``. The references gather the rows in chunks of queries (rows never mix, so
chunking changes no bit) and run the mode's per-row-keys ``indexer_scores`` on them, so in invariant
mode the result is bit-identical to passing the gathered keys ``pool[rows]``. The GPU kernel reads
the rows by index instead (``v4stack.kernels.triton_gemm.indexer_scores``), nothing gathered.
A pool of V4's packed e4m3 keys (``ops/fp8_keys.py``) is scored as its unpacked values.
"""

from __future__ import annotations

import torch

from v4stack.ops import core, fp8_keys, invariant

_BUDGET = 1 << 24  # elements of one gathered key chunk [rows, E, d]


def _check(pool, rows) -> None:
    if rows.dim() != 2 or rows.is_floating_point():
        raise ValueError(f"indexer_scores: rows must be an integer [T, E] tensor, got {rows.dtype} {tuple(rows.shape)}")
    if pool.dim() != 2:
        raise ValueError(f"indexer_scores: with rows, keys must be a pool [N, d], got {tuple(pool.shape)}")
    if rows.numel() and int(rows.max()) >= pool.shape[0]:
        raise IndexError(f"indexer_scores: key row {int(rows.max())} past the pool's {pool.shape[0]} rows")
    if rows.numel() and int(rows.min()) < -1:
        raise IndexError(f"indexer_scores: key row {int(rows.min())} below -1")


def _chunked(scores, q, w, pool, rows):
    _check(pool, rows)
    T, E = rows.shape
    dt = torch.promote_types(q.dtype, w.dtype)
    out = torch.empty(T, E, dtype=dt, device=q.device)
    if T == 0 or E == 0:
        return out
    n = max(1, min(T, _BUDGET // max(1, E * pool.shape[-1])))
    for t0 in range(0, T, n):
        sl = slice(t0, t0 + n)
        r = rows[sl].long()
        keys = pool[r.clamp(min=0)] if pool.shape[0] else pool.new_zeros(*r.shape, pool.shape[1])
        if fp8_keys.is_packed(keys):  # V4's packed keys: their exact values in the queries' dtype
            keys = fp8_keys.unpack(keys, q.dtype, q.shape[-1])
        out[sl] = scores(q[sl], w[sl], keys).masked_fill(r < 0, float("-inf"))
    return out


def fast(q, w, pool, rows):
    return _chunked(core.indexer_scores, q, w, pool, rows)


def reference(q, w, pool, rows):
    """Invariant mode: bit-identical to ``invariant.indexer_scores(q, w, pool[rows])`` (hidden: -inf)."""
    return _chunked(invariant.indexer_scores, q, w, pool, rows)
