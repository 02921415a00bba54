"""Pipeline parallelism for the V4 model: 1F1B over micro-batches, stages passing mHC streams.

A stage owns a contiguous run of blocks; stage 0 also owns the embedding, the last stage the
hyper-connection head, the final norm, the output head and the MTP block. What crosses a stage
boundary is the whole mHC residual state, ``[tokens, hc_mult, hidden]`` - ``hc_mult`` times the
bytes of a plain residual - forward, and its gradient backward.

Schedule (per stage ``s`` of ``P``, ``M`` micro-batches): ``min(P - s - 1, M)`` warm-up forwards,
then one forward and one backward alternately, then the remaining backwards. Sends are
non-blocking (``isend``) and are waited for only at the end of the step, so a stage's outgoing
streams travel while it computes the next micro-batch; receives block, since the next op needs
them. Backwards run in micro-batch order on every stage, so each parameter's gradient is summed
in the same order as a single process doing gradient accumulation over the same micro-batches:
the pipeline is bitwise equal to it (tested on gloo).

The MTP block shares the embedding with stage 0. When it is trained, the last stage holds a copy
of the embedding; after the backwards the two copies' gradients are added (first stage's sum +
last stage's sum) and both apply the same update. That sum groups the terms differently from one
process (which adds the two uses per micro-batch), so with MTP on the result equals a single
process to rounding, not to the bit.

With ``--grad-chunks`` (``train/unit_shard.py``) a stage runs its blocks on unit pieces (any cp,
1 included) and each micro-batch's backward lands chunk-ordered gradients (``chunk_backward``);
the embedding's unit gradients wait for the step's end, where the two copies add them per unit
(first + last, as one process adds the trunk's and the MTP block's use) before the units' tree:
pp x dp x cp equals one process bit for bit, MTP included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from v4stack.model import V4Model, rowwise
from v4stack.train.context import ContextShard, Layout, head_losses, logged_means, shard_means
from v4stack.train.mesh import Mesh
from v4stack.train.unit_shard import UnitShard, chunk_backward, chunk_forward


def stage_bounds(n_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges; the earlier stages take the remainder (the last one holds the head)."""
    if not 1 <= pp <= n_layers:
        raise ValueError(f"train field 'pp' must be between 1 and the number of layers ({n_layers}), got {pp}")
    base, extra = divmod(n_layers, pp)
    out, lo = [], 0
    for s in range(pp):
        hi = lo + base + (1 if s < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out


def stage_owns(name: str, layers: range, first: bool, last: bool, mtp: bool) -> bool:
    """Whether the stage holding ``layers`` owns the parameter or buffer ``name`` of the model."""
    top = name.split(".", 2)
    if top[0] == "layers":
        return int(top[1]) in layers
    if top[0] == "embed":
        return first or (last and mtp)
    return last  # norm, head, hc_head_*, the MTP block (trained or not: it is part of the model)


def stage_param_names(model: V4Model, layers: range, first: bool, last: bool, mtp: bool) -> list[str]:
    """Names (as in ``model.named_parameters()``) of the parameters one stage owns."""
    return [n for n, _ in model.named_parameters() if stage_owns(n, layers, first, last, mtp)]


def lm_loss(logits: torch.Tensor, mtp_logits: torch.Tensor | None, tokens: torch.Tensor):
    """(main next-token loss, MTP loss for token t+2 or None), mean over the micro-batch's tokens."""
    V = logits.shape[-1]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))
    if mtp_logits is None:
        return main, None
    return main, F.cross_entropy(mtp_logits[:, :-1].reshape(-1, V), tokens[:, 2:].reshape(-1))


