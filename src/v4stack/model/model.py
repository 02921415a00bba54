"""The V4 network with two execution paths over one set of weights.

- ``forward(tokens [B, T])``: full-sequence causal forward (training / prefill);
- ``step([(ids, state), ...])``: incremental forward of new tokens for several requests, each
  carrying its explicit ``RequestState`` (SWA window, compressor tails, closed entries, indexer
  keys). Decoding one token is a step of length 1; a prompt can be fed in any chunks. This is the
  reference incremental path;
- ``step_paged(batch, cache)``: the serving path, one flat step over paged pools read by index
  (``model/paged.py``), with the same bits as ``step`` in invariant mode.

Rows of all sequences are flattened: linears, mHC and MoE run row-wise over every row at once;
attention and compression run per sequence with its own history.
"""

from __future__ import annotations

import torch
from torch import nn

from v4stack.config import ModelConfig
from v4stack.model.attention import Segment
from v4stack.model.block import Block
from v4stack.model.init import init_weights, is_fp32_param
from v4stack.model.linear import Linear
from v4stack.model.mhc import hc_parameters, head_input
from v4stack.model.mtp import MTPBlock
from v4stack.model.norm import RMSNorm
from v4stack.model import rowwise
from v4stack.model.paged import PagedCache, PagedStep, StepBatch
from v4stack.model.state import RequestState, new_request_state
from v4stack.ops.fused import embed_streams


