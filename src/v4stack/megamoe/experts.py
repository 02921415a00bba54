"""What both expert-parallel paths share: the canonical row order, a rank's block of experts, the
expert math on that block, and the source-side reduction.

The fixed order (the contract behind bit-identity):

- A source sorts its pairs ``p = token * k + slot`` by (expert, p) (a stable sort of the expert
  ids). Experts are owned in contiguous blocks, so that order is destination-major.
- An expert rank lays its rows out expert-major, and within one expert by (source rank, p): with
  tokens laid out rank after rank that is ascending global token, the order in which a
  single-process layer meets the expert's rows. Each expert's rows go through one GEMM batch
  (on CPU and under autograd: the model's own ``LocalGrouped`` backend on this rank's block; on
  CUDA without autograd: fixed-tile Triton kernels whose per-row result depends on that row alone).
- A source puts each routed output row back at its pair id and reduces with ``ops.moe_combine``
  (fp32, ascending expert id in invariant mode), exactly as the single-process layer does.
"""

from __future__ import annotations

import torch

from v4stack import ops
from v4stack.model.linear import compute_dtype
from v4stack.model.moe import LocalGrouped, MoE


def route_order(idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ids sorted by (expert, pair id) and per-expert counts (int32), both on ``idx``'s device,
    with no host synchronisation (no ``bincount`` with data-dependent size)."""
    flat = idx.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(n_experts, dtype=torch.int32, device=idx.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, counts


def check_indices(idx: torch.Tensor, n_experts: int) -> None:
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n_experts):
        raise ValueError(f"indices must lie in [0, {n_experts}), got [{int(idx.min())}, {int(idx.max())}]")


class LocalExperts:
    """The block ``[first, first + n_local)`` of a layer's routed experts, held by one rank.

    ``w1``/``w2``/``w3`` are the model's own parameters (autograd reaches them); ``stacked()``
    gives ``[n_local, N, K]`` copies in the weight dtype for the GPU kernels, made once.
    """

    def __init__(self, moe: MoE, rank: int, world: int):
        n = moe.n_experts
        if world < 1 or n % world:
            raise ValueError(f"world size must divide n_routed_experts ({n}), got {world}")
        per = n // world
        self.moe, self.n_experts, self.n_local, self.first = moe, n, per, rank * per
        self.topk = moe.gate.topk
        mods = list(moe.experts[self.first : self.first + per])
        self.hidden = mods[0].w1.in_features
        self.inner = mods[0].w1.out_features
        self.limit = mods[0].limit
        self.w1 = [m.w1.weight for m in mods]
        self.w2 = [m.w2.weight for m in mods]
        self.w3 = [m.w3.weight for m in mods]
        self._stacked = None

    @classmethod
    def from_stacked(cls, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, *, first: int, n_experts: int,
                     topk: int, limit: float) -> "LocalExperts":
        """A block given as stacked ``[n_local, N, K]`` weights (benchmarks at full V4 sizes, where
        building the whole model layer on the host would not fit)."""
        self = cls.__new__(cls)
        self.moe, self.n_experts, self.n_local, self.first, self.topk = None, n_experts, w1.shape[0], first, topk
        self.hidden, self.inner, self.limit = w1.shape[2], w1.shape[1], limit
        self.w1, self.w3, self.w2 = list(w1), list(w3), list(w2)
        self._stacked = (w1, w3, w2)
        return self

    def stacked(self, dtype: torch.dtype = torch.bfloat16):
        if self._stacked is None or self._stacked[0].dtype != dtype:
            with torch.no_grad():
                self._stacked = tuple(torch.stack([w.to(dtype) for w in ws]).contiguous()
                                      for ws in (self.w1, self.w3, self.w2))
        return self._stacked

    def ffn(self, xe: torch.Tensor, we: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Expert math on expert-major rows (``counts`` rows per local expert), fp32 ``[R, h]``.

        This is the model's own local backend (``LocalGrouped``: one grouped GEMM per projection,
        V4 clamps, routing weight before ``w2``) run on this block as a layer of ``n_local``
        experts with one slot per row, so each expert's rows meet exactly the GEMMs, in the same
        row order, as in the single-process layer (and autograd records the same graph)."""
        if not xe.shape[0]:  # no rows here: an empty result still tied to xe and we, so every
            # rank's backward reaches the dispatch (a collective) whatever its routing
            # (and to the block's weights, whose gradient is then zero, as for any idle expert)
            cd = compute_dtype(xe.dtype)
            tie = xe.sum().to(cd) + we.sum().to(cd)
            if torch.is_grad_enabled() and self.w1[0].requires_grad:
                tie = tie + sum(w.sum() for w in self.w1 + self.w2 + self.w3).to(cd)
            return xe.new_zeros((0, self.hidden), dtype=cd) + tie * 0
        ids = torch.repeat_interleave(torch.arange(self.n_local, device=xe.device),
                                      torch.tensor(counts, device=xe.device)).unsqueeze(1)
        return LocalGrouped()(_Block(self), xe, we.unsqueeze(1), ids)


class _Block:
    """A rank's block of experts seen as a layer of ``n_local`` experts (what ``LocalGrouped`` reads)."""

    def __init__(self, ex: LocalExperts):
        self.ex, self.n_experts, self.limit = ex, ex.n_local, ex.limit

    def stacked_weights(self):
        ex = self.ex
        if torch.is_grad_enabled() and ex.w1[0].requires_grad:
            return tuple(torch.stack(ws) for ws in (ex.w1, ex.w2, ex.w3))  # in the graph
        if ex.moe is not None:  # the layer's own stacks (views of its parameters), our slice
            return tuple(w[ex.first : ex.first + ex.n_local] for w in ex.moe.stacked_weights())
        if getattr(ex, "_block", None) is None:
            ex._block = tuple(torch.stack(ws) for ws in (ex.w1, ex.w2, ex.w3))
        return ex._block


def reduce_pairs(comb: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``comb [N*k, h]`` in pair order -> ``[N, h]`` summed per token by ``ops.moe_combine``."""
    n, k = idx.shape
    return ops.moe_combine(comb.reshape(n, k, comb.shape[-1]), idx)
