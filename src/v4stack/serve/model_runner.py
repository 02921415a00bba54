"""The model runner: a scheduled step -> flat tensors -> one model call -> last-row logits.

It lays every scheduled request's new tokens end to end (token ids, positions, the request of
each row, ``cu_seqlens``), and adds per request its state slot and block table, the slot mapping
of every compressed entry that closes in the step (per compression ratio: pool row = block id *
entries per block + entry % entries per block) and the boundary captures the cache manager asked
for. The model's incremental path (``V4Model.step_paged``) consumes that description and writes
the pools in place; afterwards the cache manager only does book-keeping.
"""

from __future__ import annotations

import numpy as np
import torch

from v4stack.model import V4Model
from v4stack.model.paged import Captures, Closing, StepBatch
from v4stack.serve.cache.manager import CacheManager, RequestCache


def _long(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _slots(n: int, rows: int) -> int:
    """Static slots for ``n`` listed rows: 0 for none, else the next power of two, at most ``rows``."""
    return 0 if n == 0 else min(rows, 1 << (n - 1).bit_length())


class ModelRunner:
    def __init__(self, model: V4Model, cache: CacheManager):
        self.model, self.cache = model, cache
        self.device = model.embed.weight.device
        self.ratios = sorted({r for r in model.cfg.layer_ratios if r})
        self.last_bytes = 0
        self._arange: dict[int, torch.Tensor] = {}
        self.graphed = False
        self.graphs = None  # serve/graphs.py: DecodeGraphs, installed by the engine on CUDA
        # decode steps' block tables, kept per state slot between steps (``_refresh_tables``): a row is
        # written when its request's block list is new to the slot or has grown, so a step copies
        # O(new blocks) ids per request on the host, not the whole table
        n = cache.slots.n_slots + 1
        self._tab = np.full((n, 0), -1, dtype=np.int64)
        self._tab_n = [0] * n
        self._tab_of: list = [None] * n  # the block list each row mirrors (held: its id stays unique)

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

    def build_decode(self, chunks: list[tuple[RequestCache, list[int]]], rows: int, width: int,
                     captures: list[dict[int, int]] | None = None) -> StepBatch:
        """A decode step (one token per request) in static shapes: ``rows`` rows (padding rows use
        the scratch slot, an empty block table and position 0), block tables ``width`` wide, per
        ratio the rows whose entry closes in this step, listed in a power-of-two number of
        closing slots (``closing_caps``; extra slots repeat the first closing row and write to the
        scratch block; none when no entry closes), and the boundary captures the same way (extra
        ones write the snapshot pool's scratch slot). Entries are listed up to the table width,
        so the shapes depend on ``(rows, width, caps)`` only - what a captured graph needs;
        ``caps`` is the closing slots per ratio, then the capture slots."""
        caps = self.closing_caps(chunks, rows) + (self.capture_cap(captures, rows),)
        return self.decode_batch(self.decode_host(chunks, rows, width, caps, captures=captures).to(self.device),
                                 rows, width, caps)

    @staticmethod
    def capture_cap(captures: list[dict[int, int]] | None, rows: int) -> int:
        """Capture slots of a decode step: 0 without captures, else the next power of two of their
        number (a decode token closes at most one block, so at most ``rows``)."""
        return _slots(sum(map(len, captures)) if captures else 0, rows)

    def closing_caps(self, chunks: list[tuple[RequestCache, list[int]]], rows: int,
                     pos: np.ndarray | None = None) -> tuple[int, ...]:
        """Closing slots per ratio of a decode step: 0 when no entry closes, else the next power of
        two of the number of rows whose entry closes (at most ``rows``). ``pos``: the chunks'
        positions, when the caller has them."""
        if pos is None:
            pos = np.fromiter((rc.pos for rc, _ in chunks), dtype=np.int64, count=len(chunks))
        caps = []
        for r in self.ratios:
            caps.append(_slots(int(np.count_nonzero((pos + 1) % r == 0)), rows))
        return tuple(caps)

    def decode_layout(self, chunks: list[tuple[RequestCache, list[int]]], rows: int, width_of, src=None,
                      captures: list[dict[int, int]] | None = None):
        """A static decode step's shape and host layout in one pass over the chunks: ``(width,
        caps, host)`` with ``width = width_of(most blocks of a request)`` and ``host`` as
        ``decode_host`` lays it out."""
        rcs, pos, slots, most = self._gather(chunks)
        width = width_of(max(1, most))
        caps = self.closing_caps(chunks, rows, pos) + (self.capture_cap(captures, rows),)
        return width, caps, self._layout([t[0] for _, t in chunks], pos, slots, len(rcs), rows, width, caps, src,
                                         captures)

    def decode_host(self, chunks: list[tuple[RequestCache, list[int]]], rows: int, width: int,
                    caps: tuple[int, ...], src=None, captures: list[dict[int, int]] | None = None) -> torch.Tensor:
        """The varying part of a static decode step as one int64 host tensor (one copy moves it):
        ids, positions, ends, state slots, feed sources ``[rows]`` each (``src``: the row of the
        previous step's device draws a row's id is taken from, -1 for none;
        ``DecodeGraphs``), the block table ``[rows, width]``, then per ratio the closing slots'
        request row, entry number and destination pool row (``[cap]`` each), then the captures'
        request row, position and snapshot slot (``[caps[-1]]`` each)."""
        rcs, pos, slots, _ = self._gather(chunks)
        return self._layout([t[0] for _, t in chunks], pos, slots, len(rcs), rows, width, caps, src, captures)

    def _gather(self, chunks: list[tuple[RequestCache, list[int]]]):
        """The chunks' caches, positions (int64 array) and state slots, with the per-slot block
        tables brought up to date; also the most blocks any of them has."""
        rcs = [rc for rc, _ in chunks]
        slots = [rc.slot for rc in rcs]
        most = self._refresh_tables(rcs, slots)
        return rcs, np.array([rc.pos for rc in rcs], dtype=np.int64), slots, most

    def _layout(self, ids_l, pos_n, slots_l, n: int, rows: int, width: int, caps: tuple[int, ...],
                src=None, captures=None) -> torch.Tensor:
        B, R, W = self.cache.B, rows, width
        T = 5 * R  # where the table starts
        out = np.empty(T + R * W + 3 * sum(caps), dtype=np.int64)
        ids, pos, end, slots, feed = (out[i * R : (i + 1) * R] for i in range(5))
        table = out[T : T + R * W].reshape(R, W)
        if src is None:
            feed[:] = -1
        else:
            feed[:n] = src
            feed[n:] = -1
        ids[:n] = ids_l
        ids[n:] = 0
        pos[:n] = pos_n
        pos[n:] = 0
        np.add(pos, 1, out=end)
        slots[:n] = slots_l
        slots[n:] = self.cache.slots.scratch
        table[n:] = -1
        if n:
            tab = self._tab
            if tab.shape[1] < W:
                self._grow_tables(W)
                tab = self._tab
            table[:n] = tab[slots[:n], :W]
        off, scratch = T + R * W, self.cache.blocks.scratch
        for r, cap in zip(self.ratios, caps[:-1]):
            if cap == 0:
                continue
            per = B // r
            seq, entry, dest = out[off : off + cap], out[off + cap : off + 2 * cap], out[off + 2 * cap : off + 3 * cap]
            rows_ = np.flatnonzero((pos[:n] + 1) % r == 0)
            k = len(rows_)
            seq[:k], seq[k:] = rows_, rows_[0]
            np.floor_divide(pos[seq], r, out=entry)
            dest[:k] = table[rows_, np.minimum(entry[:k] // per, W - 1)] * per + entry[:k] % per
            dest[k:] = scratch * per
            off += 3 * cap
        cap = caps[-1]
        if cap:
            seq, at, slot = out[off : off + cap], out[off + cap : off + 2 * cap], out[off + 2 * cap : off + 3 * cap]
            k = 0
            for i, c in enumerate(captures):
                for P, s in c.items():
                    seq[k], at[k], slot[k] = i, P, s
                    k += 1
            seq[k:], at[k:], slot[k:] = seq[0], at[0], self.cache.snap.scratch
        return torch.from_numpy(out)

    def _grow_tables(self, need: int) -> None:
        tab = self._tab
        grown = np.full((tab.shape[0], max(need, 2 * tab.shape[1])), -1, dtype=np.int64)
        grown[:, : tab.shape[1]] = tab
        self._tab = grown

    def _refresh_tables(self, rcs: list[RequestCache], slots: list[int]) -> int:
        """Bring the per-slot block tables ``[slots + 1, *]`` (-1 past a request's blocks) up to
        date for ``rcs``; returns the most blocks any of them has. A slot whose request's block
        list is another list object than the one its row mirrors (a new admission, a restore, a
        freed and re-filled slot: the cache manager replaces the list, ``CacheManager.free`` /
        ``admit``) is rewritten, one whose list grew gets the new ids only (block lists only ever
        grow in place); an unchanged one costs two comparisons."""
        of, have_n = self._tab_of, self._tab_n
        most = 0
        stale = []
        for rc, s in zip(rcs, slots):
            blocks = rc.blocks
            n = len(blocks)
            if n > most:
                most = n
            if of[s] is not blocks or n != have_n[s]:
                stale.append((s, blocks, n))
        if stale:
            if self._tab.shape[1] < most:
                self._grow_tables(most)
            tab = self._tab
            for s, blocks, n in stale:
                have = have_n[s]
                if of[s] is not blocks or n < have:
                    tab[s, :n] = blocks
                    tab[s, n : max(n, have)] = -1
                    of[s] = blocks
                else:
                    tab[s, have:n] = blocks[have:]
                have_n[s] = n
        return most

    def decode_batch(self, buf: torch.Tensor, rows: int, width: int, caps: tuple[int, ...]) -> StepBatch:
        """The ``StepBatch`` whose tensors are views into ``buf`` (``decode_host``'s layout on the
        device), so refreshing ``buf`` refreshes the whole step."""
        R, W = rows, width
        ar = self._arange.get(R)
        if ar is None:
            ar = self._arange[R] = torch.arange(R, device=self.device)
        pos = buf[R : 2 * R]
        closing, off = {}, 5 * R + R * W
        for r, cap in zip(self.ratios, caps[:-1]):
            if cap:
                closing[r] = Closing(buf[off : off + cap], buf[off + cap : off + 2 * cap], buf[off + 2 * cap : off + 3 * cap])
                off += 3 * cap
        cap = caps[-1]
        captures = Captures(buf[off : off + cap], buf[off + cap : off + 2 * cap], buf[off + 2 * cap : off + 3 * cap]) \
            if cap else None
        return StepBatch(
            ids=buf[:R], positions=pos, seq=ar, row0=ar, pos0=pos, end=buf[2 * R : 3 * R],
            slots=buf[3 * R : 4 * R], block_table=buf[5 * R : 5 * R + R * W].view(R, W), max_end=W * self.cache.B,
            decode=True, closing=closing, captures=captures, out_rows=None,
        )

    def run(self, chunks: list[tuple[RequestCache, list[int]]], all_rows: bool = False,
            ids: torch.Tensor | None = None, src: list[int] | None = None, draw: bool = False):
        """Run one step; returns the logits of each request's last fed row ``[len(chunks), V]``
        (of every fed row with ``all_rows``). The caches advance past the fed tokens. A decode
        step with no boundary capture replays a captured CUDA graph when ``graphs`` is set
        (``graphed`` says whether it did).

        ``ids`` (a decode step through ``graphs`` only): the step's token ids as a device tensor;
        ``src``: row ``t``'s id is row ``src[t]`` of the previous step's draws, made inside its
        graph (``Sampled.fed``). The chunks then carry a placeholder token each, which
        ``cache.advance`` records and the caller replaces with the real id once it is read back
        (``RequestCache.tokens``). Such a step must close no block (its hash would need the ids).

        ``draw``: the rows are all plain greedy ones; a step through ``graphs`` then draws them
        inside its graph and returns their ``Sampled`` instead of the logits."""
        before = self.cache.paged.bytes_written
        g = self.graphs
        caps = self.cache.plan_captures(chunks)  # (a placeholder's block: planned without its hash)
        if ids is None and src is None:
            self.graphed = g is not None and not all_rows and \
                all(len(t) == 1 for _, t in chunks) and len(chunks) <= g.max_rows
        else:  # placeholder tokens, one per chunk
            self.graphed = g is not None and not all_rows and len(chunks) <= g.max_rows
            if not self.graphed:
                raise ValueError("run: device token ids need a static decode step")
        if self.graphed:
            out = g.run(self, chunks, ids, src, draw, caps if any(caps) else None)
        else:
            batch = self.build(chunks, caps)
            if all_rows:
                batch.out_rows = None
            out = self.model.step_paged(batch, self.cache.paged)
        self.last_bytes = self.cache.paged.bytes_written - before
        self.cache.advance_all(chunks, caps)
        return out
