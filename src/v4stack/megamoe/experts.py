"""What both expert-parallel paths share: a rank's expert shard, the expert math, the row order,
and the source-side top-k reduction.

The fixed order (the contract behind bit-identity):

- Rows of one expert are ordered by (source rank, source token, top-k slot): on one host that is
  ascending global pair id ``token * k + slot`` when tokens are laid out rank after rank.
- Each expert's rows are cut into tiles of exactly ``tile`` rows starting at its first row; the
  last tile is zero-padded. Every GEMM call sees a ``[tile, h]`` input, whatever the wave, the
  ring capacity or the number of ranks, so no result depends on how many rows a wave holds.
  With ``gemm="row"`` each row is also computed on its own (``[1, h]`` GEMMs): the result of a
  row then depends on nothing but that row, which is what the single-process comparison uses.
- A source reduces its token's ``k`` routed outputs in fp32, left to right from zero, in
  ascending expert id (``((0 + y_e0) + y_e1) + ...`` with ``e0 < e1 < ...``; ties in slot order),
  then adds the shared expert. This is the order of ``ops.moe_combine`` in invariant mode.

The expert math is the model's own ``swiglu`` (fp32, V4 clamps, routing weight before ``w2``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from v4stack.megamoe.fp8 import FP8, dequantize_rows, quantize_rows
from v4stack.model.moe import MoE, swiglu

GEMM_MODES = ("row", "tile")


@dataclass
class ExpertShard:
    """The experts one rank owns: a contiguous block ``[first, first + n_local)``."""

    w1: list[torch.Tensor]
    w2: list[torch.Tensor]
    w3: list[torch.Tensor]
    first: int
    n_experts: int
    topk: int
    hidden: int
    limit: float
    tile: int = 8
    gemm: str = "row"

    @property
    def n_local(self) -> int:
        return len(self.w1)

    @classmethod
    def from_moe(cls, moe: MoE, rank: int, world: int, *, tile: int = 8, gemm: str = "row") -> "ExpertShard":
        n = moe.n_experts
        if world < 1 or n % world:
            raise ValueError(f"world size must divide n_routed_experts ({n}), got {world}")
        if not (isinstance(tile, int) and tile > 0):
            raise ValueError(f"tile must be a positive integer, got {tile!r}")
        if gemm not in GEMM_MODES:
            raise ValueError(f"gemm must be one of {GEMM_MODES}, got {gemm!r}")
        per = n // world
        experts = moe.experts[rank * per : (rank + 1) * per]
        return cls(
            w1=[e.w1.weight.detach() for e in experts], w2=[e.w2.weight.detach() for e in experts],
            w3=[e.w3.weight.detach() for e in experts], first=rank * per, n_experts=n,
            topk=moe.gate.topk, hidden=experts[0].w1.in_features if per else 0,
            limit=experts[0].limit if per else 0.0, tile=tile, gemm=gemm,
        )

    def owner(self, expert: torch.Tensor) -> torch.Tensor:
        return expert // self.n_local

    def ffn_tile(self, e: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` on one tile: ``x [tile, h]`` (any float dtype), ``w [tile]`` fp32."""
        if self.gemm == "tile":
            return swiglu(x, self.w1[e], self.w2[e], self.w3[e], self.limit, w)
        return torch.cat([swiglu(x[i : i + 1], self.w1[e], self.w2[e], self.w3[e], self.limit, w[i : i + 1])
                          for i in range(x.shape[0])])

    def ffn_rows(self, e: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` on all its rows (canonical order), tile by tile, zero-padded."""
        return ffn_rows(lambda xt, wt: self.ffn_tile(e, xt, wt), x, w, self.tile)


def ffn_rows(fn, x: torch.Tensor, w: torch.Tensor, tile: int) -> torch.Tensor:
    """Apply a per-tile ``fn`` to ``x`` cut into ``tile``-row tiles from row 0 (last one padded)."""
    m = x.shape[0]
    outs = []
    for lo in range(0, m, tile):
        xt, wt = pad_tile(x[lo : lo + tile], w[lo : lo + tile], tile)
        outs.append(fn(xt, wt)[: min(tile, m - lo)])
    if not outs:
        return x.new_zeros((0, x.shape[1]), dtype=torch.float32)
    return torch.cat(outs)


def pad_tile(x: torch.Tensor, w: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[0] == tile:
        return x, w
    xp = x.new_zeros((tile, x.shape[1]))
    wp = w.new_zeros((tile,))
    xp[: x.shape[0]] = x
    wp[: w.shape[0]] = w
    return xp, wp


def reduce_topk(comb: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``comb [N*k, h]`` (pair id order) -> ``[N, h]`` fp32.

    Per token, its k rows are added left to right starting from zero, in ascending expert id
    (ties, possible only with a hash table, in slot order): the model's invariant-mode order
    (``ops.moe_combine``).
    """
    n, k = idx.shape
    h = comb.shape[-1]
    rows = comb[: n * k].view(n, k, h)
    order = torch.sort(idx.to(rows.device), dim=1, stable=True).indices
    rows = rows.gather(1, order.unsqueeze(-1).expand(n, k, h))
    out = torch.zeros(n, h, dtype=torch.float32, device=comb.device)
    for j in range(k):
        out = out + rows[:, j].float()
    return out


def pairs_by_expert(idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ids (``token * k + slot``) sorted by (expert, pair id), and per-expert counts."""
    flat = idx.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n_experts):
        raise ValueError(f"expert indices must lie in [0, {n_experts}), got [{int(flat.min())}, {int(flat.max())}]")
    order = torch.sort(flat, stable=True).indices  # stable: pair ids ascend within an expert
    counts = torch.bincount(flat, minlength=n_experts)
    return order, counts


def shared_expert(moe: MoE, x: torch.Tensor, tile: int = 8, gemm: str = "row") -> torch.Tensor:
    """The shared expert in the same tiled / per-row form (fp32 output)."""
    se = moe.shared_experts
    if se is None:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    one = torch.ones(x.shape[0], dtype=torch.float32, device=x.device)

    def fn(xt, wt):
        if gemm == "tile":
            return swiglu(xt, se.w1.weight, se.w2.weight, se.w3.weight, se.limit, None)
        return torch.cat([swiglu(xt[i : i + 1], se.w1.weight, se.w2.weight, se.w3.weight, se.limit, None)
                          for i in range(xt.shape[0])])

    return ffn_rows(fn, x, one, tile)


@torch.no_grad()
def reference_routed(moe: MoE, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, *, tile: int = 8,
                     gemm: str = "row", dispatch_dtype: torch.dtype | None = None,
                     combine_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The routed part of the single-process layer in the documented order, fp32 ``[N, h]``.

    Same math and sum order as ``MoE.combine``; its expert GEMMs batch each expert's rows in
    one call, so the two agree bitwise when ``ops.linear`` is row-invariant (invariant mode).
    ``dispatch_dtype`` / ``combine_dtype`` round the rows the way a lossy dispatch (BF16, FP8 with
    per-128 scales) or a BF16 combine would.
    """
    if dispatch_dtype == FP8:
        x = dequantize_rows(*quantize_rows(x))
    elif dispatch_dtype is not None:
        x = x.to(dispatch_dtype)
    n, k = idx.shape
    shard = ExpertShard.from_moe(moe, 0, 1, tile=tile, gemm=gemm)
    order, counts = pairs_by_expert(idx.cpu(), moe.n_experts)
    order = order.to(x.device)
    comb = torch.zeros(n * k, x.shape[1], dtype=torch.float32, device=x.device)
    wf = w.reshape(-1).float()
    lo = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            p = order[lo : lo + c]
            comb[p] = shard.ffn_rows(e, x[p // k], wf[p]).to(combine_dtype).float()
        lo += c
    return reduce_topk(comb, idx)


@torch.no_grad()
def reference_moe(moe: MoE, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, *, tile: int = 8,
                  gemm: str = "row") -> torch.Tensor:
    """The whole single-process layer (routed + shared expert) in ``x``'s dtype."""
    out = reference_routed(moe, x, idx, w, tile=tile, gemm=gemm)
    if moe.shared_experts is not None:
        out = out + shared_expert(moe, x, tile, gemm)
    return out.to(x.dtype)


def tiles_for(count: int, tile: int) -> int:
    return math.ceil(count / tile)
