"""MegaMoE's transport: pull dispatch and push combine through symmetric buffers.

Every rank is both a source of tokens and the owner of a contiguous block of experts. One layer
call, on every rank at once:

1. **Dispatch.** The source writes its rows and routing weights into its own symmetric buffers
   and only metadata into each destination: its per-expert counts and its pair ids in
   (expert, pair id) order, into the row of the destination's ``counts`` / ``pairs`` reserved
   for this source. Barrier. Each expert rank then pulls the rows its experts need straight out
   of the sources' buffers, in canonical order (expert, source, pair id).
2. **Combine.** The expert rank writes each output row into the source's ``back`` buffer at the
   row's pair id (a region nobody else writes). Barrier. The source reduces in fixed order.

The backward runs the same two moves reversed: the gradient of the combined rows is pulled by the
experts (``gather_pairs``), the gradient of the dispatched rows is pushed back to the sources
(``scatter_pairs``). Each move is "writes, barrier, reads", and every buffer a rank writes was
last read before an earlier barrier, so calls and layers can share one set of buffers.

This module is the protocol with host-side metadata (CPU, and any device under autograd). The
device-side pipeline (CUDA: counts read by kernels, waves, a ring, overlapped streams, no host
round trip) is ``pipeline.py`` on the same buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from v4stack.megamoe.experts import route_order
from v4stack.megamoe.route import Route
from v4stack.megamoe.symm import symmetric_buffer

MAX_ELEM_BYTES = 8  # rows of up to fp64 travel through the byte buffers


class SymmetricTransport:
    """Symmetric buffers for ``max_tokens`` tokens per rank (``k`` pairs each) of width ``hidden``."""

    def __init__(self, *, n_experts: int, topk: int, hidden: int, max_tokens: int, group=None, device="cpu",
                 elem_bytes: int = MAX_ELEM_BYTES):
        if not (isinstance(max_tokens, int) and max_tokens > 0):
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if n_experts % self.world:
            raise ValueError(f"world size {self.world} must divide n_experts {n_experts}")
        self.n_experts, self.k, self.hidden, self.max_tokens = n_experts, topk, hidden, max_tokens
        self.n_local = n_experts // self.world
        self.first = self.rank * self.n_local
        self.device = torch.device(device)
        mtk = max_tokens * topk
        self.buf = symmetric_buffer({
            "rows": ((mtk, hidden * elem_bytes), torch.uint8),   # source's outbound rows
            "roww": ((mtk,), torch.float64),                     # source's routing weights
            "back": ((mtk, hidden * elem_bytes), torch.uint8),   # rows coming back to the source
            "backw": ((mtk,), torch.float64),
            "counts": ((self.world, n_experts), torch.int32),    # row s: source s's expert counts
            "pairs": ((self.world, mtk), torch.int32),           # row s: source s's sorted pair ids
        }, group, self.device)
        self.elem_bytes = elem_bytes

    def _rows(self, rank: int, name: str, dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
        """A byte buffer seen as rows of ``width`` (default ``hidden``) elements of ``dtype``."""
        width = width or self.hidden
        flat = self.buf.remote(rank, name).view(-1).view(dtype)
        if width > flat.numel() // (self.max_tokens * self.k):
            raise ValueError(f"rows of {width} x {dtype} do not fit buffers of {self.elem_bytes * self.hidden} bytes")
        return flat[: flat.numel() // width * width].view(-1, width)

    def _check(self, x: torch.Tensor, idx: torch.Tensor) -> None:
        n = x.shape[0]
        if n > self.max_tokens:
            raise ValueError(f"x has {n} tokens; the buffers hold max_tokens={self.max_tokens}")
        if idx.dim() != 2 or idx.shape[0] != n or idx.shape[1] > self.k or x.dim() != 2:
            raise ValueError(f"expected x [N, width] and indices [N, k <= {self.k}]; got x {tuple(x.shape)}, "
                             f"indices {tuple(idx.shape)}")

    # ---- forward -----------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor):
        """-> (route, rows for this rank's experts in canonical order, their routing weights)."""
        self._check(x, idx)
        n, k = idx.shape
        order, counts = route_order(idx, self.n_experts)
        self._rows(self.rank, "rows", x.dtype, x.shape[1])[:n].copy_(x)
        self.buf.local("roww")[: n * k].copy_(w.reshape(-1))
        order32 = order.to(torch.int32)
        for r in range(self.world):
            self.buf.remote(r, "counts")[self.rank].copy_(counts)
            self.buf.remote(r, "pairs")[self.rank, : n * k].copy_(order32)
        self.buf.barrier()
        route = self._segments(n, k, idx, order)
        xe = self._gather(route, "rows", x.dtype, by_token=True, width=x.shape[1])
        we = torch.cat([self.buf.remote(s, "roww")[p] for _, s, p in route.segs]).to(w.dtype) \
            if route.segs else w.new_zeros(0)
        return route, xe, we

    def _segments(self, n: int, k: int, idx: torch.Tensor, order: torch.Tensor) -> Route:
        cnt = self.buf.local("counts").cpu().long()                    # [world, E]
        local = cnt[:, self.first : self.first + self.n_local]          # [world, n_local]
        start = cnt[:, : self.first].sum(1, keepdim=True) + torch.cumsum(local, 1) - local
        pairs = self.buf.local("pairs")
        segs = []
        for e in range(self.n_local):
            for s in range(self.world):
                c = int(local[s, e])
                if c:
                    st = int(start[s, e])
                    segs.append((e, s, pairs[s, st : st + c].to(self.device, torch.long).clone()))
        return Route(n=n, k=k, idx=idx, order=order, counts=local.sum(0).tolist(), grid=local.tolist(), segs=segs)

    def _gather(self, route: Route, name: str, dtype: torch.dtype, by_token: bool, width: int | None = None):
        width = width or self.hidden
        parts = [self._rows(s, name, dtype, width)[p // route.k if by_token else p] for _, s, p in route.segs]
        return torch.cat(parts) if parts else torch.zeros(0, width, dtype=dtype, device=self.device)

    def _scatter(self, route: Route, ye: torch.Tensor, we: torch.Tensor | None = None):
        lo = 0
        for _, s, p in route.segs:
            m = p.numel()
            self._rows(s, "back", ye.dtype).index_copy_(0, p, ye[lo : lo + m])
            if we is not None:
                self.buf.remote(s, "backw").index_copy_(0, p, we[lo : lo + m].to(torch.float64))
            lo += m
        self.buf.barrier()
        nk = route.n * route.k
        out = self._rows(self.rank, "back", ye.dtype)[:nk].clone()
        return out, (self.buf.local("backw")[:nk].clone() if we is not None else None)

    def combine(self, route: Route, ye: torch.Tensor) -> torch.Tensor:
        """Expert outputs (canonical order) -> this rank's ``[n * k, h]`` rows in pair order."""
        return self._scatter(route, ye)[0]

    # ---- backward (the same moves reversed) ---------------------------------------------------

    def gather_pairs(self, route: Route, g: torch.Tensor) -> torch.Tensor:
        """Source rows in pair order ``[n * k, h]`` -> expert side, canonical order."""
        self._rows(self.rank, "rows", g.dtype)[: route.n * route.k].copy_(g)
        self.buf.barrier()
        return self._gather(route, "rows", g.dtype, by_token=False)

    def scatter_pairs(self, route: Route, gxe: torch.Tensor, gwe: torch.Tensor):
        """Expert-side rows and weights -> source side in pair order (``[n*k, h]``, ``[n*k]``)."""
        return self._scatter(route, gxe, gwe)

    def close(self) -> None:
        self.buf.close()
