"""Multi-token prediction: one extra SWA-only block that predicts the token after next.

``x = e_proj(enorm(embed(next_ids))) + h_proj(hnorm(h))`` where ``h`` is the main stack's stream
state before head mixing; then a block, its own hyper-connection head, its own final norm, and
the main model's (shared) output head.
"""

from __future__ import annotations

import torch

from v4stack.config import ModelConfig
from v4stack.model.block import Block
from v4stack.model.linear import Linear
from v4stack.model.mhc import hc_parameters, head_input
from v4stack.model.norm import RMSNorm


class MTPBlock(Block):
    def __init__(self, cfg: ModelConfig, layer_id: int, ratio: int):
        super().__init__(cfg, layer_id, ratio)
        d = cfg.hidden_size
        self.e_proj = Linear(d, d)
        self.h_proj = Linear(d, d)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = hc_parameters(cfg.hc_mult, d, head=True)

    def predict(self, h: torch.Tensor, next_embed: torch.Tensor, positions, segments, next_ids) -> torch.Tensor:
        """Streams ``h [N, n, d]`` and embedded next tokens ``[N, d]`` -> normed hidden ``[N, d]``."""
        x = self.e_proj(self.enorm(next_embed)).unsqueeze(1) + self.h_proj(self.hnorm(h))
        x = self.forward(x, positions, segments, next_ids)
        return head_input(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.hc_eps, self.norm_eps,
                          self.norm)
