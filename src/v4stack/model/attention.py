"""Attention for SWA-only, CSA and HCA layers: one shared-KV latent, window + compressed keys.

Query: ``q = wq_b(q_norm(wq_a(x)))`` per head, weightless RMSNorm per head, RoPE on the tail
(where the attention kernel normalises the queries it loads - ``fused.normalises_queries`` - a
serving step rotates the raw queries and hands them over: the rotation keeps a head's norm).
Key = value: ``kv = kv_norm(wkv(x))`` with RoPE on the tail. Candidates for query ``t``: the window
``[t - n_win + 1, t]`` plus compressed entries (CSA: the indexer's top-k; HCA: every closed
entry). A learned per-head sink logit joins the softmax denominator only. The output gets the
inverse RoPE, then a grouped projection ``wo_a`` (g groups to d_g each) and ``wo_b``.

Rows of several sequences are processed together; ``segments`` says which rows belong to which
sequence, where it starts, and which per-layer state (if any) carries its history.
"""

from __future__ import annotations

from dataclasses import dataclass

import os

import torch
import torch.nn.functional as F
from torch import nn

from v4stack import ops
from v4stack.ops import fp8_keys, fused
from v4stack.config import ModelConfig
from v4stack.model.compressor import Compressor
from v4stack.model.indexer import Indexer
from v4stack.model.linear import Linear, compute_dtype
from v4stack.model.norm import RMSNorm
from v4stack.model import packed
from v4stack.model.paged import PagedStep, Rings, entry_rows, take
from v4stack.model.quant import grouped_weight
from v4stack.model.rope import Rotary
from v4stack.model import rowwise, side
from v4stack.model.state import LayerState


_ATTN_BUDGET = 1 << 25  # elements of one padded key tensor [rows, K, c]


@dataclass
class Segment:
    """Rows ``[start, start + length)`` hold positions ``[pos0, pos0 + length)`` of one sequence."""

    start: int
    length: int
    pos0: int
    state: list[LayerState] | None = None  # per-layer states of the request, or None (fresh, pos0 = 0)

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


def window_candidates(span: torch.Tensor, span_start: int, positions: torch.Tensor, window: int):
    """Per-query window keys ``[n, window, c]`` and mask from rows covering ``[span_start, ...)``."""
    offs = torch.arange(-window + 1, 1, device=span.device)
    idx = (positions - span_start).unsqueeze(1) + offs
    valid = idx >= 0
    return span[idx.clamp(min=0)], valid


def _group_out(o: torch.Tensor, weight: torch.Tensor, groups: int, rank: int) -> torch.Tensor:
    """``wo_a`` as a row step: the grouped projection of ``o [N, g, k]`` by the dense weight."""
    return fused.group_linear(o, weight.view(groups, rank, -1))


