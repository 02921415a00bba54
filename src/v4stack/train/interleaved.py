"""The interleaved 1F1B pipeline schedule: each rank holds ``V`` non-contiguous model chunks.

The model's blocks are cut into ``K = P x V`` contiguous virtual stages; virtual stage ``k`` lives
on rank ``k mod P`` as that rank's chunk ``k // P``. So with P = 2, V = 2 and 6 blocks, rank 0
holds blocks 0-1 and 4, rank 1 blocks 2-3 and 5. Virtual stage 0 (rank 0) holds the embedding,
the last one (rank P - 1) the hyper-connection head, the final norm, the output head and the MTP
block, as in 1F1B; every boundary, including the wrap from rank P - 1 back to rank 0, carries the
whole mHC state ``[tokens, hc_mult, hidden]`` forward and its gradient backward.

Order on rank ``r`` (``M`` micro-batches, a multiple of ``P``): forward number ``n`` runs chunk
``(n mod PV) // P`` on micro-batch ``(n // PV) P + n mod P``; backward number ``n`` the same with
the chunk counted from the last. ``(P - r - 1) 2 + (V - 1) P`` forwards warm up (at most ``MV``),
then one forward and one backward alternate, then the remaining backwards drain. Within a chunk
both forwards and backwards run in micro-batch order, so every parameter's gradient is summed in
the order of one process accumulating the same micro-batches: bitwise equal to it (tested on gloo).

Transport is the one 1F1B uses: sends are ``isend`` and are waited for at the end of the step;
receives block when the op needs them. Two kinds of message travel between the same pair of ranks
in both directions (streams and stream gradients of different chunks), so every message carries a
tag naming (micro-batch, virtual stage, direction); gloo matches by tag. Each pair's send order also
equals its receive order (tested), so a transport that matches in order pairs them the same way.
With sends that never
block, the schedule is free of deadlock exactly when the dependency graph over the ranks' op orders
has no cycle, which ``simulate`` checks by running it; the same simulation gives the bubble.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from v4stack.model import V4Model
from v4stack.train.mesh import Mesh
from v4stack.train.pipeline import Stage, run_1f1b, stage_bounds

SCHEDULES = ("1f1b", "interleaved")


def virtual_bounds(n_layers: int, pp: int, virtual: int) -> list[list[range]]:
    """Per rank, its ``virtual`` chunks (layer ranges), rank ``r`` holding virtual stages r, r + P, ..."""
    if virtual < 1 or pp * virtual > n_layers:
        raise ValueError(f"train field 'pp_virtual' must be >= 1 with pp x pp_virtual <= the number of layers "
                         f"({n_layers}), got pp {pp} x pp_virtual {virtual}")
    flat = stage_bounds(n_layers, pp * virtual)
    return [[flat[c * pp + r] for c in range(virtual)] for r in range(pp)]


def order(P: int, V: int, M: int, r: int) -> list[tuple[str, int, int]]:
    """Rank ``r``'s ops as ("F" or "B", local chunk, micro-batch); ``V = 1`` is plain 1F1B."""
    if V == 1:
        warm = min(P - r - 1, M)
        ops = [("F", 0, i) for i in range(warm)]
        for j in range(M - warm):
            ops += [("F", 0, warm + j), ("B", 0, j)]
        return ops + [("B", 0, i) for i in range(M - warm, M)]
    if M % P:
        raise ValueError(f"train field 'grad_accum' ({M}) must be a multiple of pp ({P}) for the interleaved schedule")

    def op(kind: str, n: int) -> tuple[str, int, int]:
        g, o = divmod(n, P * V)
        c = o // P
        return kind, (c if kind == "F" else V - 1 - c), g * P + o % P

    total = M * V
    warm = min((P - r - 1) * 2 + (V - 1) * P, total)
    ops = [op("F", n) for n in range(warm)]
    for j in range(total - warm):
        ops += [op("F", warm + j), op("B", j)]
    return ops + [op("B", n) for n in range(total - warm, total)]


