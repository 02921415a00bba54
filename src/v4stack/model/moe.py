"""Mixture of experts: one shared expert plus top-k routed SwiGLU experts.

Scores are ``sqrt(softplus(x @ W_g^T))`` in fp32. The first ``num_hash_layers`` layers route by a
fixed table ``tid2eid[token]``; later layers pick the top-k of ``score + bias`` (the bias steers
only the choice). The chosen experts' unbiased scores are normalised to sum 1 and multiplied by
``routed_scaling_factor``. Experts compute in fp32 with V4's clamps: up-projection to
``[-limit, limit]``, gate to at most ``limit``; the routing weight multiplies the activation before
``w2``; routed outputs are summed in fp32 and the shared expert is added after.
"""

from __future__ import annotations

import torch
from torch import nn

from v4stack import ops
from v4stack.config import ModelConfig
from v4stack.model.linear import Linear, compute_dtype


class Expert(nn.Module):
    def __init__(self, dim: int, inner: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, inner)
        self.w2 = Linear(inner, dim)
        self.w3 = Linear(dim, inner)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return swiglu(x, self.w1.weight, self.w2.weight, self.w3.weight, self.limit, weight)


def swiglu(x, w1, w2, w3, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``w2((silu(clamp(w1 x)) * clamp(w3 x)) * weight)`` in the compute dtype."""
    cd = compute_dtype(x.dtype)
    xc = x.to(cd)
    gate = ops.linear(xc, w1.to(cd))
    up = ops.linear(xc, w3.to(cd))
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    act = ops.silu(gate) * up
    if weight is not None:
        act = act * weight.unsqueeze(-1)
    return ops.linear(act, w2.to(cd))


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        self.topk, self.scale, self.hashed = cfg.num_experts_per_tok, cfg.routed_scaling_factor, hashed
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.topk, dtype=torch.int32))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor):
        """-> (expert indices ``[N, k]``, routing weights ``[N, k]`` in the compute dtype)."""
        cd = compute_dtype(x.dtype)
        scores = ops.softplus(ops.linear(x.to(cd), self.weight.to(cd))).sqrt()
        if self.hashed:
            idx = self.tid2eid[token_ids].long()
        else:
            idx = ops.topk(scores + self.bias.to(cd), self.topk)[1]
        w = scores.gather(1, idx)
        w = w / ops.sum(w, -1, keepdim=True) * self.scale
        return idx, w


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.gate = Gate(cfg, hashed=layer_id < cfg.num_hash_layers)
        limit = cfg.swiglu_limit
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.moe_intermediate_size, limit) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = (
            Expert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, limit)
            if cfg.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x, token_ids)
        return self.combine(x, idx, w)

    def combine(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Routed experts' outputs per (token, slot), summed per token by ``ops.moe_combine`` in
        fp32 (in ascending expert order in invariant mode), then the shared expert."""
        cd = compute_dtype(x.dtype)
        y = torch.zeros(x.shape[0], idx.shape[1], x.shape[1], dtype=cd, device=x.device)
        counts = torch.bincount(idx.flatten(), minlength=self.n_experts).tolist()
        for e, cnt in enumerate(counts):
            if cnt == 0:
                continue
            tok, slot = torch.where(idx == e)
            y[tok, slot] = self.experts[e](x[tok], w[tok, slot])
        out = ops.moe_combine(y, idx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.to(x.dtype)
