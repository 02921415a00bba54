"""A bias-free linear layer whose matmul goes through ``v4stack.ops``."""

from __future__ import annotations

import torch
from torch import nn

from v4stack import ops
from v4stack.model import rowwise


class Linear(nn.Module):
    qweight = None  # a block-scaled ops.QuantizedWeight when loaded from a quantised checkpoint

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return ops.linear(x, self.qweight)
        return rowwise.step(ops.linear, x, self.weight, params=(1,))

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}"


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of V4's fp32 islands (mHC, compressor, routing, experts): fp32, or fp64 in fp64 runs."""
    return torch.float64 if dtype == torch.float64 else torch.float32
