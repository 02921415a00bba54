"""One V4 block: attention and MoE sublayers, each wrapped in mHC stream mixing."""

from __future__ import annotations

import torch
from torch import nn

from v4stack.config import ModelConfig
from v4stack.model.attention import Attention, Segment
from v4stack.model.mhc import coefficients_read_norm, hc_coefficients, hc_parameters, hc_write, read_norm
from v4stack.model.moe import MoE
from v4stack.model import rowwise
from v4stack.model.norm import RMSNorm
from v4stack.ops.fused import moe_hc_write


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ratio: int):
        super().__init__()
        self.layer_id, self.ratio = layer_id, ratio
        self.iters, self.hc_eps, self.norm_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        d, n = cfg.hidden_size, cfg.hc_mult
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(cfg, ratio)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn = MoE(cfg, layer_id)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = hc_parameters(n, d)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = hc_parameters(n, d)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                token_ids: torch.Tensor) -> torch.Tensor:
        """Streams ``x [N, n_hc, d]`` -> new streams."""
        h, post, comb = self._sublayer_input(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.attn_norm)
        x = hc_write(x, self.attn(h, positions, segments, self.layer_id), post, comb)
        h, post, comb = self._sublayer_input(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.ffn_norm)
        parts = self.ffn.uncombined(h, token_ids)  # the experts' rows combined inside the write (same bits)
        if parts is not None:
            return moe_hc_write(x, *parts, True, post, comb)
        return hc_write(x, self.ffn(h, token_ids), post, comb)

    def _sublayer_input(self, x, fn, base, scale, norm):
        """A sublayer's normalised input and the mHC write's post, comb: the coefficients then the
        read with its norm - one row step of both where no trainer hook splits them (inference:
        fast mode's kernels fuse their launches), two row steps under a hook."""
        if rowwise.hooked():
            pre, post, comb = rowwise.step(hc_coefficients, x, fn, base, scale, self.iters, self.hc_eps,
                                           self.norm_eps, params=(1, 2, 3))
            return read_norm(x, pre, norm), post, comb
        return coefficients_read_norm(x, fn, base, scale, self.iters, self.hc_eps, self.norm_eps, norm.weight,
                                      norm.eps)