@dataclass
class Stage:
    """One rank's share of the model in a pipeline."""

    model: V4Model
    mesh: Mesh
    layers: range
    mtp: bool
    stream_dtype: torch.dtype
    logged: tuple | None = field(default=None, init=False)  # under context parallelism: the last forward's (main, MTP) loss values
    chunk_grads: object = field(default=None, init=False)  # ChunkGrads under --grad-chunks (train/unit_shard.py)
    micro: int = field(default=0, init=False)  # the micro-batch running (chunk-ordered gradients file by it)

    @classmethod
    def build(cls, model: V4Model, mesh: Mesh, mtp: bool) -> "Stage":
        layers = stage_bounds(len(model.layers), mesh.pp)[mesh.stage]
        return cls(model, mesh, layers, mtp and len(model.mtp) > 0, model.embed.weight.dtype)

    def owns(self, name: str) -> bool:
        return stage_owns(name, self.layers, self.mesh.first, self.mesh.last, self.mtp)

    def param_names(self) -> list[str]:
        return [n for n, _ in self.model.named_parameters() if self.owns(n)]

    def state(self) -> dict:
        """This stage's parameters and buffers, by name, on the CPU (for checkpoints)."""
        return {n: t.detach().cpu() for n, t in self.model.state_dict().items() if self.owns(n)}

    def release_others(self) -> None:
        """Drop the weights this stage never uses (they stay as empty tensors of the same names)."""
        mine = set(self.param_names())
        for name, p in self.model.named_parameters():
            if name not in mine:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    @property
    def virtual(self) -> int:
        """Model chunks this rank holds (1: one contiguous run of blocks)."""
        return 1

    def forward(self, tokens: torch.Tensor, x: torch.Tensor | None):
        """Streams in (None on stage 0) -> streams out, or (main loss, MTP loss) on the last stage."""
        return self.forward_span(tokens, x, self.layers, self.mesh.first, self.mesh.last)

    def forward_span(self, tokens: torch.Tensor, x: torch.Tensor | None, layers, first: bool, last: bool):
        """The blocks ``layers``, after the embedding when ``first``, before the head when ``last``."""
        m = self.model
        B, T = tokens.shape
        if self.mesh.cp > 1 or self.chunk_grads is not None:
            return self._forward_cp(tokens, x, layers, first, last)
        segs, positions = m._fresh_segments(B, T, tokens.device)
        ids = tokens.reshape(-1)
        if first:
            x = m.embed(ids).unsqueeze(1).expand(-1, m.cfg.hc_mult, -1).contiguous()
        for i in layers:
            x = m.layers[i](x, positions, segs, ids)
        if not last:
            return x
        logits = m._head(x).view(B, T, -1)
        return lm_loss(logits, m.mtp_logits(x, tokens) if self.mtp else None, tokens)

    def _forward_cp(self, tokens: torch.Tensor, x, layers, first: bool, last: bool):
        """As ``forward_span`` on this rank's context shard (``train/context.py``): the attention
        layers exchange over the stage's cp group. On the last stage the returned losses are this
        shard's part of the means (for the backward); ``logged`` holds the means themselves."""
        m, mesh = self.model, self.mesh
        B, T = tokens.shape
        lay = Layout(mesh.cp, mesh.cp_rank, T)
        positions = lay.positions(B, tokens.device)
        if self.chunk_grads is None:
            shard = ContextShard(lay, B, mesh.cp_group)
        else:  # --grad-chunks: unit pieces, chunk-ordered gradients
            shard = UnitShard(lay, B, self.chunk_grads.units, mesh.cp_group)
        ids = lay.local(tokens).reshape(-1)
        with chunk_forward(self.chunk_grads, shard, self.micro):
            if first:
                x = rowwise.module_step(m.embed, m.embed, ids).unsqueeze(1).expand(-1, m.cfg.hc_mult, -1).contiguous()
            for i in layers:
                x = m.layers[i](x, positions, shard, ids)
            if not last:
                return x
            res = head_losses(m, x, tokens, shard, positions, self.mtp)
        self.logged = logged_means(res, lay, mesh.cp_group)
        return shard_means(res, tokens)

    def stream_shape(self, tokens: torch.Tensor) -> tuple[int, ...]:
        cfg = self.model.cfg
        return (tokens.numel() // self.mesh.cp, cfg.hc_mult, cfg.hidden_size)


def run_1f1b(stage: Stage, micro: list[torch.Tensor], mtp_weight: float, scale: float) -> torch.Tensor:
    """One optimizer step's forwards and backwards over ``micro`` (token batches, the same on every
    stage); each micro-batch's loss is multiplied by ``scale`` before its backward. Returns
    ``[sum of main losses, sum of MTP losses]`` over the micro-batches (zeros except on the last stage)."""
    mesh = stage.mesh
    P, s, M = mesh.pp, mesh.stage, len(micro)
    device = micro[0].device
    sums = torch.zeros(2, dtype=torch.float32, device=device)
    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    pending: list = []

    def fwd(i: int) -> None:
        x_in = None
        if not mesh.first:
            x_in = torch.empty(stage.stream_shape(micro[i]), dtype=stage.stream_dtype, device=device)
            dist.recv(x_in, mesh.peer(s - 1))
            x_in.requires_grad_(True)
        stage.micro = i
        out = stage.forward(micro[i], x_in)
        if mesh.last:
            main, extra = out
            total = main if extra is None else main + mtp_weight * extra
            if stage.logged is not None:  # context shards: the means, counted on the first shard
                main, extra = (None if v is None else v * (mesh.cp_rank == 0) for v in stage.logged)
            sums[0] += main.detach().float()
            if extra is not None:
                sums[1] += extra.detach().float()
            saved[i] = (x_in, total * scale)
        else:
            pending.append(dist.isend(out.detach(), mesh.peer(s + 1)))
            saved[i] = (x_in, out)

    def bwd(i: int) -> None:
        x_in, out = saved.pop(i)
        g = None
        if not mesh.last:
            g = torch.empty_like(out)
            dist.recv(g, mesh.peer(s + 1))
        with chunk_backward(stage.chunk_grads, mesh, i):
            torch.autograd.backward(out, g)
        if not mesh.first:
            pending.append(dist.isend(x_in.grad, mesh.peer(s - 1)))

    warm = min(P - s - 1, M)
    for i in range(warm):
        fwd(i)
    for i in range(M - warm):
        fwd(warm + i)
        bwd(i)
    for i in range(M - warm, M):
        bwd(i)
    for w in pending:
        w.wait()
    return sums


def tie_embedding_grads(stage: Stage, group_first_last) -> None:
    """With MTP trained on the last stage: add the embedding gradients of stage 0 and the last stage
    (first + last, in that order) so both copies take the same update."""
    if not stage.mtp or stage.mesh.pp == 1 or not (stage.mesh.first or stage.mesh.last):
        return
    w = stage.model.embed.weight
    hook = stage.chunk_grads
    if hook is not None:  # --grad-chunks: per unit first + last, then the units' tree as one process
        def exchange(units: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(units) for _ in range(2)]
            dist.all_gather(parts, units.contiguous(), group=group_first_last)
            return parts[0] + parts[1]

        got = hook.finish_deferred(stage.mesh.cp, stage.mesh.cp_rank, stage.mesh.cp_group, exchange)
        w.grad = torch.zeros_like(w) if got is None else got["embed.weight"]
        return
    g = w.grad if w.grad is not None else torch.zeros_like(w)
    parts = [torch.empty_like(g) for _ in range(2)]
    dist.all_gather(parts, g.contiguous(), group=group_first_last)
    w.grad = parts[0] + parts[1]


def first_last_groups(mesh: Mesh) -> object:
    """Per replica, the group {stage 0 rank, last stage rank}; every rank creates all of them in order."""
    mine = None
    if mesh.pp == 1:
        return None
    cp = mesh.cp
    for r in range(mesh.dp):
        for c in range(cp):  # under context parallelism: per context shard too
            g = dist.new_group([r * cp + c, ((mesh.pp - 1) * mesh.dp + r) * cp + c])
            if r == mesh.replica and c == mesh.cp_rank:
                mine = g
    return mine
