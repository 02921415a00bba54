"""Context parallelism for V4's compressed attention: one sequence split over ``cp`` ranks.

Layout (causal load balance): the sequence of ``T`` tokens is cut into ``2 cp`` chunks of
``C = T / (2 cp)`` positions; rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, so every rank
has one early (cheap) and one late (expensive) chunk. Its local rows are ``[B, 2, C]``: each
sequence of the micro-batch, slot 0 then slot 1. Everything outside attention (linears, mHC,
MoE, the heads) is row-wise and runs on the local rows unchanged.

Per attention layer (``ContextShard.attention``, reached through ``Attention.forward``):

1. **Halo**: every chunk needs the rows just before it: the window keys (``n_win - 1`` rows) and,
   per compressor, the rows of the block it closes first that lie before the chunk plus, for
   CSA's overlapped compressor, the previous block (``pos0 % r + m`` rows). The projected rows
   (window kv, compressor kv and gate scores, the indexer compressor's too) travel packed in one
   ``all_to_all`` (``cp_comm.exchange_rows``); halos may span several earlier chunks.
2. **Entries**: a compressed entry belongs to the chunk holding its block's last token; each chunk
   pools its blocks (the same ``Compressor.pool`` the one-process path runs) into a fixed
   capacity ``max_j(#blocks of chunk j)``, padding the rest.
3. **All-gather and select**: one ``all_gather`` per layer moves entries (and indexer keys,
   packed alongside), a static index keeps the real ones in sequence order - padding removed -
   so every rank holds the whole sequence's ``T / r`` entries exactly as one process would.
4. Candidates per query as in one process: the window, then CSA's top-k by the indexer over all
   entries with causal closure (a block is visible only once complete) or HCA's visible
   entries; one padded attention call.

With the ops in invariant mode every row's forward is computed as in one process, so logits and
per-token losses are bitwise equal to the single-process run. The backward sends halo and entry
gradients back to their owners in fixed order (``cp_comm``); the sums over tokens are grouped by the
split, so gradients equal one process's to rounding. ``train/unit_shard.py`` (``--grad-chunks``) is
the exact variant: every such sum in an order the sequence fixes, bitwise equal across layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn.functional as F

from v4stack.model import rowwise
from v4stack.model.attention import Segment, window_candidates
from v4stack.train.cp_comm import RowPlan, exchange_rows, gather_entries


def projected_rows(attn, x, qr, kv, positions):
    """What a layer's attention exchanges across shards: its row parts (the window's kv, then each
    compressor's projections), the compressors, the indexer's queries and weights (or None), the halo
    ``H`` the parts need (the window's W - 1, a compressor's ratio - 1 plus its overlap), the wire
    dtype and the parts' widths."""
    parts, needs, comps = [kv], [attn.window - 1], []
    if attn.compressor is not None:
        comps.append(attn.compressor)
        parts += list(attn.compressor.project(x, positions))
    iq = iw = None
    if attn.indexer is not None:
        iq, iw = attn.indexer.project(qr, x, positions)
        comps.append(attn.indexer.compressor)
        parts += list(attn.indexer.compressor.project(x, positions))
    for comp in comps:
        needs.append(comp.ratio - 1 + (comp.ratio if comp.overlap else 0))
    wire = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
    return parts, comps, iq, iw, max(needs), wire, [p.shape[-1] for p in parts]


def piece_candidates(attn, piece, window, positions, iq, iw, ents, ikeys):
    """A piece's attention candidates ``(keys [n, K, c], mask [n, K])``: its SWA window (``window(h)``:
    the ``h`` kv rows before the piece, then its own), then its sequence's compressed entries
    ``ents [S, c]`` - the indexer's top-k of them by ``ikeys [S, ci]`` for CSA, all visible for HCA."""
    W, p0 = attn.window, piece.pos0
    pos = positions[piece.rows]
    h = min(W - 1, p0)
    keys, mask = window_candidates(window(h), p0 - h, pos, W)
    keys, mask = [keys], [mask]
    if ents is not None:
        S, m = ents.shape[0], attn.ratio
        visible = ((torch.arange(S, device=ents.device) + 1) * m - 1).unsqueeze(0) <= pos.unsqueeze(1)
        if ikeys is not None:
            sel, valid = attn.indexer.select(iq[piece.rows], iw[piece.rows], ikeys, visible)
            keys.append(ents[sel])
            mask.append(valid)
        else:
            keys.append(ents.unsqueeze(0).expand(piece.length, S, ents.shape[-1]))
            mask.append(visible)
    return torch.cat(keys, 1), torch.cat(mask, 1)


