"""The unfused baseline with MegaMoE's math: ``all_to_all_single`` dispatch -> per-expert tiled
GEMMs -> SwiGLU -> GEMMs -> ``all_to_all_single`` combine, then the same slot-order reduction.

Rows travel as raw bytes (so BF16 and FP8 go over gloo too). A source sends its pairs sorted by
(expert, pair id); experts are contiguous blocks per rank, so that order is destination-major and
the destination receives, from each source, its experts' rows in expert order. The destination
computes expert by expert over the sources in rank order: the same tiles as MegaMoE.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from v4stack.megamoe.experts import ExpertShard, pairs_by_expert, reduce_topk
from v4stack.megamoe.fp8 import FP8, dequantize_rows, quantize_rows


def _a2a_rows(send: torch.Tensor, out_rows: list[int], in_rows: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` on the rows of a 2-D tensor of any dtype (sent as bytes)."""
    width = send.shape[1] * send.element_size()
    raw = send.contiguous().view(torch.uint8).view(send.shape[0], width)
    recv = torch.empty(sum(out_rows), width, dtype=torch.uint8, device=send.device)
    dist.all_to_all_single(recv, raw, output_split_sizes=out_rows, input_split_sizes=in_rows, group=group)
    return recv.view(send.dtype).view(sum(out_rows), send.shape[1])


class AllToAllMoE:
    """Expert-parallel MoE over two ``all_to_all_single`` exchanges (the baseline)."""

    def __init__(self, shard: ExpertShard, *, group=None, dispatch_dtype: torch.dtype = torch.bfloat16,
                 combine_dtype: torch.dtype = torch.float32):
        self.shard, self.group = shard, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if shard.n_local * self.world != shard.n_experts:
            raise ValueError(f"shard holds {shard.n_local} experts; world {self.world} x that must equal "
                             f"n_experts {shard.n_experts}")
        self.dispatch_dtype, self.combine_dtype = dispatch_dtype, combine_dtype
        self.last_remote_rows = 0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n, k = idx.shape
        if k != self.shard.topk or x.shape != (n, self.shard.hidden) or w.shape != idx.shape:
            raise ValueError(f"expected x [N, {self.shard.hidden}], idx and w [N, {self.shard.topk}]; got "
                             f"x {tuple(x.shape)}, idx {tuple(idx.shape)}, w {tuple(w.shape)}")
        nl, world, g = self.shard.n_local, self.world, self.group
        order, counts = pairs_by_expert(idx.cpu(), self.shard.n_experts)
        order = order.to(x.device)
        send_counts = counts.view(world, nl).to(torch.int64).to(x.device)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=g)
        in_rows = send_counts.sum(1).tolist()
        out_rows = recv_counts.sum(1).tolist()
        if self.dispatch_dtype == FP8:
            q, scales = quantize_rows(x[order // k])
            rx = dequantize_rows(_a2a_rows(q, out_rows, in_rows, g), _a2a_rows(scales, out_rows, in_rows, g))
        else:
            rx = _a2a_rows(x[order // k].to(self.dispatch_dtype), out_rows, in_rows, g)
        rw = _a2a_rows(w.reshape(-1, 1).float()[order], out_rows, in_rows, g).view(-1)
        self.last_remote_rows = sum(c for r, c in enumerate(out_rows) if r != self.rank)

        # expert-major over sources in rank order (MegaMoE's row order), results back source-major
        rc = recv_counts.cpu()
        src_start = torch.cumsum(rc.sum(1), 0) - rc.sum(1)
        exp_start = torch.cumsum(rc, 1) - rc
        y = torch.empty(rx.shape[0], self.shard.hidden, dtype=self.combine_dtype, device=x.device)
        for e in range(nl):
            rows = torch.cat([torch.arange(int(src_start[s] + exp_start[s, e]),
                                           int(src_start[s] + exp_start[s, e] + rc[s, e]))
                              for s in range(world)]).to(x.device)
            if rows.numel():
                y[rows] = self.shard.ffn_rows(e, rx[rows], rw[rows]).to(self.combine_dtype)

        back = _a2a_rows(y, in_rows, out_rows, g)
        comb = torch.empty(n * k, self.shard.hidden, dtype=self.combine_dtype, device=x.device)
        comb[order] = back
        return reduce_topk(comb, idx)

    __call__ = forward
