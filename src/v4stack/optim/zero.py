"""The sharded optimizer step: Muon inside ZeRO over ``torch.distributed``.

World = R replicated groups x G ranks (G = the ZeRO group size from the knapsack search unless
given). Inside a ZeRO group each Muon item (a whole matrix or an expert stack) has one owner, and
the AdamW parameters are one flat vector cut into G equal element shards. One step:

Buffers live on the parameters' device: gloo on CPU, NCCL on CUDA.

1. every rank lays its gradients out per peer: chunk j = the Muon items rank j owns (at their
   offsets, padded to the uniform ``max_load``) followed by AdamW shard j;
2. the buffer is rounded to bf16 (stochastically by default; ``stochastic=False`` sends fp32 so the
   step is exact) and one ``all_to_all`` delivers chunk j to rank j;
3. the owner sums the G received chunks in FP32, in rank order (with R > 1 the group sums are then
   all-gathered across replicas and summed in group order) - never a low-precision tree or ring;
4. the owner runs the Muon update on its items and AdamW on its shard (state lives only there);
5. one ``all_gather`` in the ZeRO group returns every updated value to every rank.

The single-process reference is ``MuonAdamW.step(canonical_sum(...))``: with rounding off the two
agree bit for bit, because both run ``muon_step_`` / ``adamw_step_`` on the same fp32 numbers.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from v4stack.optim.adamw import AdamWHyper, adamw_step_, no_decay
from v4stack.optim.hybrid import stack_of
from v4stack.optim.muon import MuonHyper, muon_step_
from v4stack.optim.ownership import DEFAULT_CAP, assign, search_group_size
from v4stack.optim.split import muon_items, split_params
from v4stack.optim.stochastic_bf16 import round_bf16


def canonical_sum(per_rank: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """The FP32 summation order of the sharded step: ranks in order inside each ZeRO group, then
    the groups in order. Tests build the single-process reference with it."""
    def seq(ts):
        acc = ts[0].float().clone()
        for t in ts[1:]:
            acc += t.float()
        return acc
    groups = [seq(per_rank[q:q + group_size]) for q in range(0, len(per_rank), group_size)]
    return seq(groups)


class ZeroMuonAdamW:
    """Muon + AdamW with ZeRO ownership; every rank holds the full parameters, owners hold state."""

    def __init__(self, params: dict[str, nn.Parameter] | nn.Module, muon: MuonHyper | None = None,
                 adamw: AdamWHyper | None = None, *, zero_group_size: int | None = None,
                 stochastic: bool = True, seed: int = 0, cap: int = DEFAULT_CAP,
                 group=None, group_ranks: tuple[int, ...] | None = None):
        """``group`` / ``group_ranks``: run inside a subgroup (e.g. one pipeline stage's data-parallel
        replicas) as one ZeRO group; otherwise the whole default group, searched into ZeRO groups."""
        if isinstance(params, nn.Module):
            params = dict(params.named_parameters())
        if not dist.is_initialized():
            raise RuntimeError("ZeroMuonAdamW needs torch.distributed initialised (use MuonAdamW on one process)")
        self.params = params
        self.device = next(iter(params.values())).device if params else torch.device("cpu")
        self.muon_hp = (muon or MuonHyper()).validate()
        self.adamw_hp = (adamw or AdamWHyper()).validate()
        self.stochastic = stochastic
        self.subgroup = group
        if group_ranks is not None:
            self.world, self.rank = len(group_ranks), list(group_ranks).index(dist.get_rank())
            zero_group_size = self.world
        else:
            self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.split = split_params((n, p.shape) for n, p in params.items())
        self.items = muon_items(self.split.muon)
        sizes = [it.numel for it in self.items]
        if sizes and len(sizes) > cap * self.world:
            # a small world cannot keep the deployment cap (the tiny preset has ~100 items): relax it
            cap = math.ceil(len(sizes) / self.world)
        self.cap = cap
        if zero_group_size is None:
            plan = search_group_size([sizes], self.world, cap).assignments
            g = plan[0].group_size if plan else self.world
            owners = plan[0].owners if plan else []
        else:
            if zero_group_size < 1 or self.world % zero_group_size:
                raise ValueError(f"zero_group_size must divide the world size {self.world}, got {zero_group_size}")
            g = zero_group_size
            owners = assign(sizes, g, max(cap, math.ceil(len(sizes) / g))).owners if sizes else []
        self.G, self.R = g, self.world // g
        self.local, self.replica = self.rank % g, self.rank // g
        self.owners = owners
        self._make_groups()

        # Muon layout: offsets inside the owner's chunk
        loads = [0] * g
        self.offsets = []
        for it, r in zip(self.items, owners):
            self.offsets.append(loads[r])
            loads[r] += it.numel
        self.L = max(loads) if loads else 0
        self.mine = [i for i, r in enumerate(owners) if r == self.local]
        # AdamW layout: one flat vector, G equal shards
        self.adam_names = list(self.split.adamw)
        self.N = sum(params[n].numel() for n in self.adam_names)
        self.S = math.ceil(self.N / g) if self.N else 0
        mask = torch.cat([torch.full((params[n].numel(),), not no_decay(n, tuple(params[n].shape)))
                          for n in self.adam_names]) if self.adam_names else torch.zeros(0, dtype=torch.bool)
        mask = torch.cat([mask, torch.zeros(g * self.S - self.N, dtype=torch.bool)])
        self.decay_mask = mask[self.local * self.S:(self.local + 1) * self.S].clone().to(self.device)

        self.steps = 0
        dev = self.device
        self.momentum = {i: torch.zeros(self.items[i].k, *self.items[i].shape, device=dev) for i in self.mine}
        self.exp_avg = torch.zeros(self.S, device=dev)
        self.exp_avg_sq = torch.zeros(self.S, device=dev)
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + self.rank)  # CPU: noise is drawn there
        self.last_reduced: torch.Tensor | None = None

    def _make_groups(self) -> None:
        g, r = self.G, self.R
        self.zero_group = self.replica_group = None
        if self.subgroup is not None:  # one ZeRO group: the given subgroup
            self.zero_group = self.subgroup
            return
        for q in range(r):  # every rank must create every group, in the same order
            pg = dist.new_group(list(range(q * g, (q + 1) * g)))
            if q == self.replica:
                self.zero_group = pg
        if r > 1:
            for j in range(g):
                pg = dist.new_group([q * g + j for q in range(r)])
                if j == self.local:
                    self.replica_group = pg

    # ---- the pieces of one step --------------------------------------------------------------

    def _send_buffer(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        chunk = self.L + self.S
        send = torch.zeros(self.G, chunk, device=self.device)
        for i, it in enumerate(self.items):
            o = self.offsets[i]
            send[self.owners[i], o:o + it.numel] = stack_of(grads, it).flatten()
        if self.N:
            flat = torch.cat([grads[n].detach().float().flatten() for n in self.adam_names])
            pad = torch.zeros(self.G * self.S, device=self.device)
            pad[:self.N] = flat
            send[:, self.L:] = pad.view(self.G, self.S)
        return send

    @torch.no_grad()
    def reduce(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """all_to_all the gradients to their owners; return this rank's FP32 sum (its chunk)."""
        send = self._send_buffer(grads)
        wire = round_bf16(send, self.stochastic, self.gen) if self.stochastic else send
        recv = torch.empty_like(wire)
        dist.all_to_all_single(recv.view(-1), wire.contiguous().view(-1), group=self.zero_group)
        rows = recv.view(self.G, -1)
        acc = rows[0].float().clone()
        for k in range(1, self.G):
            acc += rows[k].float()
        if self.R > 1:
            parts = [torch.empty_like(acc) for _ in range(self.R)]
            dist.all_gather(parts, acc, group=self.replica_group)
            acc = parts[0].clone()
            for q in range(1, self.R):
                acc += parts[q]
        self.last_reduced = acc
        return acc

    def owned_grad(self, acc: torch.Tensor, i: int) -> torch.Tensor:
        it, o = self.items[i], self.offsets[i]
        return acc[o:o + it.numel].view(it.k, *it.shape)

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor] | None = None, lr_scale: float = 1.0) -> None:
        if grads is None:
            grads = {n: p.grad for n, p in self.params.items()}
        missing = [n for n, g in grads.items() if g is None]
        if missing:  # the all_to_all needs every rank's full layout: unused parameters send zeros
            grads = {n: (torch.zeros_like(self.params[n]) if g is None else g) for n, g in grads.items()}
        for n in self.params:
            if n not in grads:
                grads[n] = torch.zeros_like(self.params[n])
        self.steps += 1
        acc = self.reduce(grads)
        out = torch.zeros(self.L + self.S, device=self.device)
        for i in self.mine:
            it, o = self.items[i], self.offsets[i]
            p = stack_of(self.params, it)
            muon_step_(p, self.owned_grad(acc, i), self.momentum[i], self.muon_hp, lr=self.muon_hp.lr * lr_scale)
            out[o:o + it.numel] = p.flatten()
        if self.S:
            shard = self._flat_params()[self.local * self.S:(self.local + 1) * self.S].clone()
            adamw_step_(shard, acc[self.L:], self.exp_avg, self.exp_avg_sq, self.steps, self.adamw_hp,
                        lr=self.adamw_hp.lr * lr_scale, decay=self.decay_mask)
            out[self.L:] = shard
        gathered = [torch.empty_like(out) for _ in range(self.G)]
        dist.all_gather(gathered, out, group=self.zero_group)
        self._scatter_back(gathered)

    def _flat_params(self) -> torch.Tensor:
        flat = torch.zeros(self.G * self.S, device=self.device)
        if self.N:
            flat[:self.N] = torch.cat([self.params[n].detach().float().flatten() for n in self.adam_names])
        return flat

    def _scatter_back(self, gathered: list[torch.Tensor]) -> None:
        for i, it in enumerate(self.items):
            o = self.offsets[i]
            vals = gathered[self.owners[i]][o:o + it.numel].view(it.k, *it.shape)
            for e, n in enumerate(it.members):
                self.params[n].copy_(vals[e])
        if self.S:
            flat = torch.cat([g[self.L:] for g in gathered])[:self.N]
            pos = 0
            for n in self.adam_names:
                p = self.params[n]
                p.copy_(flat[pos:pos + p.numel()].view_as(p))
                pos += p.numel()

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    # ---- checkpoints: each rank saves what it owns -------------------------------------------

    def state_dict(self) -> dict:
        return {"steps": self.steps, "world": self.world, "rank": self.rank, "zero_group_size": self.G,
                "local": self.local, "replica": self.replica, "owners": list(self.owners),
                "adam_layout": [(n, self.params[n].numel(), tuple(self.params[n].shape)) for n in self.adam_names],
                "momentum": {self.items[i].name: b.clone() for i, b in self.momentum.items()},
                "exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone(),
                "generator": self.gen.get_state()}

    def load_state_dict(self, sd: dict) -> None:
        for key, mine in (("world", self.world), ("rank", self.rank), ("zero_group_size", self.G)):
            if sd[key] != mine:
                raise ValueError(f"optimizer shard has {key}={sd[key]}, this process has {key}={mine}")
        if list(sd["owners"]) != list(self.owners):
            raise ValueError("optimizer shard was written under a different ownership plan")
        self.steps = int(sd["steps"])
        for i in self.mine:
            self.momentum[i].copy_(sd["momentum"][self.items[i].name])
        self.exp_avg.copy_(sd["exp_avg"])
        self.exp_avg_sq.copy_(sd["exp_avg_sq"])
        self.gen.set_state(sd["generator"])
