"""The training mesh: ``world = pp x dp x cp`` ranks, stage-major, then replica, then context
shard (rank = (stage * dp + replica) * cp + cp_rank). Under pipeline x context parallelism a
stage's ZeRO group is its ``dp x cp`` ranks (the shards' partial gradients are summed there), and
streams pass between the peers of the same replica and context shard.

Every rank creates every group in the same order (``new_group`` is collective over the world), so
one ``Mesh`` per process is built by all processes together. On one process, or with ``pp == 1``
and ``dp == world``, it degenerates to plain data parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class Mesh:
    rank: int
    world: int
    pp: int
    dp: int
    dp_group: object = None  # this stage's replicas (None: the default group or no group)
    dp_ranks: tuple[int, ...] = ()
    cp: int = 1  # context-parallel shards of each sequence (train/context.py)
    cp_group: object = None  # this replica's context shards (None: the default group)

    @property
    def stage(self) -> int:
        return self.rank // (self.dp * self.cp)

    @property
    def replica(self) -> int:
        return (self.rank // self.cp) % self.dp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def peer(self, stage: int) -> int:
        """Global rank of this replica's (and context shard's) counterpart in ``stage``."""
        return (stage * self.dp + self.replica) * self.cp + self.cp_rank


def build_mesh(pp: int, cp: int = 1) -> Mesh:
    """The mesh of the initialised default group (or one process) with ``pp`` pipeline stages."""
    if not dist.is_initialized():
        if pp != 1 or cp != 1:
            raise ValueError(f"train fields 'pp' ({pp}) and 'cp' ({cp}): more than one needs torch.distributed (torchrun)")
        return Mesh(0, 1, 1, 1)
    world, rank = dist.get_world_size(), dist.get_rank()
    if cp > 1:
        if pp < 1 or world % (pp * cp):
            raise ValueError(f"train fields 'pp' ({pp}) x 'cp' ({cp}) must divide the world size {world}")
        dp = world // (pp * cp)
        mesh = Mesh(rank, world, pp, dp, dp_ranks=tuple(range(world)), cp=cp)
        for s in range(pp):  # every rank creates every group, stage by stage, in the same order
            ranks = tuple(range(s * dp * cp, (s + 1) * dp * cp))
            group = dist.new_group(list(ranks)) if pp > 1 else None
            if s == mesh.stage and pp > 1:
                mesh.dp_group, mesh.dp_ranks = group, ranks
            for d in range(dp):
                sub = list(ranks[d * cp:(d + 1) * cp])
                g = dist.new_group(sub) if pp * dp > 1 else None
                if s == mesh.stage and d == mesh.replica:
                    mesh.cp_group = g
        return mesh
    if pp < 1 or world % pp:
        raise ValueError(f"train field 'pp' must divide the world size {world}, got {pp}")
    dp = world // pp
    mesh = Mesh(rank, world, pp, dp)
    if pp == 1:
        mesh.dp_ranks = tuple(range(world))
        return mesh
    for s in range(pp):  # every rank creates every stage's group, in stage order
        ranks = tuple(range(s * dp, (s + 1) * dp))
        group = dist.new_group(list(ranks)) if dp > 1 else None
        if s == mesh.stage:
            mesh.dp_group, mesh.dp_ranks = group, ranks
    return mesh
