"""The model runner: a scheduled step -> flat tensors -> one model call -> last-row logits.

It lays every scheduled request's new tokens end to end (token ids, positions, the request of
each row, ``cu_seqlens``), and adds per request its state slot and block table, the slot mapping
of every compressed entry that closes in the step (per compression ratio: pool row = block id *
entries per block + entry % entries per block) and the boundary captures the cache manager asked
for. The model's incremental path (``V4Model.step_paged``) consumes that description and writes
the pools in place; afterwards the cache manager only does book-keeping.
"""

from __future__ import annotations

import torch

from v4stack.model import V4Model
from v4stack.model.paged import Captures, Closing, StepBatch
from v4stack.serve.cache.manager import CacheManager, RequestCache


def _long(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


class ModelRunner:
    def __init__(self, model: V4Model, cache: CacheManager):
        self.model, self.cache = model, cache
        self.device = model.embed.weight.device
        self.ratios = sorted({r for r in model.cfg.layer_ratios if r})
        self.last_bytes = 0

    def build(self, chunks: list[tuple[RequestCache, list[int]]], captures: list[dict[int, int]]) -> StepBatch:
        """The flat description of one step: ``chunks`` are (request cache, tokens it feeds)."""
        dev, B = self.device, self.cache.B
        lens = [len(t) for _, t in chunks]
        pos0 = [rc.pos for rc, _ in chunks]
        ends = [p + n for p, n in zip(pos0, lens)]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        ids = [t for _, toks in chunks for t in toks]
        lens_t = torch.tensor(lens)
        seq = torch.repeat_interleave(torch.arange(len(chunks)), lens_t)
        row0 = torch.tensor(cu[:-1])
        positions = torch.arange(cu[-1]) - row0[seq] + torch.tensor(pos0)[seq]
        nb = max(1, max(len(rc.blocks) for rc, _ in chunks))
        table = torch.full((len(chunks), nb), -1, dtype=torch.long)
        for i, (rc, _) in enumerate(chunks):
            table[i, : len(rc.blocks)] = torch.tensor(rc.blocks, dtype=torch.long)
        closing = {}
        for r in self.ratios:
            per = B // r
            s_l, e_l = [], []
            for i, (p, e) in enumerate(zip(pos0, ends)):
                for ent in range(p // r, e // r):
                    s_l.append(i)
                    e_l.append(ent)
            s_t, e_t = torch.tensor(s_l, dtype=torch.long), torch.tensor(e_l, dtype=torch.long)
            dest = table[s_t, e_t // per] * per + e_t % per
            closing[r] = Closing(s_t.to(dev), e_t.to(dev), dest.to(dev))
        cs, cp, cl = [], [], []
        for i, caps in enumerate(captures):
            for P, slot in sorted(caps.items()):
                cs.append(i)
                cp.append(P)
                cl.append(slot)
        return StepBatch(
            ids=_long(ids, dev), positions=positions.to(dev), seq=seq.to(dev), row0=row0.to(dev),
            pos0=_long(pos0, dev), end=_long(ends, dev), slots=_long([rc.slot for rc, _ in chunks], dev),
            block_table=table.to(dev), max_end=max(ends), decode=all(n == 1 for n in lens),
            closing=closing, captures=Captures(_long(cs, dev), _long(cp, dev), _long(cl, dev)) if cs else None,
            out_rows=_long([c - 1 for c in cu[1:]], dev),
        )

    def run(self, chunks: list[tuple[RequestCache, list[int]]], all_rows: bool = False) -> torch.Tensor:
        """Run one step; returns the logits of each request's last fed row ``[len(chunks), V]``
        (of every fed row with ``all_rows``). The caches advance past the fed tokens."""
        caps = self.cache.plan_captures(chunks)
        batch = self.build(chunks, caps)
        if all_rows:
            batch.out_rows = None
        before = self.cache.paged.bytes_written
        logits = self.model.step_paged(batch, self.cache.paged)
        self.last_bytes = self.cache.paged.bytes_written - before
        for (rc, toks), c in zip(chunks, caps):
            self.cache.advance(rc, toks, c)
        return logits
