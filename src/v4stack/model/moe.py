"""Mixture of experts: one shared expert plus top-k routed SwiGLU experts.

Scores are ``sqrt(softplus(x @ W_g^T))`` in fp32. The first ``num_hash_layers`` layers route by a
fixed table ``tid2eid[token]``; later layers pick the top-k of ``score + bias`` (the bias steers
only the choice). The chosen experts' unbiased scores are normalised to sum 1 and multiplied by
``routed_scaling_factor``. Experts apply V4's clamps: up-projection to ``[-limit, limit]``, gate to
at most ``limit``; the routing weight multiplies the activation before ``w2``; routed outputs are
summed in fp32 and the shared expert is added after (its GEMMs, like the routed experts', run in
the weight dtype with fp32 accumulation).

The routed experts run behind an expert-backend seam: ``MoE.backend(moe, x, weights, indices)``
returns the routed experts' combined output. The default, ``LocalGrouped``, holds every expert on
this process with its weights stacked ``[E, N, K]`` once (the per-expert parameters are views into
the stack, so nothing is copied per call) and runs one grouped GEMM per projection in the weight
dtype with fp32 accumulation. Expert-parallel backends (``megamoe/``) plug into the same seam via
``V4Model.set_expert_backend``.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import nn

from v4stack import ops
from v4stack.config import ModelConfig
from v4stack.model.linear import Linear, compute_dtype
from v4stack.model import rowwise
from v4stack.ops.fused import moe_route_rows, moe_unsort_combine, router, swiglu_act


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


def swiglu_in_weight_dtype(x, w1, w2, w3, limit: float, cast: bool = True) -> torch.Tensor:
    """The shared expert as ``LocalGrouped`` runs the routed ones: GEMMs in the weight dtype (fp32
    accumulation; no per-call cast of a weight to fp32), clamps and activation in the compute
    dtype. The same arithmetic as ``swiglu`` when the weights are in the compute dtype. Returned
    in the compute dtype, or with ``cast`` False in the weight dtype (for a consumer that widens
    it itself: the same values)."""
    xw = x.to(w1.dtype)
    act = swiglu_act(ops.linear(xw, w1), ops.linear(xw, w3), limit, None, w2.dtype)
    y = ops.linear(act, w2)
    return y.to(compute_dtype(x.dtype)) if cast else y


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

    _cast: tuple | None = None  # (key, the weight in the compute dtype)

    def _weight_in(self, cd: torch.dtype) -> torch.Tensor:
        """The router weight in the compute dtype: without autograd a widened copy kept until the
        weight changes (its storage, its in-place version, the dtype), not one cast a call."""
        w = self.weight
        if w.dtype == cd or (torch.is_grad_enabled() and w.requires_grad):
            return w.to(cd)
        # the storage is held with the copy, so no other weight can take its address meanwhile
        key = (w.data_ptr(), w._version, w.device, cd)
        if self._cast is None or self._cast[0] != key:
            self._cast = (key, w.detach().to(cd), w.untyped_storage())
        return self._cast[1]

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor):
        """-> (expert indices ``[N, k]``, routing weights ``[N, k]`` in the compute dtype)."""
        cd = compute_dtype(x.dtype)
        if self.hashed:
            return router(x, self.weight, self._weight_in(cd), None, self.tid2eid, token_ids, self.topk, self.scale)
        return router(x, self.weight, self._weight_in(cd), self.bias.to(cd), None, None, self.topk, self.scale)


class ExpertBackend(Protocol):
    def __call__(self, moe: "MoE", x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """``x [T, d]``, routing ``weights [T, k]`` (fp32, normalised and scaled), expert ``indices
        [T, k]`` (int64) -> the routed experts' combined output ``[T, d]`` (no shared expert)."""
        ...


BackendFactory = Callable[[int, "MoE"], ExpertBackend]


