"""Lightning indexer: scores closed CSA entries for each query and keeps the top-k.

``I[t, s] = sum_h w_h(t) * ReLU(q_h(t) . k_s)`` with 64 heads x 128 dims in V4; its keys come
from the indexer's own overlapped compressor, aligned one-to-one with the CSA entries. Only
closed (visible) entries can be selected.

The chosen entries are handed on in ascending entry order (not score order): the attention's
arithmetic follows the candidate order, and in entry order a query whose entries all fit in the
top-k gets the same list whether or not anything was scored - so where a step's entries number
at most ``topk`` (contexts up to ``topk * ratio`` tokens) the scores are skipped altogether
(``all_chosen``), and a query's candidates still never depend on the other queries of its batch.
"""

from __future__ import annotations

import torch
from torch import nn

from v4stack import ops
from v4stack.ops import fused
from v4stack.config import ModelConfig
from v4stack.model.compressor import Compressor
from v4stack.model.linear import Linear
from v4stack.model.rope import Rotary


class Indexer(nn.Module):
    q_rounding = None  # Hadamard + FP4 rounding of the queries when set (model/quant.py)

    def __init__(self, cfg: ModelConfig, ratio: int, rotary: Rotary):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rotary = rotary
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, ratio, True, rotary, cfg.rms_norm_eps)
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5

    def project(self, qr: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, wx: torch.Tensor | None = None,
                inplace: bool = False, table=None):
        """Indexer queries ``[N, heads, dim]`` (RoPE on the tail) and head weights ``[N, heads]``;
        ``wx``: ``weights_proj(x)`` where the caller has it (the layer's packed projections of x);
        ``inplace`` (a serving step, no autograd): the fresh queries rotated in place, with the
        step's shared ``table`` of these positions when given."""
        q = self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim)
        q = self.rotary.apply_(q, positions, table=table) if inplace else self.rotary.apply(q, positions)
        if self.q_rounding is not None:
            q = self.q_rounding(q)
        w = (self.weights_proj(x) if wx is None else wx) * self.weight_scale
        return q, w

    def all_chosen(self, entries: int) -> bool:
        """Whether ``entries`` columns fit in the top-k: every visible one is chosen, unscored."""
        return entries <= self.topk

    @staticmethod
    def _in_entry_order(idx: torch.Tensor, visible: torch.Tensor):
        idx = torch.sort(idx, dim=1).values
        return idx, visible.gather(1, idx)

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor):
        """Top ``min(k, #visible)`` entries per query, in entry order: (indices ``[n, k']``, valid
        ``[n, k']``)."""
        n, S = q.shape[0], keys.shape[0]
        k = min(self.topk, S)
        if k == 0:
            return torch.zeros(n, 0, dtype=torch.long, device=q.device), torch.zeros(n, 0, dtype=torch.bool, device=q.device)
        if self.all_chosen(S):
            return torch.arange(S, device=q.device).expand(n, S), visible.expand(n, S)
        scores = ops.indexer_scores(q, w, keys).masked_fill(~visible, float("-inf"))
        # a stable sort breaks ties (e.g. several entries whose ReLU terms are all 0) towards the
        # earlier entry, so the choice never depends on how many entries exist past the visible ones
        _, idx = ops.topk(scores, k, stable=True)
        return self._in_entry_order(idx, visible.expand(n, S))

    def select_rows(self, q, w, keys: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor):
        """Top ``min(k, E)`` per query over its own entries, in entry order: ``rows [n, E]`` are
        each query's entry rows of the flattened key pool ``keys`` (-1: none), ``visible [n, E]``
        the closed ones -> (column indices ``[n, k']``, valid ``[n, k']``). Columns past a
        request's entries are hidden, so the choice equals ``select`` over that request's keys
        alone. (Callers skip the scoring, and the call, where ``all_chosen(E)``.)"""
        n, E = rows.shape
        k = min(self.topk, E)
        if k == 0:
            return torch.zeros(n, 0, dtype=torch.long, device=q.device), torch.zeros(n, 0, dtype=torch.bool, device=q.device)
        if self.all_chosen(E):
            return torch.arange(E, device=rows.device).expand(n, E), visible
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        scores = ops.indexer_scores(q, w, keys, rows=rows).to(acc)  # keys read by index, no gathered copy
        scores = scores.masked_fill(~visible, float("-inf"))
        _, idx = ops.topk(scores, k, stable=True)
        return self._in_entry_order(idx, visible)

    def choose_rows(self, q, w, keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``select_rows`` where the visible entries are exactly the rows >= 0 (a decode step), as
        the chosen pool rows ``[n, k']`` (-1: none) - ``rows.gather(1, sel)`` where valid, in one
        op (``ops.fused.topk_rows``) instead of a sort, a sort and two gathers."""
        E = rows.shape[1]
        if self.all_chosen(E):  # every entry is chosen (none at all included)
            return rows
        # the scores in their own dtype: a half score widens to fp32 exactly, so the order is the same
        return fused.topk_rows(ops.indexer_scores(q, w, keys, rows=rows), rows, self.topk)