@dataclass(frozen=True)
class Layout:
    cp: int
    rank: int
    seq_len: int

    def __post_init__(self):
        if self.cp < 1 or self.seq_len % (2 * self.cp):
            raise ValueError(f"train field 'seq_len' ({self.seq_len}) must be a multiple of 2 x cp "
                             f"(= {2 * self.cp}) for context parallelism")

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.cp)

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        return r, 2 * self.cp - 1 - r

    def owner(self, j: int) -> tuple[int, int]:
        """(rank, slot) holding chunk ``j``."""
        return (j, 0) if j < self.cp else (2 * self.cp - 1 - j, 1)

    def positions(self, batch: int, device=None) -> torch.Tensor:
        """Positions of the local rows, ``[B * 2 * C]`` in ``[B, 2, C]`` order."""
        C = self.chunk
        one = torch.cat([torch.arange(j * C, (j + 1) * C, device=device) for j in self.chunks()])
        return one.repeat(batch)

    def local(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's share ``[B, 2C]`` of ``tokens [B, T]``."""
        C = self.chunk
        return torch.cat([tokens[:, j * C:(j + 1) * C] for j in self.chunks()], 1)

    def assemble(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's ``[B, 2C, ...]`` (rank order) -> the sequence order ``[B, T, ...]``."""
        C = self.chunk
        out = []
        for j in range(2 * self.cp):
            r, s = self.owner(j)
            out.append(parts[r][:, s * C:(s + 1) * C])
        return torch.cat(out, 1)

    # ---- static plans ---------------------------------------------------------------------

    def row_plan(self, halo: int) -> RowPlan:
        return _row_plan(self, halo)

    def entry_plan(self, ratio: int) -> tuple[int, tuple[tuple[int, int], ...], tuple[int, ...]]:
        """(capacity, per local slot its block range, gather order over ``[cp, 2, cap]``)."""
        return _entry_plan(self, ratio)


@lru_cache(maxsize=64)
def _row_plan(lay: Layout, halo: int) -> RowPlan:
    """Halo slot ``s * halo + k`` of a rank holds position ``pos0(chunk s) - halo + k``."""
    C, cp = lay.chunk, lay.cp
    send: list[list[int]] = [[] for _ in range(cp)]  # this rank -> dest
    recv: list[list[int]] = [[] for _ in range(cp)]  # src -> this rank
    for dest in range(cp):
        for s, j in enumerate(lay.chunks(dest)):
            for k in range(halo):
                p = j * C - halo + k
                if p < 0:
                    continue
                src, src_slot = lay.owner(p // C)
                if src == lay.rank:
                    send[dest].append(src_slot * C + p % C)
                if dest == lay.rank:
                    recv[src].append(s * halo + k)
    return RowPlan(tuple(i for d in send for i in d), tuple(len(d) for d in send),
                   tuple(i for d in recv for i in d), tuple(len(d) for d in recv), 2 * halo)


@lru_cache(maxsize=64)
def _entry_plan(lay: Layout, r: int):
    C = lay.chunk
    blocks = [(j * C // r, (j + 1) * C // r) for j in range(2 * lay.cp)]
    cap = max(hi - lo for lo, hi in blocks)
    order = []
    for j, (lo, hi) in enumerate(blocks):  # sequence order: chunk by chunk
        rank, slot = lay.owner(j)
        order += [(rank * 2 + slot) * cap + e for e in range(hi - lo)]
    mine = tuple(blocks[j] for j in lay.chunks())
    return cap, mine, tuple(order)


# ---- the shard the model's attention runs on ----------------------------------------------------


@dataclass
class ContextShard:
    """Stands in for the segment list of ``V4Model._trunk``: the attention layers ask it for
    their output (``attention``); every other sublayer only sees rows."""

    layout: Layout
    batch: int
    group: object = None
    pieces: list[Segment] = field(init=False)

    def __post_init__(self):
        C = self.layout.chunk
        self.pieces = [Segment(start=(b * 2 + s) * C, length=C, pos0=j * C)
                       for b in range(self.batch) for s, j in enumerate(self.layout.chunks())]

    def attention(self, attn, x, qr, q, kv, positions, layer: int) -> torch.Tensor:
        lay, B, C = self.layout, self.batch, self.layout.chunk
        parts, comps, iq, iw, H, wire, widths = projected_rows(attn, x, qr, kv, positions)
        rows = torch.cat([p.to(wire) for p in parts], -1).view(B, 2 * C, -1).transpose(0, 1)
        halo = exchange_rows(rows, lay.row_plan(H), self.group)  # [2H, B, w]
        halo = halo.view(2, H, B, -1).permute(2, 0, 1, 3)  # [B, 2, H, w]
        halo_parts = [h.to(p.dtype) for h, p in zip(torch.split(halo, widths, -1), parts)]
        own = [p.view(B, 2, C, -1) for p in parts]

        def span(i: int, b: int, s: int, n: int) -> torch.Tensor:
            """Part ``i``'s rows of the ``n`` positions before piece (b, s), then the piece's own."""
            return torch.cat((halo_parts[i][b, s, H - n:], own[i][b, s]))

        ents = ikeys = None
        if comps:
            pooled = [self._pool(comp, span, 1 + 2 * k, kv.dtype) for k, comp in enumerate(comps)]
            gathered = self._gather(torch.cat(pooled, -1), comps[0].ratio)  # [S, B, w]
            ents = gathered[..., : attn.head_dim]
            if attn.indexer is not None:
                ikeys = gathered[..., attn.head_dim:]
        cands = [piece_candidates(attn, piece, lambda h, b=b, s=s: span(0, b, s, h), positions, iq, iw,
                                  None if ents is None else ents[:, b], None if ikeys is None else ikeys[:, b])
                 for piece, (b, s) in zip(self.pieces, ((b, s) for b in range(B) for s in range(2)))]
        return attn._attend(q, self.pieces, cands)

    def _pool(self, comp, span, part: int, dtype) -> torch.Tensor:
        """Entries ``[2, cap, B, w]`` of ``comp`` for the local chunks (zero padding past each
        chunk's blocks); ``part`` / ``part + 1`` are its kv / score among the exchanged parts."""
        r, lb = comp.ratio, comp.ratio if comp.overlap else 0
        cap, mine, _ = self.layout.entry_plan(r)
        out = []
        for b in range(self.batch):
            for s, (lo, hi) in enumerate(mine):
                p0 = self.layout.chunks()[s] * self.layout.chunk
                row0 = max(0, lo * r - lb)
                kv_rows, sc_rows = span(part, b, s, p0 - row0), span(part + 1, b, s, p0 - row0)
                e = comp.pool(kv_rows, sc_rows, row0, range(lo, hi), dtype)
                out.append(torch.cat((e, e.new_zeros(cap - e.shape[0], e.shape[1]))))
        return torch.stack(out).view(self.batch, 2, cap, -1).permute(1, 2, 0, 3)

    def _gather(self, local: torch.Tensor, ratio: int) -> torch.Tensor:
        _, _, order = self.layout.entry_plan(ratio)
        idx = torch.tensor(order, dtype=torch.long, device=local.device)
        return gather_entries(local, idx, self.layout.cp, self.group)


# ---- the loss of a micro-batch under context parallelism ----------------------------------------


@dataclass
class ShardLosses:
    """Per-token losses of this rank's rows ``[B * 2C]`` and the masks of rows with a target:
    the next token (``main``) and, with MTP, the token after it (``mtp``)."""

    main: torch.Tensor
    has: torch.Tensor
    mtp: torch.Tensor | None = None
    mtp_has: torch.Tensor | None = None


def cp_losses(model, tokens: torch.Tensor, layout: Layout, group=None, mtp: bool = False) -> ShardLosses:
    """This rank's next-token losses, and the MTP block's (token t+2) when ``mtp``.

    The MTP block runs on the same local rows as the trunk: one process runs it over positions
    ``0 .. T-2`` (a row needs the next token's embedding); here the last position gets a clamped
    token and no target, which changes nothing before it (attention is causal). Its attention
    layer reaches ``ContextShard.attention`` like the trunk's, so it exchanges its own halo."""
    B, T = tokens.shape
    if T != layout.seq_len:
        raise ValueError(f"context-parallel layout is for seq_len {layout.seq_len}, got {T}")
    pos = layout.positions(B, tokens.device)
    shard = ContextShard(layout, B, group)
    h = model._trunk(layout.local(tokens).reshape(-1), pos, shard)
    return head_losses(model, h, tokens, shard, pos, mtp)


def head_losses(model, h: torch.Tensor, tokens: torch.Tensor, shard: ContextShard, pos: torch.Tensor,
                mtp: bool) -> ShardLosses:
    """The head's (and the MTP block's) per-token losses of the trunk's local streams ``h``."""
    B, T = tokens.shape
    logits = model._head(h)

    def at(k: int) -> torch.Tensor:
        return tokens.gather(1, (pos + k).clamp(max=T - 1).view(B, -1)).reshape(-1)

    out = ShardLosses(F.cross_entropy(logits, at(1), reduction="none"), pos < T - 1)
    if mtp and len(model.mtp):
        nxt = at(1)
        emb = rowwise.module_step(model.embed, model.embed, nxt)
        y = None
        for blk in model.mtp:  # as V4Model.mtp_logits: every block reads the trunk's streams
            y = blk.predict(h, emb, pos, shard, nxt)
        out.mtp = F.cross_entropy(model.head(y), at(2), reduction="none")
        out.mtp_has = pos < T - 2
    return out


def cp_token_losses(model, tokens: torch.Tensor, layout: Layout, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's next-token losses and the mask of rows that have a target (``[B * 2C]`` each)."""
    res = cp_losses(model, tokens, layout, group)
    return res.main, res.has


def cp_loss_value(losses: torch.Tensor, has_target: torch.Tensor, layout: Layout, group=None,
                  shift: int = 1) -> torch.Tensor:
    """The micro-batch's mean loss from every rank's per-token losses, reduced as one process's
    ``F.cross_entropy`` reduces them (the same values in the same order through ``nll_loss``);
    ``shift``: how far ahead the target lies (1 next token, 2 MTP)."""
    B = losses.numel() // (2 * layout.chunk)
    mine = losses.detach().masked_fill(~has_target, 0.0).view(B, -1)
    parts = [mine]
    if layout.cp > 1:
        parts = [torch.empty_like(mine) for _ in range(layout.cp)]
        dist.all_gather(parts, mine.contiguous(), group=group)
    seq = layout.assemble(parts)[:, :-shift].reshape(-1, 1)
    return F.nll_loss(-seq, torch.zeros(seq.shape[0], dtype=torch.long, device=seq.device))


def predicted_tokens(tokens: torch.Tensor) -> int:
    """The number of predicted tokens of a micro-batch (the mean's divisor)."""
    B, T = tokens.shape
    return B * (T - 1)


def shard_means(res: ShardLosses, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This shard's parts of the main and MTP means (sums over its rows / the sequence's counts)."""
    B, T = tokens.shape
    main = res.main[res.has].sum() / predicted_tokens(tokens)
    return main, None if res.mtp is None else res.mtp[res.mtp_has].sum() / (B * (T - 2))


def logged_means(res: ShardLosses, lay: Layout, group=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The micro-batch's main and MTP means, as one process computes them (collective over ``group``)."""
    extra = None if res.mtp is None else cp_loss_value(res.mtp, res.mtp_has, lay, group, 2)
    return cp_loss_value(res.main, res.has, lay, group), extra


def cp_accumulate(model, micro: list[torch.Tensor], scale: float, mesh, mtp_weight: float = 0.0) -> torch.Tensor:
    """Forwards and backwards of one step's micro-batches on this context shard. Each token's
    loss gradient is ``scale / (B (T - 1))`` (MTP: ``mtp_weight scale / (B (T - 2))``), as under
    one process's means; the parameter gradients are this shard's part (the sharded optimizer step
    sums the shards). Returns ``[sum of main losses, sum of MTP losses]`` on the replica's first
    shard, zeros on the others."""
    sums = torch.zeros(2, dtype=torch.float32, device=micro[0].device)
    for tokens in micro:
        B, T = tokens.shape
        lay = Layout(mesh.cp, mesh.cp_rank, T)
        res = cp_losses(model, tokens, lay, mesh.cp_group, mtp=mtp_weight > 0)
        total, extra_part = shard_means(res, tokens)
        if extra_part is not None:
            total = total + mtp_weight * extra_part
        (total * scale).backward()
        value, extra = logged_means(res, lay, mesh.cp_group)
        if mesh.cp_rank == 0:
            sums[0] += value.item()
            sums[1] += 0.0 if extra is None else extra.item()
    return sums
