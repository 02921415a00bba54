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

    def ffn(self, xe: torch.Tensor, we: torch.Tensor, counts: list[int], weights=None) -> torch.Tensor:
        """Expert math on expert-major rows (``counts`` rows per local expert), fp32 ``[R, h]``.

        This is the model's own local backend (``LocalGrouped``: one grouped GEMM per projection,
        V4 clamps, routing weight before ``w2``) run on this block as a layer of ``n_local``
        experts with one slot per row, so each expert's rows meet exactly the GEMMs, in the same
        row order, as in the single-process layer (and autograd records the same graph).
        ``weights``: ``(w1s, w2s, w3s)`` lists standing in for the block's parameters."""
        w1s, w2s, w3s = weights or (self.w1, self.w2, self.w3)
        if not xe.shape[0]:  # no rows here: an empty result still tied to xe and we, so every
            # rank's backward reaches the dispatch (a collective) whatever its routing
            # (and to the block's weights, whose gradient is then zero, as for any idle expert)
            cd = compute_dtype(xe.dtype)
            tie = xe.sum().to(cd) + we.sum().to(cd)
            if torch.is_grad_enabled() and w1s[0].requires_grad:
                tie = tie + sum(w.sum() for w in w1s + w2s + w3s).to(cd)
            return xe.new_zeros((0, self.hidden), dtype=cd) + tie * 0
        ids = torch.repeat_interleave(torch.arange(self.n_local, device=xe.device),
                                      torch.tensor(counts, device=xe.device)).unsqueeze(1)
        return LocalGrouped()(_Block(self, weights), xe, we.unsqueeze(1), ids)

    def ffn_by_source(self, xe: torch.Tensor, we: torch.Tensor, grid: list[list[int]]) -> torch.Tensor:
        """``ffn`` with each source rank's rows as their own batch (``grid[s][e]`` rows of source
        ``s`` for local expert ``e``; rows expert-major, sources in rank order inside an expert).

        The rows one source sends are exactly the rows its tokens bring to these experts in a
        single process running that source's micro-batch alone, so each source's outputs and input
        gradients are that process's bits, and the block's weight gradients are the sources' parts
        added in rank order: the order in which one process accumulates the micro-batches of a
        data-parallel step (and in which the sharded optimizer sums the dense gradients). Expert
        gradients then do not depend on the expert-parallel layout."""
        n = self.n_local
        grid_t = torch.tensor(grid, dtype=torch.long).view(-1, n)             # [sources, n_local]
        S = grid_t.shape[0]
        # each row's source (rows are expert-major, sources in order inside an expert); a stable
        # sort by source keeps each source's rows expert-major
        src = torch.repeat_interleave(torch.arange(S).repeat(n), grid_t.t().reshape(-1))
        by_src = torch.sort(src, stable=True).indices.to(xe.device)
        bounds = [0] + torch.cumsum(grid_t.sum(1), 0).tolist()
        weights = self.w1 + self.w2 + self.w3
        copies = _Fan.apply(S, *weights) if torch.is_grad_enabled() else weights * S
        outs = []
        for s in range(S):
            sel = by_src[bounds[s] : bounds[s + 1]]
            ws = copies[s * 3 * n : (s + 1) * 3 * n]
            outs.append(self.ffn(xe[sel], we[sel], grid_t[s].tolist(), (ws[:n], ws[n : 2 * n], ws[2 * n :])))
        return torch.cat(outs)[torch.argsort(by_src)]


class _Fan(torch.autograd.Function):
    """``n`` aliases of each weight, one set per source; the backward adds each weight's ``n``
    gradients in source order (autograd would add the uses of one tensor in the order it meets
    them). No nested backward, so it composes with activation checkpointing."""

    @staticmethod
    def forward(ctx, n: int, *weights):
        ctx.n, ctx.k = n, len(weights)
        return tuple(w.view_as(w) for _ in range(n) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        out = []
        for i in range(ctx.k):
            acc = grads[i]
            for s in range(1, ctx.n):
                acc = acc + grads[s * ctx.k + i]
            out.append(acc)
        return (None, *out)


class _Block:
    """A rank's block of experts seen as a layer of ``n_local`` experts (what ``LocalGrouped`` reads)."""

    def __init__(self, ex: LocalExperts, weights=None):
        self.ex, self.n_experts, self.limit = ex, ex.n_local, ex.limit
        self.override = weights is not None
        self.weights = weights if weights is not None else (ex.w1, ex.w2, ex.w3)

    def stacked_weights(self):
        ex, ws3 = self.ex, self.weights
        if torch.is_grad_enabled() and ws3[0][0].requires_grad:
            return tuple(torch.stack(ws) for ws in ws3)  # in the graph
        if not self.override and ex.moe is not None and _whole(ex.moe):  # the layer's own stacks (views of its parameters), our slice
            return tuple(w[ex.first : ex.first + ex.n_local] for w in ex.moe.stacked_weights())
        if self.override or ex.moe is not None:  # parameters that change between calls
            return tuple(torch.stack(ws) for ws in ws3)
        if getattr(ex, "_block", None) is None:  # a fixed block (benchmarks): stacked once
            ex._block = tuple(torch.stack(ws) for ws in ws3)
        return ex._block


def _whole(moe: MoE) -> bool:
    """Whether the layer holds every expert's weights (a trainer running expert parallelism keeps
    only its own block; the others are empty tensors)."""
    return all(m.w1.weight.numel() for m in (moe.experts[0], moe.experts[-1]))


def reduce_pairs(comb: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``comb [N*k, h]`` in pair order -> ``[N, h]`` summed per token by ``ops.moe_combine``."""
    n, k = idx.shape
    return ops.moe_combine(comb.reshape(n, k, comb.shape[-1]), idx)
