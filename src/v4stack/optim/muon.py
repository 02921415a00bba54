"""Muon as V4 runs it: Nesterov momentum, two-stage Newton-Schulz, RMS-matched update, decoupled wd.

The update of one matrix W (n x m) with gradient G:

    B <- mu * B + G                      (momentum buffer, mu = 0.95)
    U  = G + mu * B                      (Nesterov)
    O  = NS(U / ||U||_F)                 (8 steps of (3.4445, -4.7750, 2.0315), then 2 of (2, -1.5, 0.5))
    W <- W - lr * (0.18 * sqrt(max(n, m)) * O + wd * W)

An odd matrix polynomial X <- aX + b(XX^T)X + c(XX^T)^2 X acts on each singular value alone:
sigma <- a sigma + b sigma^3 + c sigma^5. ``ns_scalar`` is that map, which is how the tests derive the
band the singular values must land in. The first stage drives every singular value above a floor into
[0.68, 1.20] (the critical values of its quintic); the second stage's quintic has p(1) = 1 and
p'(1) = 0, so it pins the band to 1.

Everything here works on a stack ``[k, n, m]`` of same-shape matrices (k = 1 for a plain matrix):
MoE expert matrices of one layer and one projection type travel and update as one such stack, each
expert orthogonalised on its own. The functions are pure tensor code so the single-process optimizer
and the ZeRO owner run exactly the same arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

STAGE1 = (3.4445, -4.7750, 2.0315)
STAGE2 = (2.0, -1.5, 0.5)
V4_SCHEDULE: tuple[tuple[float, float, float], ...] = (STAGE1,) * 8 + (STAGE2,) * 2
RMS_TARGET = 0.18
NS_EPS = 1e-7


@dataclass(frozen=True)
class MuonHyper:
    lr: float = 0.02
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    rms: float = RMS_TARGET

    def validate(self) -> "MuonHyper":
        if not self.lr > 0:
            raise ValueError(f"muon field 'lr' must be > 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"muon field 'weight_decay' must be >= 0, got {self.weight_decay}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"muon field 'momentum' must be in [0, 1), got {self.momentum}")
        if not self.rms > 0:
            raise ValueError(f"muon field 'rms' must be > 0, got {self.rms}")
        return self


def ns_scalar(schedule, x):
    """The map the schedule applies to one singular value (works on floats, numpy or torch)."""
    for a, b, c in schedule:
        x2 = x * x
        x = a * x + b * x2 * x + c * x2 * x2 * x
    return x


def newton_schulz(u: torch.Tensor, schedule=V4_SCHEDULE, eps: float = NS_EPS) -> torch.Tensor:
    """Approximate orthogonal factor of each matrix in ``u`` ([n, m] or [k, n, m]), in fp32.

    Each matrix is divided by its own Frobenius norm first (so every singular value is <= 1), then
    the polynomial steps run on the short side (X X^T is min(n, m) square).
    """
    if u.dim() not in (2, 3):
        raise ValueError(f"newton_schulz expects a matrix or a stack of matrices, got shape {tuple(u.shape)}")
    squeeze = u.dim() == 2
    x = u.float().unsqueeze(0) if squeeze else u.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.transpose(-2, -1)
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x = x / (norm + eps)
    for a, b, c in schedule:
        gram = x @ x.transpose(-2, -1)
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    if tall:
        x = x.transpose(-2, -1)
    return x.squeeze(0) if squeeze else x


def update_scale(shape: torch.Size | tuple[int, ...], rms: float = RMS_TARGET) -> float:
    """0.18 * sqrt(max(n, m)): an orthogonal n x m factor has RMS 1/sqrt(max(n, m))."""
    n, m = shape[-2], shape[-1]
    return rms * math.sqrt(max(n, m))


def muon_step_(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, hp: MuonHyper,
               lr: float | None = None) -> None:
    """One in-place Muon update of ``param`` ([n, m] or [k, n, m], fp32) from an fp32 ``grad``.

    ``buf`` is the momentum buffer of the same shape (fp32), updated in place. ``lr`` overrides
    ``hp.lr`` (schedules pass the current rate).
    """
    lr = hp.lr if lr is None else lr
    buf.mul_(hp.momentum).add_(grad)
    u = grad.add(buf, alpha=hp.momentum) if hp.nesterov else buf
    o = newton_schulz(u)
    if hp.weight_decay:
        param.mul_(1.0 - lr * hp.weight_decay)
    param.add_(o.to(param.dtype), alpha=-lr * update_scale(param.shape, hp.rms))