def simulate(P: int, V: int, M: int, f: float = 1.0, b: float = 2.0, orders=None) -> dict:
    """Run the ranks' orders with blocking receives and non-blocking sends (zero transfer time), a
    whole-model forward costing ``f`` and backward ``b`` (a chunk: 1 / V of that). Raises
    RuntimeError on a deadlock. Returns the makespan and the bubble: idle / makespan per rank."""
    K = P * V
    orders = orders if orders is not None else [order(P, V, M, r) for r in range(P)]
    done: dict[tuple[str, int, int], float] = {}
    clock, pos = [0.0] * P, [0] * P
    moved = True
    while moved:
        moved = False
        for r in range(P):
            while pos[r] < len(orders[r]):
                kind, c, i = orders[r][pos[r]]
                k = c * P + r
                if kind == "F":
                    dep = ("F", k - 1, i) if k > 0 else None
                else:
                    dep = ("B", k + 1, i) if k < K - 1 else ("F", k, i)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                clock[r] = start + (f if kind == "F" else b) / V
                done[(kind, k, i)] = clock[r]
                pos[r] += 1
                moved = True
    stuck = [(r, orders[r][pos[r]]) for r in range(P) if pos[r] < len(orders[r])]
    if stuck:
        raise RuntimeError(f"pipeline schedule deadlocks: rank/op waiting {stuck}")
    if len(done) != 2 * K * M:
        raise RuntimeError(f"pipeline schedule runs {len(done)} ops, expected {2 * K * M}")
    span = max(clock)
    busy = M * (f + b)
    return {"makespan": span, "busy": busy, "bubble": (span - busy) / span}


@dataclass
class ChunkedStage(Stage):
    """One rank's ``V`` chunks; ``layers`` lists all its blocks (ownership, recompute)."""

    chunks: tuple[range, ...] = ()

    @classmethod
    def build(cls, model: V4Model, mesh: Mesh, mtp: bool, virtual: int = 2) -> "ChunkedStage":
        chunks = tuple(virtual_bounds(len(model.layers), mesh.pp, virtual)[mesh.stage])
        layers = [i for c in chunks for i in c]
        return cls(model, mesh, layers, mtp and len(model.mtp) > 0, model.embed.weight.dtype, chunks)

    @property
    def virtual(self) -> int:
        return len(self.chunks)

    def vstage(self, c: int) -> int:
        return c * self.mesh.pp + self.mesh.stage


def run_interleaved(stage: ChunkedStage, micro: list[torch.Tensor], mtp_weight: float, scale: float) -> torch.Tensor:
    """``run_1f1b``'s contract on ``V`` chunks per rank: one step's forwards and backwards, each
    micro-batch's loss times ``scale``; returns [sum of main losses, sum of MTP losses] (last rank)."""
    mesh = stage.mesh
    P, V, M = mesh.pp, stage.virtual, len(micro)
    K = P * V
    device = micro[0].device
    sums = torch.zeros(2, dtype=torch.float32, device=device)
    saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    pending: list = []

    def tag(i: int, k: int, grad: bool) -> int:
        return (i * K + k) * 2 + int(grad)

    def rank_of(k: int) -> int:
        return mesh.peer(k % P)

    def fwd(c: int, i: int) -> None:
        k = stage.vstage(c)
        x_in = None
        if k > 0:
            x_in = torch.empty(stage.stream_shape(micro[i]), dtype=stage.stream_dtype, device=device)
            dist.recv(x_in, rank_of(k - 1), tag=tag(i, k, False))
            x_in.requires_grad_(True)
        out = stage.forward_span(micro[i], x_in, stage.chunks[c], k == 0, k == K - 1)
        if k == K - 1:
            main, extra = out
            total = main if extra is None else main + mtp_weight * extra
            sums[0] += main.detach().float()
            if extra is not None:
                sums[1] += extra.detach().float()
            saved[(c, i)] = (x_in, total * scale)
        else:
            pending.append(dist.isend(out.detach(), rank_of(k + 1), tag=tag(i, k + 1, False)))
            saved[(c, i)] = (x_in, out)

    def bwd(c: int, i: int) -> None:
        k = stage.vstage(c)
        x_in, out = saved.pop((c, i))
        if k == K - 1:
            out.backward()
        else:
            g = torch.empty_like(out)
            dist.recv(g, rank_of(k + 1), tag=tag(i, k, True))
            torch.autograd.backward(out, g)
        if k > 0:
            pending.append(dist.isend(x_in.grad, rank_of(k - 1), tag=tag(i, k - 1, True)))

    for kind, c, i in order(P, V, M, mesh.stage):
        (fwd if kind == "F" else bwd)(c, i)
    for w in pending:
        w.wait()
    return sums


def build_stage(model: V4Model, mesh: Mesh, mtp: bool, schedule: str, virtual: int):
    """(stage, the function running one step's micro-batches) for ``schedule``."""
    if schedule == "interleaved":
        return ChunkedStage.build(model, mesh, mtp, virtual), run_interleaved
    return Stage.build(model, mesh, mtp), run_1f1b
