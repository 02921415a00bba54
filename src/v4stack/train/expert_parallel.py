"""Expert parallelism in the trainer (``--ep N --ep-backend all_to_all|megamoe``).

The ``dp`` data-parallel ranks (``pp == 1``) are cut into expert-parallel groups of ``ep``
consecutive ranks. Inside a group rank ``j`` holds routed experts ``[j * E/ep, (j + 1) * E/ep)``
of every MoE layer (the others are dropped: empty tensors under the same names) and every MoE
layer's routed part runs through ``megamoe``'s expert-parallel backend on the group. Each rank
still trains on its own micro-batches, so the dense parameters stay data parallel.

Gradients and ownership:

- dense parameters: the sharded optimizer (``ZeroMuonAdamW``) over all ``dp`` ranks, as without EP;
- a rank's experts: their gradients already hold every token of the EP group (the backward of the
  combine and dispatch brings them to the owner). The backend runs each source rank's rows as
  their own batch and adds the sources' weight gradients in rank order (``source_order``), the
  order in which one process accumulates the group's micro-batches. With ``dp == ep`` the
  owner's Muon/AdamW steps them locally (each expert stack is owned by the one rank that holds
  it); with ``dp > ep`` the ranks holding the same block (one per EP group) run a ZeRO step over
  that block among themselves.

So with ``dp == ep`` and one micro-batch per rank a step equals the one-process trainer that
accumulates the same micro-batches, bit for bit (``tests/train/test_expert_parallel.py``); with
``dp > ep`` or more micro-batches per rank the sums are regrouped and equal it up to fp32
reassociation. Checkpoints keep weights by name: rank ``j`` of the first EP group writes its
experts as a part, rank 0 the dense weights. Each rank's optimizer shard holds its dense and
expert parts and the first expert of its block, so a run resumes under another ``ep`` and world
(one process included): the shards are merged by parameter name (expert stacks' momenta per
expert) and re-cut to the new owners (``optim/reshard.py``).

Evaluation inside a run (no autograd) goes through the same backend on every rank of the group
(the exchange is collective), with the model's torch expert maths, so it always reads the current
weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from v4stack.optim.hybrid import MuonAdamW
from v4stack.optim.split import ParamSplit, split_params
from v4stack.optim.zero import ZeroMuonAdamW
from v4stack.train import checkpoint as ckpt

BACKENDS = ("all_to_all", "megamoe")
SOURCE_ORDER = True  # the backend's per-source expert batches (tests turn it off for their control)
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass
class ExpertParallel:
    ep: int
    index: int                     # this rank's place in its EP group (its block of experts)
    group: object                  # the EP group
    block: tuple[int, int]         # [first, end) of this rank's routed experts in every layer
    replica_group: object = None   # ranks holding the same block (dp > ep), else None
    replica_ranks: tuple[int, ...] = ()
    first_group: bool = False      # in the first EP group (its ranks write the experts' weights)

    @staticmethod
    def is_expert(name: str) -> bool:
        """A routed expert's parameter (the shared expert is dense)."""
        return _EXPERT.search(name) is not None

    def owns(self, name: str) -> bool:
        m = _EXPERT.search(name)
        return m is not None and self.block[0] <= int(m.group(1)) < self.block[1]

    def local_state(self, model: nn.Module) -> dict:
        return {n: t.detach().cpu() for n, t in model.state_dict().items() if self.is_expert(n) and self.owns(n)}

    def dense_state(self, model: nn.Module) -> dict:
        return {n: t.detach().cpu() for n, t in model.state_dict().items() if not self.is_expert(n)}

    def save_part(self, root: Path, step: int, model: nn.Module) -> None:
        """The first EP group's ranks write their experts (one part each)."""
        if self.first_group:
            ckpt.write_model_part(root, step, f"experts{self.index}", {"model": self.local_state(model)})


