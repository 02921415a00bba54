"""Attention over candidates given as indices into cache pools (shared-KV rows: key = value).

    sparse_attention(q [T, H, D], pools [N_i, D]..., idx [T, K_i]..., sink [H], scale) -> [T, H, D]

Candidate columns are pool 0's in index-column order, then pool 1's, ...; ``-1`` is no candidate.
The softmax runs over every valid candidate of every pool plus the per-head sink (denominator
only), with fp32 accumulation, output in ``q``'s dtype.

This torch reference gathers the rows (in bounded chunks of query rows) and calls
``ops.attention_with_sink`` over the concatenated candidate list, so in invariant mode it gives
the same bits as attention over the same candidates in the same column order; trailing ``-1``
columns change no bit.
"""

from __future__ import annotations

from typing import Sequence

import torch

_BUDGET = 1 << 24  # elements of one gathered key chunk [rows, K, D]


def sparse_attention(q: torch.Tensor, pools: Sequence[torch.Tensor], idx: Sequence[torch.Tensor],
                     sink: torch.Tensor, scale: float) -> torch.Tensor:
    from v4stack import ops

    if len(pools) != len(idx):
        raise ValueError(f"sparse_attention: {len(pools)} pools but {len(idx)} index tensors")
    T, H, D = q.shape
    K = sum(int(i.shape[1]) for i in idx)
    out = torch.empty_like(q)
    if T == 0:
        return out
    rows = max(1, min(T, _BUDGET // max(1, K * D)))
    for t0 in range(0, T, rows):
        sl = slice(t0, t0 + rows)
        keys, mask = [], []
        for p, ix in zip(pools, idx):
            ix = ix[sl]
            valid = ix >= 0
            keys.append(p[ix.clamp(min=0)].to(q.dtype))
            mask.append(valid)
        out[sl] = ops.attention_with_sink(q[sl], torch.cat(keys, 1), torch.cat(mask, 1), sink, scale)
    return out
