"""The single-process optimizer: Muon on the split's items, AdamW on the rest.

This is the reference the sharded (ZeRO) step must equal bit for bit, and the optimizer the
one-process trainer uses. Both run the same functions (``muon_step_``, ``adamw_step_``) on the
same item stacks.
"""

from __future__ import annotations

import torch
from torch import nn

from v4stack.optim.adamw import AdamWHyper, adamw_step_, no_decay
from v4stack.optim.muon import MuonHyper, muon_step_
from v4stack.optim.split import Item, ParamSplit, muon_items, split_params


def stack_of(tensors: dict[str, torch.Tensor], item: Item) -> torch.Tensor:
    """The item's members as one fp32 [k, n, m] tensor (a copy)."""
    return torch.stack([tensors[n].detach().float() for n in item.members])


class MuonAdamW:
    """Muon (V4 update) on 2-D linear weights, AdamW on everything else.

    ``step(grads)`` takes a name -> gradient dict (defaults to each parameter's ``.grad``).
    ``lr_scale`` multiplies both learning rates (for warm-up / decay schedules).
    ``use_muon=False`` is the AdamW-only baseline (same code, every parameter on AdamW).
    """

    def __init__(self, params: dict[str, nn.Parameter] | nn.Module, muon: MuonHyper | None = None,
                 adamw: AdamWHyper | None = None, use_muon: bool = True):
        if isinstance(params, nn.Module):
            params = dict(params.named_parameters())
        self.params = params
        self.muon_hp = (muon or MuonHyper()).validate()
        self.adamw_hp = (adamw or AdamWHyper()).validate()
        self.split: ParamSplit = split_params((n, p.shape) for n, p in params.items())
        if not use_muon:  # the AdamW-only baseline: every matrix goes to AdamW
            for n, shape in self.split.muon.items():
                self.split.adamw[n] = shape
                self.split.reasons[n] = "AdamW baseline (Muon off)"
            self.split.muon = {}
        self.items: list[Item] = muon_items(self.split.muon)
        self.steps = 0
        self.state: dict[str, torch.Tensor] = {}
        for it in self.items:
            dev = params[it.members[0]].device
            self.state[f"muon.{it.name}"] = torch.zeros(it.k, *it.shape, device=dev)
        for n in self.split.adamw:
            self.state[f"m.{n}"] = torch.zeros_like(params[n], dtype=torch.float32)
            self.state[f"v.{n}"] = torch.zeros_like(params[n], dtype=torch.float32)

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor] | None = None, lr_scale: float = 1.0) -> None:
        if grads is None:  # an unused parameter (an expert no token chose) has a zero gradient
            grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in self.params.items()}
        self.steps += 1
        for it in self.items:
            if any(n not in grads for n in it.members):
                continue
            p = stack_of(self.params, it)
            muon_step_(p, stack_of(grads, it), self.state[f"muon.{it.name}"], self.muon_hp,
                       lr=self.muon_hp.lr * lr_scale)
            for i, n in enumerate(it.members):
                self.params[n].copy_(p[i])
        for n, shape in self.split.adamw.items():
            if n not in grads:
                continue
            p = self.params[n]
            adamw_step_(p.data, grads[n].float(), self.state[f"m.{n}"], self.state[f"v.{n}"], self.steps,
                        self.adamw_hp, lr=self.adamw_hp.lr * lr_scale, decay=not no_decay(n, shape))

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def state_dict(self) -> dict:
        return {"steps": self.steps, "state": {k: v.clone() for k, v in self.state.items()}}

    def load_state_dict(self, sd: dict) -> None:
        missing = set(self.state) ^ set(sd["state"])
        if missing:
            raise ValueError(f"optimizer state does not match this model: {sorted(missing)[:4]} ...")
        self.steps = int(sd["steps"])
        for k, v in sd["state"].items():
            self.state[k].copy_(v)