class Attention(nn.Module):
    kv_rounding = None  # FP8 rounding of window KV rows when set (model/quant.py: set_act_rounding)
    # V4STACK_INDEX_STREAM=1: a CSA decode step on CUDA runs its indexer on the side stream (``_index_ahead``).
    # Off by default: its GPU test passed on this tree on an H100, where the A/B was even; the gain was
    # measured on an H200 on an earlier tree only (README, "The CSA layer's indexer on a side stream")
    index_stream = os.environ.get("V4STACK_INDEX_STREAM", "0") == "1"

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.groups, self.group_rank = cfg.o_groups, cfg.o_lora_rank
        self.window, self.eps = cfg.sliding_window, cfg.rms_norm_eps
        self.scale = cfg.head_dim ** -0.5
        self.rotary = Rotary(cfg, compressed=ratio != 0)
        d, H, c = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.wq_a = Linear(d, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * c)
        self.wkv = Linear(d, c)
        self.kv_norm = RMSNorm(c, cfg.rms_norm_eps)
        self.wo_a = Linear(H * c // self.groups, self.groups * self.group_rank)
        self.wo_b = Linear(self.groups * self.group_rank, d)
        self.attn_sink = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.compressor = None
        self.indexer = None
        if ratio:
            csa = cfg.is_csa(ratio)
            self.compressor = Compressor(d, c, ratio, csa, self.rotary, cfg.rms_norm_eps)
            if csa:
                self.indexer = Indexer(cfg, ratio, self.rotary)

    def x_linears(self) -> list[Linear]:
        """The linears that read the layer's input rows ``x``: ``wq_a``, ``wkv``, then the
        compressor's ``wkv`` / ``wgate`` and the indexer compressor's where the layer has them,
        then the indexer's head weights (``packed``: a serving step runs them as one GEMM)."""
        lins = [self.wq_a, self.wkv]
        for comp in (self.compressor, self.indexer.compressor if self.indexer is not None else None):
            if comp is not None:
                lins += [comp.wkv, comp.wgate]
        if self.indexer is not None:
            lins.append(self.indexer.weights_proj)
        return lins

    def pack_projections(self) -> bool:
        return packed.pack(self, self.x_linears())

    def forward(self, x: torch.Tensor, positions: torch.Tensor, segments, layer: int):
        N, H, c = x.shape[0], self.n_heads, self.head_dim
        # a serving step (no autograd) rotates its fresh queries and outputs in place
        inplace = isinstance(segments, PagedStep) and not torch.is_grad_enabled() and rowwise._HOOK.get() is None
        # and runs the projections of x as one GEMM where they are packed
        xp = packed.run(self, self.x_linears(), x) if inplace else None
        kv = None
        if xp is not None and self.q_norm.eps == self.kv_norm.eps:  # both norms of the packed projections at once
            qr, kv = fused.rms_norm_pair(xp[0], self.q_norm.weight, xp[1], self.kv_norm.weight, self.q_norm.eps)
        else:
            qr = self.q_norm(self.wq_a(x) if xp is None else xp[0])
        # and shares one table of the angles' cosines and sines between its layers of a kind
        tab = segments.batch.shared(("rope_table", self.ratio != 0), lambda: self.rotary.table(positions)) \
            if inplace else None
        # and a CSA decode step on CUDA runs the indexer's chain beside the query's (``model.side``)
        ahead = self._index_ahead(x, qr, segments, layer, tab, xp) if inplace and self._overlaps(x, segments) \
            else None
        q = self.wq_b(qr).view(N, H, c)
        # and where the attention kernel normalises the queries it loads, hands them over raw
        q_eps = self.eps if inplace and fused.normalises_queries(q) else None
        if q_eps is None:
            q = ops.rms_norm(q, None, self.eps)
        # a decode step rotates its window rows straight into the ring (``_paged``), and a serving
        # decode step its queries in the same call (``fused.rope_pair``)
        direct = isinstance(segments, PagedStep) and segments.batch.decode and rowwise._HOOK.get() is None
        pair = inplace and direct
        if not pair:
            q = self.rotary.apply_(q, positions, table=tab) if inplace else self.rotary.apply(q, positions)
        if kv is None:
            kv = self.kv_norm(self.wkv(x) if xp is None else xp[1])
        if self.kv_rounding is not None:  # the non-RoPE dims only: the same bits before the rotation as after it
            kv = self.kv_rounding(kv)
        if not direct:
            kv = self.rotary.apply(kv, positions)
        if isinstance(segments, PagedStep):
            o = self._paged(x, qr, q, kv, segments, layer, roped=not direct, table=tab, q_eps=q_eps, xp=xp,
                            q_roped=not pair, ahead=ahead)
        elif hasattr(segments, "attention"):  # a context-parallel shard supplies its own candidates
            o = segments.attention(self, x, qr, q, kv, positions, layer)
        else:
            o = self._segments(x, qr, q, kv, positions, segments, layer)
        o = self.rotary.apply_(o, positions, inverse=True, table=tab) if inplace \
            else self.rotary.apply(o, positions, inverse=True)
        g = self.groups
        o = o.reshape(N, g, H * c // g)
        wa = grouped_weight(self.wo_a, g, self.group_rank)  # row slices once its dense copy is dropped
        if isinstance(wa, torch.Tensor):
            o = rowwise.step(_group_out, o, self.wo_a.weight, g, self.group_rank, params=(1,))
        else:
            o = torch.cat([ops.linear(o[:, i], wa[i]) for i in range(g)], dim=-1)
        return self.wo_b(o)

    def _segments(self, x, qr, q, kv, positions, segments: list[Segment], layer: int):
        comp = self.compressor.project(x, positions) if self.compressor is not None else None
        idx_proj = None
        if self.indexer is not None:
            idx_proj = self.indexer.project(qr, x, positions) + self.indexer.compressor.project(x, positions)
        cands = [self._segment(kv, comp, idx_proj, positions, seg, layer) for seg in segments]
        return self._attend(q, segments, cands)

    def _overlaps(self, x: torch.Tensor, segments) -> bool:
        """Whether this step's indexer chain runs on the side stream: a CSA layer's decode step on CUDA."""
        return (self.index_stream and self.indexer is not None and x.is_cuda and isinstance(segments, PagedStep)
                and segments.batch.decode)

    def _index_ahead(self, x, qr, ps: PagedStep, layer: int, table, xp):
        """A CSA decode step's indexer chain enqueued on the side stream (``model.side.Fork``): its
        compressor's tail and closing keys, its queries and head weights, the scores and the top-k.
        What both chains read (the entry rows, the tail rings' rows, the rotation table) is made on
        the main stream first. Returns a callable that joins and gives the candidate rows, or None
        where every entry passes the top-k (nothing to score: the main chain does it)."""
        b, cache = ps.batch, ps.cache
        m = self.ratio
        rows, _ = b.shared(("entries", m), lambda: self._entries(b, m, cache.block_tokens))
        if self.indexer.all_chosen(rows.shape[1]):
            return None
        Rings.dest(b, cache.state[("index_tail", layer)][0].shape[1])
        fork = side.Fork(x.device)
        with fork:
            keys = self._index_close(x, b.positions, ps, layer, xp)
            cands = self.indexer.choose_rows(*self._index_query(qr, x, b.positions, xp, table), keys, rows)

        def joined() -> torch.Tensor:
            fork.join()
            return cands
        return joined

    def _index_close(self, x, pos, ps: PagedStep, layer: int, xp) -> torch.Tensor:
        """The indexer compressor's tail and closing keys written into the pool; the pool's keys
        flattened, one row an entry."""
        ikeys = ps.cache.blocks[("index_keys", layer)]
        self._close(self.indexer.compressor, x, pos, ps, "index_tail", ikeys, layer, None if xp is None else xp[4:6])
        return ikeys.view(-1, ikeys.shape[-1])

    def _index_query(self, qr, x, pos, xp, table):
        """The indexer's queries and head weights of a paged step (from ``xp``'s packed projection
        where given, rotated in place then)."""
        return self.indexer.project(qr, x, pos, None if xp is None else xp[6], inplace=xp is not None, table=table)

    def _paged(self, x, qr, q, kv, ps: PagedStep, layer: int, roped: bool = True, table=None, q_eps=None, xp=None,
               q_roped: bool = True, ahead=None):
        """Attention by index over the pools: the window as ring rows, compressed entries through
        the block table; closing entries and the new ring rows are written into the pools. ``kv``
        not ``roped`` yet (a decode step): rotated straight into the window ring - with the queries
        in place where they are not ``q_roped`` yet (``fused.rope_pair``). ``q_eps``: the queries are
        not normalised yet (``fused.normed_sparse_attention`` does it). ``xp``: the packed
        projections of ``x`` (``x_linears``' order), or None. ``ahead``: the joining callable of the
        indexer's chain on the side stream (``_index_ahead``), or None."""
        b, cache = ps.batch, ps.cache
        pos, W = b.positions, self.window
        ring = cache.state[("swa_kv", layer)]
        if roped:
            win = Rings(ring, (kv,), b, cache)
        else:
            R = ring[0].shape[1]
            args = (pos, self.rotary.freqs_on(pos.device), ring[0].view(-1, ring[0].shape[-1]), Rings.dest(b, R), table)
            if q_roped:
                fused.rope_into(kv, *args)
            else:
                fused.rope_pair(q, kv, *args)
            win = Rings(ring, None, b, cache)
        if b.decode:  # one kernel for the window rows of every row
            win_rows = b.shared(("window", W, win.R), lambda: fused.ring_rows(pos, b.slots, win.R, W)[1])
        else:
            win_rows = b.shared(("window", W, win.R), lambda: win.rows(
                pos.unsqueeze(1) + torch.arange(-W + 1, 1, device=pos.device), b.seq))
        pools, idx = [win.pools[0]], [win_rows]
        win.capture(cache.snap[("swa_kv", layer)], (0.0,))
        if self.compressor is not None:
            m = self.ratio
            ents = cache.blocks[("compressed_kv", layer)]
            self._close(self.compressor, x, pos, ps, "compressor_tail", ents, layer, None if xp is None else xp[2:4])
            rows, visible = b.shared(("entries", m), lambda: self._entries(b, m, cache.block_tokens))
            if ahead is not None:  # the indexer's chain ran on the side stream: its chosen rows
                idx.append(ahead())
            elif self.indexer is not None:
                keys = self._index_close(x, pos, ps, layer, xp)
                if self.indexer.all_chosen(rows.shape[1]):  # every entry fits the top-k: nothing to score
                    idx.append(b.shared(("visible", m), lambda: self._candidates(rows, visible)))
                else:
                    iq, iw = self._index_query(qr, x, pos, xp, table)
                    if visible is None:  # a decode step: the closed entries are the rows >= 0
                        idx.append(self.indexer.choose_rows(iq, iw, keys, rows))
                    else:
                        sel, valid = self.indexer.select_rows(iq, iw, keys, rows, visible)
                        idx.append(torch.where(valid, rows.gather(1, sel), -1))
            else:  # every HCA layer of this ratio reads the same candidates
                idx.append(b.shared(("visible", m), lambda: self._candidates(rows, visible)))
            pools.append(ents.view(-1, ents.shape[-1]))
        if q_eps is None:
            out = ops.sparse_attention(q, pools, idx, self.attn_sink, self.scale)
        else:
            out = fused.normed_sparse_attention(q, pools, idx, self.attn_sink, self.scale, q_eps)
        win.finish()
        return out

    @staticmethod
    def _candidates(rows, visible):
        return rows if visible is None else torch.where(visible, rows, -1)

    @staticmethod
    def _entries(b, m: int, block_tokens: int):
        """Each row's compressed entry rows ``[T, E]`` (-1: none) and which are closed (visible);
        in a decode step (a row's request ends at its token) the closed ones are the rows >= 0,
        and visible is None (``ops.fused.entry_rows``: one kernel)."""
        if b.decode:
            return fused.entry_rows(b.block_table, b.positions, m, block_tokens // m, b.max_end // m), None
        rows = entry_rows(b, m, block_tokens)[b.seq]
        pos = b.positions
        visible = torch.arange(rows.shape[1], device=pos.device).unsqueeze(0) < ((pos + 1) // m).unsqueeze(1)
        return rows, visible & (rows >= 0)

    def _close(self, comp: Compressor, x, pos, ps: PagedStep, kind: str, pool: torch.Tensor, layer: int, proj=None):
        """Feed this step's rows to ``comp``'s tail rings and write the entries that close straight
        into ``pool`` through the step's slot mapping. ``proj``: ``(comp.wkv(x), comp.wgate(x))``
        already computed (the packed projections), or None."""
        b, cache = ps.batch, ps.cache
        state = cache.state[(kind, layer)]
        if b.decode and rowwise._HOOK.get() is None:
            # ``comp.project``'s rows straight into the tail rings (one kernel on CUDA, same bits)
            kvp, gp = (comp.wkv(x), comp.wgate(x)) if proj is None else proj
            fused.tail_write(kvp, gp, comp.ape, pos, comp.ratio, state[0], state[1],
                             Rings.dest(b, state[0].shape[1]), compute_dtype(x.dtype))
            rings = Rings(state, None, b, cache)
        else:
            rings = Rings(state, comp.project(x, pos, proj), b, cache)
        cl = b.closing.get(comp.ratio)
        if cl is not None and cl.seq.numel():
            m = comp.ratio
            fp8 = fp8_keys.is_packed(pool)  # V4's packed indexer keys: entries in x's dtype, then packed
            dt = x.dtype if fp8 else pool.dtype
            lookback = m if comp.overlap else 0
            if b.decode and rowwise._HOOK.get() is None:  # the pooled rows from the rings (one kernel on CUDA)
                kv_rows, score_rows = fused.closing_rows(rings.pools[0], rings.pools[1], b.slots, cl.seq, cl.entry,
                                                         rings.R, m, lookback, comp.coff, comp.width)
                new = comp.entries_of(kv_rows, score_rows, cl.entry, dt)
            else:
                ix = b.shared(("closing", rings.R, m, comp.coff, lookback), lambda: rings.rows(
                    cl.entry.unsqueeze(1) * m - lookback + torch.arange(comp.coff * m, device=pos.device), cl.seq))
                new = comp.pool_rows(take(rings.pools[0], ix, 0.0), take(rings.pools[1], ix, float("-inf")),
                                     cl.entry, dt)
            if fp8:
                fused.pack_keys_into(new, pool, cl.dest)
                cache.count(pool.view(-1, pool.shape[-1])[: new.shape[0]])  # as many bytes as the rows written
            else:
                pool.view(-1, pool.shape[-1]).index_copy_(0, cl.dest, new)
                cache.count(new)
        rings.capture(cache.snap[(kind, layer)], (0.0, float("-inf")))
        rings.finish()

    def _attend(self, q: torch.Tensor, segments: list[Segment], cands) -> torch.Tensor:
        """One attention call for many segments: each row's candidate list is padded with masked
        entries to the group's longest (a masked entry adds nothing, and in invariant mode changes
        no bit). Groups are cut so the padded key tensor stays within a memory budget."""
        outs, i = [], 0
        while i < len(cands):
            j, rows, K = i, 0, 0
            while j < len(cands):
                k = cands[j][0]
                K2, rows2 = max(K, k.shape[1]), rows + k.shape[0]
                if j > i and rows2 * K2 * k.shape[2] > _ATTN_BUDGET:
                    break
                K, rows, j = K2, rows2, j + 1
            keys = torch.cat([F.pad(k, (0, 0, 0, K - k.shape[1])) for k, _ in cands[i:j]])
            mask = torch.cat([F.pad(m, (0, K - m.shape[1])) for _, m in cands[i:j]])
            lo = segments[i].start
            outs.append(rowwise.step(ops.attention_with_sink, q[lo : lo + rows], keys, mask, self.attn_sink, self.scale,
                                     params=(3,)))
            i = j
        return torch.cat(outs)

    def _segment(self, kv, comp, idx_proj, positions, seg: Segment, layer: int):
        """Update the segment's state and return its rows' candidates: keys ``[n, K, c]``, mask."""
        rows, p0, n = seg.rows, seg.pos0, seg.length
        st = seg.state[layer] if seg.state is not None else None
        pos = positions[rows]
        if st is None:
            if p0 != 0:
                raise ValueError("a segment without state must start at position 0")
            span, span_start = kv[rows], 0
        else:
            span_start = max(0, p0 - self.window + 1)
            span = torch.cat((st.read_window(span_start, p0), kv[rows]))
        keys, mask = window_candidates(span, span_start, pos, self.window)
        keys, mask = [keys], [mask]
        snaps = {}
        if st is not None:
            for P in st.capture_at:
                if p0 < P <= p0 + n:
                    snap = snaps[P] = st.blank()
                    lo = max(span_start, P - self.window)
                    snap.write_window(lo, span[lo - span_start : P - span_start])
        if self.compressor is not None:
            ckv, cscore = comp
            new = self.compressor.extend(ckv[rows], cscore[rows], p0, st.tail if st else None, kv.dtype,
                                         {P: sn.tail for P, sn in snaps.items()})
            ents = torch.cat((st.compressed_kv, new)) if st is not None else new
            S = ents.shape[0]
            closes_at = (torch.arange(S, device=kv.device) + 1) * self.ratio - 1
            visible = closes_at.unsqueeze(0) <= pos.unsqueeze(1)  # causal closure: whole blocks only
            if self.indexer is not None:
                iq, iw, ikv, iscore = idx_proj
                comp_i = self.indexer.compressor
                new_k = comp_i.extend(ikv[rows], iscore[rows], p0, st.index_tail if st else None, kv.dtype,
                                      {P: sn.index_tail for P, sn in snaps.items()})
                ikeys = torch.cat((st.index_keys, new_k)) if st is not None else new_k
                sel, valid = self.indexer.select(iq[rows], iw[rows], ikeys, visible)
                keys.append(ents[sel])
                mask.append(valid)
                if st is not None:
                    st.index_keys = ikeys
            else:
                keys.append(ents.unsqueeze(0).expand(n, S, ents.shape[-1]))
                mask.append(visible)
            if st is not None:
                st.compressed_kv = ents
        if st is not None:
            st.write_window(p0, kv[rows])
            st.captured.update(snaps)
        return torch.cat(keys, 1), torch.cat(mask, 1)
