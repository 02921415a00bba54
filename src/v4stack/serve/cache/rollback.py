"""Undo what a rejected draft token wrote into the cache.

A verify step feeds a request its pending token and a draft at position ``P``. Feeding ``P``
writes, per layer, one row of each ring in the request's state slot (the window row
``P % n_win``, the compressor and indexer tail rows ``P % (coff * m)``) and, when ``P`` closes a
compressed block, that entry's row in the paged pools (compressed KV and indexer key). If the
draft is rejected those rows must read as if ``P`` had never been fed: ``save`` copies them
before the step, ``restore`` writes them back for the rejected requests. Block book-keeping
(positions, fill counts, published hashes) never sees the draft: the engine advances the
request's cache by its accepted tokens only.

(None of these rows is read again before the next token at ``P`` overwrites it - a ring row
holds ``P - R`` which no query at ``>= P`` needs, and an entry counts as closed only once the
request's position passes it - so decoding is exact either way; the restore keeps the pools
equal, bit for bit, to those of a run that never drafted, which is what a saved or snapshotted
cache must hold.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from v4stack.serve.cache.manager import CacheManager, RequestCache


@dataclass
class SavedRows:
    # (flattened pool, its rows, their old contents, the item of each row: on the device, on the host)
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]] = field(default_factory=list)
    n_items: int = 0

    def restore(self, rejected: list[int]) -> int:
        """Write back the rows of the items in ``rejected``; returns the bytes written. No host
        sync: one small copy of the rejected flags, then per pool a gather, a select, a scatter
        (rows of accepted items are written back with their current contents)."""
        if not rejected or not self.parts:
            return 0
        rej = set(rejected)
        dev = self.parts[0][1].device
        flags = torch.tensor([i in rej for i in range(self.n_items)], device=dev)
        n = 0
        for flat, rows, old, owner, owner_host in self.parts:
            k = sum(1 for o in owner_host if o in rej)
            if not k:
                continue
            vals = old if k == len(owner_host) else torch.where(flags[owner].unsqueeze(-1), old,
                                                                 flat.index_select(0, rows))
            flat.index_copy_(0, rows, vals)
            n += k * old.shape[-1] * old.element_size()
        return n


def save(cache: CacheManager, items: list[tuple[RequestCache, int]]) -> SavedRows:
    """Copy the rows that feeding position ``P`` writes, for each ``(request cache, P)`` (its
    blocks must already cover ``P``)."""
    out = SavedRows(n_items=len(items))
    if not items:
        return out
    dev = next(iter(cache.slots.tensors.values()))[0].device
    slot = torch.tensor([rc.slot for rc, _ in items], dtype=torch.long).to(dev)
    pos = torch.tensor([P for _, P in items], dtype=torch.long).to(dev)
    every_host = list(range(len(items)))
    every_dev = torch.arange(len(items), device=dev)
    for ts in cache.slots.tensors.values():
        R = ts[0].shape[1]
        rows = slot * R + pos % R
        for t in ts:
            flat = t.view(-1, t.shape[-1])
            out.parts.append((flat, rows, flat.index_select(0, rows), every_dev, every_host))
    for g in cache.spec.paged:
        m, per = g.ratio, g.rows
        own, rows = [], []
        for i, (rc, P) in enumerate(items):
            if (P + 1) % m == 0:
                e = P // m
                own.append(i)
                rows.append(rc.blocks[e // per] * per + e % per)
        if own:
            flat = cache.blocks.storage[(g.kind, g.layer)].view(-1, g.width)
            r = torch.tensor(rows, dtype=torch.long, device=dev)
            out.parts.append((flat, r, flat.index_select(0, r), torch.tensor(own, device=dev), own))
    return out
