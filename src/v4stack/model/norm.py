"""RMSNorm with a learned weight (the weightless variant is ``ops.rms_norm(x, None, eps)``)."""

from __future__ import annotations

import torch
from torch import nn

from v4stack import ops
from v4stack.model import rowwise


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rowwise.step(ops.rms_norm, x, self.weight, self.eps, params=(1,))