class V4Model(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int | None = 0):
        super().__init__()
        self.cfg = cfg.validate()
        d = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(Block(cfg, i, r) for i, r in enumerate(cfg.layer_ratios))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = Linear(d, cfg.vocab_size)
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = hc_parameters(cfg.hc_mult, d, head=True)
        L = cfg.num_hidden_layers
        self.mtp = nn.ModuleList(MTPBlock(cfg, L + j, r) for j, r in enumerate(cfg.mtp_ratios))
        if seed is not None and self.embed.weight.device.type != "meta":
            init_weights(self, seed)

    # ---- dtype ---------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def cast(self, dtype: torch.dtype) -> "V4Model":
        """Cast weights to ``dtype``; V4's fp32 islands stay fp32 unless ``dtype`` is fp64."""
        for name, p in self.named_parameters():
            keep32 = is_fp32_param(name) and dtype != torch.float64
            p.data = p.data.to(torch.float32 if keep32 else dtype)
        return self

    # ---- serving layout -------------------------------------------------------------

    def pack_projections(self) -> int:
        """Pack each attention layer's projections of its input into one weight (``packed``): a
        serving step then runs them as one GEMM. Returns the layers packed; idempotent."""
        return sum(bool(m.pack_projections()) for m in self.modules() if m is not self and hasattr(m, "pack_projections"))

    # ---- expert backend -------------------------------------------------------------

    def set_expert_backend(self, factory) -> "V4Model":
        """Install ``factory(layer_id, moe) -> ExpertBackend`` on every MoE layer (MTP included)."""
        for blk in list(self.layers) + list(self.mtp):
            blk.ffn.backend = factory(blk.layer_id, blk.ffn)
        return self

    # ---- shared trunk ---------------------------------------------------------------

    def _trunk(self, ids: torch.Tensor, positions: torch.Tensor, segments) -> torch.Tensor:
        table = self.embed.weight
        hooks = self.embed._forward_hooks or self.embed._forward_pre_hooks
        if rowwise.hooked() or (torch.is_grad_enabled() and table.requires_grad) or hooks:
            e = rowwise.module_step(self.embed, self.embed, ids).unsqueeze(1)  # training: the module's own call
            x = torch.cat([e] * self.cfg.hc_mult, 1)  # the streams' copies
        else:  # inference: every stream's copy in one step (one launch on CUDA)
            x = embed_streams(ids, table, self.cfg.hc_mult)
        for block in self.layers:
            x = block(x, positions, segments, ids)
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of the streams ``x``: the head's stream weights, the read with the final norm
        (``mhc.head_input``), the output projection."""
        return self.head(head_input(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg.hc_eps,
                                    self.cfg.rms_norm_eps, self.norm))

    @staticmethod
    def _fresh_segments(B: int, T: int, device) -> tuple[list[Segment], torch.Tensor]:
        segs = [Segment(start=b * T, length=T, pos0=0) for b in range(B)]
        return segs, torch.arange(T, device=device).repeat(B)

    # ---- full-sequence path ---------------------------------------------------------

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [B, T]`` -> logits ``[B, T, vocab]`` (causal)."""
        B, T = tokens.shape
        segs, positions = self._fresh_segments(B, T, tokens.device)
        x = self._trunk(tokens.reshape(-1), positions, segs)
        return self._head(x).view(B, T, -1)

    def forward_train(self, tokens: torch.Tensor):
        """-> (logits ``[B, T, V]``, MTP logits ``[B, T-1, V]`` predicting token t+2, or None)."""
        B, T = tokens.shape
        segs, positions = self._fresh_segments(B, T, tokens.device)
        h = self._trunk(tokens.reshape(-1), positions, segs)
        return self._head(h).view(B, T, -1), self.mtp_logits(h, tokens)

    def mtp_logits(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | None:
        """MTP logits ``[B, T-1, V]`` from the main stack's streams ``h [B*T, n, d]`` (None without MTP)."""
        B, T = tokens.shape
        if not len(self.mtp) or T < 2:
            return None
        h = h.view(B, T, *h.shape[1:])[:, :-1].reshape(B * (T - 1), *h.shape[1:])
        nxt = tokens[:, 1:].reshape(-1)
        segs, positions = self._fresh_segments(B, T - 1, tokens.device)
        emb = self.embed(nxt)
        mtp_logits = None
        for blk in self.mtp:  # V4 ships one MTP block; deeper chains feed each block the last one's streams
            y = blk.predict(h, emb, positions, segs, nxt)
            mtp_logits = self.head(y).view(B, T - 1, -1)
        return mtp_logits

    # ---- incremental path -----------------------------------------------------------

    def new_state(self) -> RequestState:
        return new_request_state(self.cfg, self.dtype, self.embed.weight.device)

    def step(self, batch: list[tuple[torch.Tensor, RequestState]], hidden: bool = False):
        """Feed each request its new token ids (1-D); returns logits ``[n_i, V]`` per request
        (and, with ``hidden``, each request's final streams ``[n_i, n_hc, d]``, the MTP input).

        Every state advances by its number of new tokens.
        """
        segs, ids, pos, start = [], [], [], 0
        for tok, st in batch:
            tok = tok.reshape(-1)
            n = tok.shape[0]
            if n == 0:
                raise ValueError("step() needs at least one new token per request")
            if len(st.layers) != len(self.layers):
                raise ValueError("request state does not belong to this model's config")
            segs.append(Segment(start=start, length=n, pos0=st.pos, state=st.layers))
            ids.append(tok)
            pos.append(torch.arange(st.pos, st.pos + n, device=tok.device))
            start += n
        x = self._trunk(torch.cat(ids), torch.cat(pos), segs)
        logits = self._head(x)
        out = []
        for (tok, st), seg in zip(batch, segs):
            st.pos += seg.length
            out.append(logits[seg.rows])
        return (out, [x[seg.rows] for seg in segs]) if hidden else out

    def step_paged(self, batch: StepBatch, cache: PagedCache, hidden: bool = False):
        """Incremental forward of one flat step over paged storage (``model/paged.py``): every
        layer reads the pools by index and writes the rows the step produces. Returns logits of
        ``batch.out_rows`` (all rows if None); with ``hidden`` also the final streams of every
        row ``[T, n_hc, d]`` (the MTP block's input)."""
        batch.memo.clear()  # shared index tensors are made afresh in every call (and graph capture)
        h = x = self._trunk(batch.ids, batch.positions, PagedStep(batch, cache))
        if batch.out_rows is not None:
            x = x[batch.out_rows]
        return (self._head(x), h) if hidden else self._head(x)
