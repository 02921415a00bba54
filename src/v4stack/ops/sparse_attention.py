"""Sparse attention over candidate indices into cache pools: the torch references.

``sparse_attention(q, pools, idx, sink, scale)`` (the signature ``ops.sparse_attention`` exposes)
gathers each row's candidates - pool 0's in index-column order, then pool 1's, ... - with ``-1``
columns hidden, and runs the shared-KV attention with a sink of ``fast`` or ``invariant`` mode on
them. The invariant reference therefore gives the same bits as ``attention_with_sink`` over the
same candidates in the same order (the candidate sums run in fixed blocks of 64, so trailing
``-1`` columns change no bit). GPU kernels read rows by index instead of gathering
(``v4stack.kernels.sparse_attention``).
"""

from __future__ import annotations

import torch

from v4stack.ops import core, invariant


def gather(pools, idx) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate keys ``[T, K, D]`` (K = sum of K_i) and their mask ``[T, K]`` (False for -1)."""
    keys, masks = [], []
    for p, j in zip(pools, idx):
        j = j.long()
        valid = j >= 0
        if j.numel() and p.shape[0] == 0 and bool(valid.any()):
            raise IndexError("sparse_attention: a pool with no rows has valid candidates")
        if j.numel() and bool(valid.any()) and int(j.max()) >= p.shape[0]:
            raise IndexError(f"sparse_attention: candidate index {int(j.max())} past the pool's {p.shape[0]} rows")
        rows = p[j.clamp(min=0)] if p.shape[0] else p.new_zeros(*j.shape, p.shape[1])
        keys.append(rows)
        masks.append(valid)
    return torch.cat(keys, 1), torch.cat(masks, 1)


_BUDGET = 1 << 24  # elements of one gathered key chunk [rows, K, D]


def _chunked(attend, q, pools, idx, sink, scale):
    """Gather and attend in chunks of query rows (rows never mix: chunking changes no bit)."""
    T, _, D = q.shape
    K = sum(int(j.shape[1]) for j in idx)
    out = torch.empty_like(q)
    rows = max(1, min(T, _BUDGET // max(1, K * D)))
    for t0 in range(0, T, rows):
        sl = slice(t0, t0 + rows)
        keys, mask = gather(pools, [j[sl] for j in idx])
        out[sl] = attend(q[sl], keys.to(q.dtype), mask, sink, scale)
    return out


def fast(q, pools, idx, sink, scale):
    return _chunked(core.attention_with_sink, q, pools, idx, sink, scale)


def reference(q, pools, idx, sink, scale):
    """Invariant mode: bit-identical to ``invariant.attention_with_sink`` over the gathered rows."""
    return _chunked(invariant.attention_with_sink, q, pools, idx, sink, scale)
