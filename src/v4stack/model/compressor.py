"""Learned gated pooling of KV: one compressed entry per ``m`` tokens.

HCA (non-overlapped): entry ``i`` pools the ``m`` tokens of block ``i`` with per-channel softmax
weights ``softmax_j(z_j + ape_j)``. CSA (overlapped, ``coff = 2``): channels ``[0:c]`` are the
"b" half and ``[c:2c]`` the "a" half; entry ``i`` pools the a-half of block ``i`` together with the
b-half of block ``i-1`` (8 slots for m = 4; block -1 is padding). Every entry gets an RMSNorm and
RoPE at its block's start position ``i * m``. An entry exists only once its block is complete.
"""

from __future__ import annotations

import torch
from torch import nn

from v4stack import ops
from v4stack.ops import fused
from v4stack.model.linear import Linear, compute_dtype
from v4stack.model.norm import RMSNorm
from v4stack.model.rope import Rotary
from v4stack.model.state import CompressorTail
from v4stack.model import rowwise


def _ape_rows(positions: torch.Tensor, ape: torch.Tensor, ratio: int, dtype) -> torch.Tensor:
    """Each row's learned position bias inside its block (a row step over ``positions``)."""
    return ape.to(dtype)[positions % ratio]


class Compressor(nn.Module):
    rounding = None  # activation rounding of closed entries when set (model/quant.py)

    def __init__(self, dim: int, width: int, ratio: int, overlap: bool, rotary: Rotary, eps: float):
        super().__init__()
        self.width, self.ratio, self.overlap = width, ratio, overlap
        self.coff = 2 if overlap else 1
        self.rotary = rotary
        self.wkv = Linear(dim, self.coff * width)
        self.wgate = Linear(dim, self.coff * width)
        self.ape = nn.Parameter(torch.empty(ratio, self.coff * width, dtype=torch.float32))
        self.norm = RMSNorm(width, eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor, proj=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``x [N, d]`` -> (kv, score) ``[N, coff*width]`` in the compute dtype; ``proj``:
        ``(wkv(x), wgate(x))`` already computed, or None."""
        cd = compute_dtype(x.dtype)
        pk, pg = (self.wkv(x), self.wgate(x)) if proj is None else proj
        kv = pk.to(cd)
        score = pg.to(cd) + rowwise.step(_ape_rows, positions, self.ape, self.ratio, cd, params=(1,))
        return kv, score

    def pool_rows(self, kv: torch.Tensor, score: torch.Tensor, blocks: torch.Tensor, dtype) -> torch.Tensor:
        """Entries of ``blocks [n]`` from their rows ``[n, coff * m, coff * width]`` in position order
        (for an overlapped compressor the previous block's ``m`` rows first, padding as 0 / -inf)."""
        m, c = self.ratio, self.width
        if self.overlap:
            kv, score = fused.overlap_halves(kv, m, c), fused.overlap_halves(score, m, c)
        return self.entries_of(kv, score, blocks, dtype)

    def entries_of(self, kv: torch.Tensor, score: torch.Tensor, blocks: torch.Tensor, dtype) -> torch.Tensor:
        """Entries of ``blocks [n]`` from their pooled rows ``[n, coff * m, width]`` as ``pool_rows``
        arranges them (``ops.fused.closing_rows`` reads them so from the tail rings)."""
        entries = self.rotary.apply(self.norm(ops.weighted_pool(kv, score, dim=1).to(dtype)), blocks * self.ratio)
        return entries if self.rounding is None else self.rounding(entries)

    def pool(self, kv: torch.Tensor, score: torch.Tensor, row0: int, blocks: range, dtype) -> torch.Tensor:
        """Entries for ``blocks`` from contiguous rows that start at position ``row0``."""
        m, c = self.ratio, self.width
        if len(blocks) == 0:
            return kv.new_zeros(0, c).to(dtype)
        b = torch.arange(blocks.start, blocks.stop, device=kv.device)
        slot = torch.arange(m, device=kv.device)
        cur = (b * m - row0).unsqueeze(1) + slot  # [nb, m] row index of block b's tokens
        if not self.overlap:
            pooled = ops.weighted_pool(kv[cur], score[cur], dim=1)
        else:
            prev = cur - m
            has_prev = (b > 0).unsqueeze(1).expand_as(prev)
            safe = prev.clamp(min=0)
            kv_b = torch.where(has_prev.unsqueeze(-1), kv[safe][..., :c], 0.0)
            sc_b = torch.where(has_prev.unsqueeze(-1), score[safe][..., :c], float("-inf"))
            kv_all = torch.cat((kv_b, kv[cur][..., c:]), dim=1)
            sc_all = torch.cat((sc_b, score[cur][..., c:]), dim=1)
            pooled = ops.weighted_pool(kv_all, sc_all, dim=1)
        entries = self.rotary.apply(self.norm(pooled.to(dtype)), b * m)
        return entries if self.rounding is None else self.rounding(entries)

    def extend(
        self, kv: torch.Tensor, score: torch.Tensor, pos0: int, tail: CompressorTail | None, dtype,
        capture: dict[int, CompressorTail] | None = None,
    ) -> torch.Tensor:
        """Consume the rows of positions ``[pos0, pos0 + n)``; return the entries they close.

        ``tail`` holds the rows before ``pos0`` that an open block (and, for CSA, the previous
        block) still needs; it is updated in place. With no tail, ``pos0`` must be 0.
        """
        m, n = self.ratio, kv.shape[0]
        lookback = m if self.overlap else 0
        if tail is None:
            if pos0 != 0:
                raise ValueError("a compressor without a tail can only start at position 0")
            row0, all_kv, all_score = 0, kv, score
        else:
            row0 = max(0, (pos0 // m) * m - lookback)
            old_kv, old_score = tail.read(row0, pos0)
            all_kv, all_score = torch.cat((old_kv, kv)), torch.cat((old_score, score))
        end = pos0 + n
        blocks = range(pos0 // m, end // m)
        entries = self.pool(all_kv, all_score, row0, blocks, dtype)
        for P, snap in (capture or {}).items():  # the tail as it stood at position P
            keep_from = max(0, (P // m) * m - lookback)
            snap.write(keep_from, all_kv[keep_from - row0 : P - row0], all_score[keep_from - row0 : P - row0])
        if tail is not None:
            keep_from = max(0, (end // m) * m - lookback)
            tail.write(keep_from, all_kv[keep_from - row0 :], all_score[keep_from - row0 :])
        return entries
