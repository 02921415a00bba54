"""Lightning indexer: scores closed CSA entries for each query and keeps the top-k.

``I[t, s] = sum_h w_h(t) * ReLU(q_h(t) . k_s)`` with 64 heads x 128 dims in V4; its keys come
from the indexer's own overlapped compressor, aligned one-to-one with the CSA entries. Only
closed (visible) entries can be selected.
"""

from __future__ import annotations

import torch
from torch import nn

from v4stack import ops
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

    def project(self, qr: torch.Tensor, x: torch.Tensor, positions: torch.Tensor):
        """Indexer queries ``[N, heads, dim]`` (RoPE on the tail) and head weights ``[N, heads]``."""
        q = self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim)
        q = self.rotary.apply(q, positions)
        if self.q_rounding is not None:
            q = self.q_rounding(q)
        w = self.weights_proj(x) * self.weight_scale
        return q, w

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor):
        """Top ``min(k, #visible)`` entries per query: (indices ``[n, k']``, valid ``[n, k']``)."""
        n, S = q.shape[0], keys.shape[0]
        k = min(self.topk, S)
        if k == 0:
            return torch.zeros(n, 0, dtype=torch.long, device=q.device), torch.zeros(n, 0, dtype=torch.bool, device=q.device)
        scores = ops.indexer_scores(q, w, keys).masked_fill(~visible, float("-inf"))
        # a stable sort breaks ties (e.g. several entries whose ReLU terms are all 0) towards the
        # earlier entry, so the choice never depends on how many entries exist past the visible ones
        top, idx = ops.topk(scores, k, stable=True)
        return idx, top > float("-inf")

    def select_rows(self, q, w, keys: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor):
        """Top ``min(k, E)`` per query over its own entries: ``rows [n, E]`` are each query's entry
        rows of the flattened key pool ``keys`` (-1: none), ``visible [n, E]`` the closed ones ->
        (column indices ``[n, k']``, valid ``[n, k']``). Columns past a request's entries are
        hidden, so the choice equals ``select`` over that request's keys alone."""
        n, E = rows.shape
        k = min(self.topk, E)
        if k == 0:
            return torch.zeros(n, 0, dtype=torch.long, device=q.device), torch.zeros(n, 0, dtype=torch.bool, device=q.device)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        scores = ops.indexer_scores(q, w, keys, rows=rows).to(acc)  # keys read by index, no gathered copy
        scores = scores.masked_fill(~visible, float("-inf"))
        top, idx = ops.topk(scores, k, stable=True)
        return idx, top > float("-inf")