class LocalGrouped:
    """Every expert on this process: (token, slot) pairs sorted by expert, one grouped GEMM per
    projection, the per-pair outputs combined per token by ``ops.moe_combine`` (ascending expert
    id, ties in slot order, fp32)."""

    def __call__(self, moe: "MoE", x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return self.run(moe, x, weights, indices, None, compute_dtype(x.dtype))

    def run(self, moe: "MoE", x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
            shared: torch.Tensor | None, out_dtype: torch.dtype, shared_joins: bool = False) -> torch.Tensor:
        """The combined routed output plus ``shared`` (the shared expert's output, widened to the
        compute dtype; or None), in ``out_dtype``. ``shared_joins``: the shared expert runs inside
        the same grouped GEMMs instead, as expert ``E`` (the last of ``stacked_weights(True)``) in
        one more slot of every token with routing weight 1 - the combine adds it last, as it adds
        ``shared`` (ascending expert id), and times 1 is exact."""
        out, rank = self.sorted_out(moe, x, weights, indices, shared_joins)
        return moe_unsort_combine(out, rank, indices, shared, out_dtype, shared_joins)

    def sorted_out(self, moe: "MoE", x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                   shared_joins: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' outputs of every (token, slot) pair sorted by expert ``[T k, d]`` (already
        times the routing weights) and each pair's row in them ``[T k]`` - what ``run`` combines."""
        w1, w2, w3 = moe.stacked_weights(True) if shared_joins else moe.stacked_weights()
        # by expert, then pair id (token * k + slot); joined: one more slot a token, expert E, weight 1
        offsets, order, rank, tok, ws, rows = moe_route_rows(x, indices, weights, moe.n_experts, shared_joins, w1.dtype)
        act = swiglu_act(ops.grouped_linear(rows, w1, offsets), ops.grouped_linear(rows, w3, offsets), moe.limit,
                         ws, w2.dtype)
        return ops.grouped_linear(act, w2, offsets), rank


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.limit = cfg.swiglu_limit
        self.backend: ExpertBackend = LocalGrouped()
        self._stack: tuple[torch.Tensor, ...] | None = None
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
        return rowwise.module_step(self, self._rows, x, token_ids)

    def _rows(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x, token_ids)
        return self.combine(x, idx, w)

    def uncombined(self, x: torch.Tensor, token_ids: torch.Tensor):
        """``forward`` short of its last step where the local grouped backend runs the shared expert
        joined and no hook splits the rows: ``(out, rank, indices)``, the experts' sorted outputs
        that ``fused.moe_unsort_combine(out, rank, indices, None, x.dtype, True)`` turns into
        ``forward``'s result (the caller may combine them inside its next kernel:
        ``fused.moe_hc_write``); None elsewhere."""
        if rowwise.hooked() or not isinstance(self.backend, LocalGrouped) or not self._shared_joins():
            return None
        idx, w = self.gate(x, token_ids)
        out, rank = self.backend.sorted_out(self, x, w, idx, shared_joins=True)
        return out, rank, idx

    def combine(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Routed experts through the backend, then the shared expert (in the compute dtype)."""
        se = self.shared_experts
        local = isinstance(self.backend, LocalGrouped)  # it widens, adds and casts in its last kernel
        if local and self._shared_joins():
            return self.backend.run(self, x, w, idx, None, x.dtype, shared_joins=True)
        shared = None if se is None else swiglu_in_weight_dtype(x, se.w1.weight, se.w2.weight, se.w3.weight, se.limit,
                                                                cast=not local)
        if local:
            return self.backend.run(self, x, w, idx, shared, x.dtype)
        out = self.backend(self, x, w, idx)
        if shared is not None:
            out = out + shared
        return out.to(x.dtype)

    # ---- stacked expert weights --------------------------------------------------------

    def _expert_params(self, name: str, shared: bool = False) -> list[torch.Tensor]:
        ps = [getattr(e, name).weight for e in self.experts]
        return ps + [getattr(self.shared_experts, name).weight] if shared else ps

    def _shared_joins(self) -> bool:
        """Whether the shared expert can run as one more expert of the local grouped GEMMs: no
        autograd (serving), one shared expert of the routed ones' shape, dtype and device, none
        of them quantised."""
        se = self.shared_experts
        if se is None or torch.is_grad_enabled() or self.n_experts >= 1024:
            return False
        for name in ("w1", "w2", "w3"):
            a, b = getattr(se, name), getattr(self.experts[0], name)
            if a.qweight is not None or b.qweight is not None or a.weight.shape != b.weight.shape \
                    or a.weight.dtype != b.weight.dtype or a.weight.device != b.weight.device:
                return False
        return True

    def _tied(self, shared: bool) -> bool:
        if self._stack is None or self._stack[0].shape[0] != self.n_experts + shared:
            return False
        for st, name in zip(self._stack, ("w1", "w2", "w3")):
            for i, p in enumerate(self._expert_params(name, shared)):
                if p.dtype != st.dtype or p.device != st.device or p.data_ptr() != st[i].data_ptr():
                    return False
        return True

    def stacked_weights(self, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w1, w2, w3)`` as ``[E, N, K]`` tensors in the weight dtype (``[E + 1, N, K]`` with
        ``shared``: the shared expert last).

        Without autograd the experts' parameters are made views into one stack per projection
        (re-tied only after a cast or a load replaced their storage), so a call copies nothing.
        With autograd it stacks the parameters in the graph, so gradients reach each expert.
        """
        if torch.is_grad_enabled() and any(p.requires_grad for p in self._expert_params("w1", shared)):
            return tuple(torch.stack(self._expert_params(n, shared)) for n in ("w1", "w2", "w3"))
        if not self._tied(shared):
            stacks = []
            for name in ("w1", "w2", "w3"):
                st = torch.stack([p.data for p in self._expert_params(name, shared)])
                for i, p in enumerate(self._expert_params(name, shared)):
                    p.data = st[i]
                stacks.append(st)
            self._stack = tuple(stacks)
        return self._stack