def setup(model, ep: int, backend: str, mesh, device: torch.device, max_tokens: int) -> ExpertParallel | None:
    """Build the groups, drop the other ranks' experts and install the backend (collective: every
    rank of the world calls it, in the same order). ``None`` when ``ep == 1``."""
    if ep == 1:
        return None
    if backend not in BACKENDS:
        raise ValueError(f"train field 'ep_backend' must be one of {BACKENDS}, got {backend!r}")
    n_experts = model.cfg.n_routed_experts
    if mesh.pp != 1:
        raise ValueError(f"train field 'ep' is {ep}: expert parallelism runs with pp = 1")
    if ep < 1 or mesh.dp % ep or n_experts % ep:
        raise ValueError(f"train field 'ep' must divide the data-parallel ranks ({mesh.dp}) and "
                         f"n_routed_experts ({n_experts}), got {ep}")
    from v4stack.megamoe.backend import expert_parallel_factory

    rank, dp = mesh.rank, mesh.dp
    group = replica_group = None
    for q in range(dp // ep):  # every rank creates every group, in the same order
        pg = dist.new_group(list(range(q * ep, (q + 1) * ep)))
        if q == rank // ep:
            group = pg
    replica_ranks = tuple(range(rank % ep, dp, ep))
    if dp > ep:
        for j in range(ep):
            pg = dist.new_group(list(range(j, dp, ep)))
            if j == rank % ep:
                replica_group = pg
    per = n_experts // ep
    index = rank % ep
    out = ExpertParallel(ep, index, group, (index * per, (index + 1) * per), replica_group, replica_ranks,
                         first_group=rank < ep)
    for name, p in model.named_parameters():
        if out.is_expert(name) and not out.owns(name):
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    model.set_expert_backend(expert_parallel_factory(
        backend, max_tokens=max_tokens, group=group, device=device, pipeline=False, kernels=False,
        source_order=SOURCE_ORDER))
    return out


class SplitOptimizer:
    """The dense parameters' sharded optimizer and the local experts' optimizer, stepped together."""

    def __init__(self, dense, experts, split: ParamSplit, first_expert: int):
        self.parts = {"dense": dense, "experts": experts}
        self.split = split
        self.first_expert = first_expert  # the block's first routed expert (its stacks' row 0)

    def step(self, grads=None, lr_scale: float = 1.0) -> None:
        for opt in self.parts.values():
            opt.step(lr_scale=lr_scale)

    def zero_grad(self) -> None:
        for opt in self.parts.values():
            opt.zero_grad()

    def state_dict(self) -> dict:
        return {"expert_parallel": {**{k: opt.state_dict() for k, opt in self.parts.items()},
                                    "first_expert": self.first_expert}}

    def load_state_dict(self, sd: dict) -> None:
        if "expert_parallel" not in sd:
            raise ValueError("optimizer shard was written without expert parallelism; resume with the same ep")
        for k, opt in self.parts.items():
            opt.load_state_dict(sd["expert_parallel"][k])


def optimizer(params: dict, ep: ExpertParallel, muon_hp, adamw_hp, *, stochastic: bool, seed: int) -> SplitOptimizer:
    dense = {n: p for n, p in params.items() if not ep.is_expert(n)}
    local = {n: p for n, p in params.items() if ep.is_expert(n) and ep.owns(n)}
    dense_opt = ZeroMuonAdamW(dense, muon_hp, adamw_hp, stochastic=stochastic, seed=seed)
    if ep.replica_group is None:
        expert_opt = MuonAdamW(local, muon_hp, adamw_hp)
    else:
        expert_opt = ZeroMuonAdamW(local, muon_hp, adamw_hp, stochastic=stochastic, seed=seed,
                                   group=ep.replica_group, group_ranks=ep.replica_ranks)
    return SplitOptimizer(dense_opt, expert_opt, split_params((n, p.shape) for n, p in {**dense, **local}.items()),
                          ep.block[0])
