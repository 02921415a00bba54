"""AdamW for the parameters Muon does not take (embedding, head, norms, mHC biases/gates, sinks, ape).

Written as one element-wise function so a ZeRO shard of a flat buffer and the whole tensor run the
same arithmetic element by element: the sharded step equals the single-process step bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamWHyper:
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1

    def validate(self) -> "AdamWHyper":
        if not self.lr > 0:
            raise ValueError(f"adamw field 'lr' must be > 0, got {self.lr}")
        for i, b in enumerate(self.betas):
            if not 0 <= b < 1:
                raise ValueError(f"adamw field 'betas[{i}]' must be in [0, 1), got {b}")
        if not self.eps > 0:
            raise ValueError(f"adamw field 'eps' must be > 0, got {self.eps}")
        if not self.weight_decay >= 0:
            raise ValueError(f"adamw field 'weight_decay' must be >= 0, got {self.weight_decay}")
        return self


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                step: int, hp: AdamWHyper, lr: float | None = None,
                decay: bool | torch.Tensor = True) -> None:
    """In-place AdamW on fp32 tensors; ``step`` counts from 1. ``decay=False`` skips weight decay
    (norm weights and biases); a bool tensor chooses per element (a flat ZeRO shard mixes both)."""
    lr = hp.lr if lr is None else lr
    b1, b2 = hp.betas
    exp_avg.mul_(b1).add_(grad, alpha=1 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    bc1 = 1 - b1 ** step
    bc2 = 1 - b2 ** step
    denom = (exp_avg_sq / bc2).sqrt_().add_(hp.eps)
    if isinstance(decay, torch.Tensor):
        if hp.weight_decay:
            shrink = torch.full_like(param, 1 - lr * hp.weight_decay)
            param.mul_(torch.where(decay, shrink, torch.ones_like(param)))
    elif decay and hp.weight_decay:
        param.mul_(1 - lr * hp.weight_decay)
    param.addcdiv_(exp_avg, denom, value=-lr / bc1)


def no_decay(name: str, shape: tuple[int, ...]) -> bool:
    """Vectors (norm weights, biases, sinks, mHC base/scale) take no weight decay."""
    return len(shape) < 2 or name.endswith("norm.weight")
