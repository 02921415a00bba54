"""The all-to-all transport (the baseline): ``all_to_all_single`` dispatch and combine.

A source sends its pairs in (expert, pair id) order, which is destination-major because experts
are owned in contiguous blocks; the destination receives, from each source in rank order, its
experts' rows in expert order and permutes them (on the device, one ``index_select``) into the
canonical expert-major order. The counts travel first (one small all-to-all and one host read
per call, needed for the split sizes); nothing is synchronised per expert. Rows travel as bytes,
so any dtype (and FP8 with its scales) goes over gloo and NCCL alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from v4stack.megamoe.experts import route_order
from v4stack.megamoe.route import Route


def a2a_rows(send: torch.Tensor, out_rows: list[int], in_rows: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` on the rows of a tensor of any dtype (sent as raw bytes)."""
    shape = send.shape[1:]
    width = shape.numel() * send.element_size()
    raw = send.contiguous().reshape(-1).view(torch.uint8).view(send.shape[0], width)
    recv = torch.empty(sum(out_rows), width, dtype=torch.uint8, device=send.device)
    dist.all_to_all_single(recv, raw, output_split_sizes=out_rows, input_split_sizes=in_rows, group=group)
    return recv.view(send.dtype).view(sum(out_rows), *shape)


class AllToAllTransport:
    def __init__(self, *, n_experts: int, topk: int, hidden: int, group=None, device="cpu"):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if n_experts % self.world:
            raise ValueError(f"world size {self.world} must divide n_experts {n_experts}")
        self.n_experts, self.k, self.hidden = n_experts, topk, hidden
        self.n_local = n_experts // self.world
        self.device = torch.device(device)

    def plan(self, idx: torch.Tensor) -> Route:
        """Exchange counts and build the route (the one host read of a call)."""
        n, k = idx.shape
        order, counts = route_order(idx, self.n_experts)
        send = counts.view(self.world, self.n_local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        host = torch.cat([recv.reshape(-1), send.sum(1)]).cpu().long()   # the one host read of a call
        rc = host[: recv.numel()].view_as(recv)                     # [source, local expert]
        send_rows = host[recv.numel():].tolist()
        perm = self._perm(recv.long(), int(rc.sum()))
        return Route(n=n, k=k, idx=idx, order=order, counts=rc.sum(0).tolist(), grid=rc.tolist(), send_rows=send_rows,
                     recv_rows=rc.sum(1).tolist(), perm=perm)

    def _perm(self, rc: torch.Tensor, rows: int) -> torch.Tensor:
        """Expert-major position -> received row, built on the device with fixed-shape ops.
        Received rows come source-major, expert-minor: the flattened ``[source, expert]`` order."""
        dev = rc.device
        flat = rc.reshape(-1)
        cum = torch.cumsum(flat, 0)
        j = torch.arange(rows, device=dev)
        f = torch.searchsorted(cum, j, right=True)
        s, e = f // self.n_local, f % self.n_local
        exp_off = torch.cumsum(rc.sum(0), 0) - rc.sum(0)              # first row of each expert
        src_off = torch.cumsum(rc, 0) - rc                            # rows of earlier sources, per expert
        dest = exp_off[e] + src_off[s, e] + (j - (cum[f] - flat[f]))
        perm = torch.empty(rows, dtype=torch.long, device=dev)
        perm[dest] = j
        return perm.to(self.device)

    def to_experts(self, route: Route, rows: torch.Tensor) -> torch.Tensor:
        """Rows in the source's sorted pair order -> expert side, canonical order."""
        recv = a2a_rows(rows, route.recv_rows, route.send_rows, self.group)
        return recv.index_select(0, route.perm)

    def to_sources(self, route: Route, ye: torch.Tensor) -> torch.Tensor:
        """Expert side rows (canonical order) -> the source's rows in its sorted pair order."""
        back = torch.empty_like(ye)
        back.index_copy_(0, route.perm, ye)
        return a2a_rows(back, route.send_rows, route.recv_rows, self.group)

    # ---- the transport interface (see pull.SymmetricTransport) -------------------------------

    def dispatch(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor):
        if x.dim() != 2 or x.shape[0] != idx.shape[0]:
            raise ValueError(f"expected x [N, width] for indices [N, {self.k}], got x {tuple(x.shape)}")
        route = self.plan(idx)
        xe = self.to_experts(route, x.index_select(0, route.order // route.k))
        we = self.to_experts(route, w.reshape(-1, 1)[route.order]).view(-1)
        return route, xe, we

    def _unsort(self, route: Route, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        out.index_copy_(0, route.order, rows)
        return out

    def combine(self, route: Route, ye: torch.Tensor) -> torch.Tensor:
        return self._unsort(route, self.to_sources(route, ye))

    def gather_pairs(self, route: Route, g: torch.Tensor) -> torch.Tensor:
        return self.to_experts(route, g.index_select(0, route.order))

    def scatter_pairs(self, route: Route, gxe: torch.Tensor, gwe: torch.Tensor):
        gx = self._unsort(route, self.to_sources(route, gxe))
        gw = self._unsort(route, self.to_sources(route, gwe.reshape(-1, 1)).view(-1))
        return gx, gw

    def close(self) -> None:
        pass
