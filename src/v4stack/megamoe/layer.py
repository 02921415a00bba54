"""The model's MoE layer, expert-parallel: the gate and the shared expert run on each rank's own
tokens; the routed experts run through MegaMoE (``path="megamoe"``) or the all-to-all baseline
(``path="baseline"``). Each rank keeps only its block of experts."""

from __future__ import annotations

import torch
import torch.distributed as dist

from v4stack.megamoe.baseline import AllToAllMoE
from v4stack.megamoe.experts import ExpertShard, shared_expert
from v4stack.megamoe.pull import MegaMoE
from v4stack.model.moe import MoE

PATHS = ("megamoe", "baseline")


class ExpertParallelMoE:
    def __init__(self, moe: MoE, *, path: str = "megamoe", max_tokens: int = 4096, group=None,
                 device="cpu", tile: int = 8, gemm: str = "row", ring_tiles: int = 8,
                 dispatch_dtype: torch.dtype = torch.bfloat16, combine_dtype: torch.dtype = torch.float32):
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.moe, self.tile, self.gemm = moe, tile, gemm
        shard = ExpertShard.from_moe(moe, rank, world, tile=tile, gemm=gemm)
        if path == "megamoe":
            self.routed = MegaMoE(shard, max_tokens=max_tokens, group=group, device=device,
                                  dispatch_dtype=dispatch_dtype, combine_dtype=combine_dtype,
                                  ring_tiles=ring_tiles)
        else:
            self.routed = AllToAllMoE(shard, group=group, dispatch_dtype=dispatch_dtype,
                                      combine_dtype=combine_dtype)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        idx, w = self.moe.gate(x, token_ids)
        return self.apply(x, idx, w)

    @torch.no_grad()
    def apply(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Routed (expert-parallel) + shared expert for given routing; returned in ``x``'s dtype."""
        out = self.routed(x, idx, w)
        if self.moe.shared_experts is not None:
            out = out + shared_expert(self.moe, x, self.tile, self.gemm)
        return out.to(x.dtype)
