"""Optimizer state independent of how it was sharded, so a run can resume on another rank count.

The full state is ``{"steps", "muon": {param: momentum}, "m": {param: exp_avg}, "v": {param:
exp_avg_sq}}``: what one ``MuonAdamW`` holds, by parameter name (an expert stack's momentum is
kept per expert, so a stack can be re-cut into other blocks of experts). ``full_state`` builds it
from a checkpoint's shards (one process's ``MuonAdamW`` state, the ``ZeroMuonAdamW`` shards of
every rank, pipeline stages included, or the expert-parallel trainer's dense + expert parts, which
record the first routed expert of their block), and ``load_full_state`` gives an optimizer of any
layout the part it owns. What cannot carry over: the stochastic-rounding generators are per rank,
so a resharded run draws new rounding noise (with rounding off, nothing random remains).
"""

from __future__ import annotations

import re

import torch

from v4stack.optim.hybrid import MuonAdamW
from v4stack.optim.zero import ZeroMuonAdamW


_STACK = re.compile(r"^(?P<prefix>.*\.experts)\.\*\.(?P<proj>w[123])\.weight$")


def _members(item: str, k: int, first: int) -> list[str]:
    """The parameters behind the ``k`` rows of Muon item ``item``'s momentum: itself, or for an
    expert stack the experts ``first .. first + k - 1`` (a stack holds its experts in order)."""
    m = _STACK.match(item)
    if m is None:
        return [item]
    return [f"{m['prefix']}.{first + j}.{m['proj']}.weight" for j in range(k)]


def _parts(sd: dict) -> list[tuple[dict, int]]:
    """(optimizer state, first routed expert it holds) for one rank's saved state."""
    if "expert_parallel" not in sd:
        return [(sd, 0)]
    ep = sd["expert_parallel"]
    if "first_expert" not in ep:
        raise ValueError("expert-parallel optimizer shard does not record its block of experts "
                         "(written before re-cutting was supported); resume with the same ep and world")
    return [(ep["dense"], 0), (ep["experts"], int(ep["first_expert"]))]


def full_state(shards: list[dict]) -> dict:
    """Merge optimizer states saved by every rank (any mix of layouts) into the full state."""
    out: dict = {"steps": None, "muon": {}, "m": {}, "v": {}}
    by_group: dict[tuple, dict[int, dict]] = {}
    for sd, first in (part for shard in shards for part in _parts(shard)):
        _steps(out, sd["steps"])
        if "state" in sd:  # MuonAdamW
            for k, v in sd["state"].items():
                kind, name = k.split(".", 1)
                if kind == "muon":
                    out["muon"].update(zip(_members(name, v.shape[0], first), v))
                else:
                    out[kind][name] = v
            continue
        for name, mom in sd["momentum"].items():
            out["muon"].update(zip(_members(name, mom.shape[0], first), mom))
        key = (tuple(n for n, *_ in sd["adam_layout"]), sd["zero_group_size"], sd["replica"])
        by_group.setdefault(key, {})[sd["local"]] = sd
    for (names, g, _), parts in by_group.items():
        if sorted(parts) != list(range(g)):
            raise ValueError(f"optimizer shards incomplete: ZeRO group of {g} ranks has shards {sorted(parts)}")
        layout = parts[0]["adam_layout"]
        for key, dst in (("exp_avg", "m"), ("exp_avg_sq", "v")):
            flat = torch.cat([parts[i][key] for i in range(g)])
            pos = 0
            for name, numel, shape in layout:
                out[dst][name] = flat[pos:pos + numel].view(shape).clone()
                pos += numel
    return out


def _steps(out: dict, steps: int) -> None:
    if out["steps"] is not None and out["steps"] != steps:
        raise ValueError(f"optimizer shards disagree on the step count ({out['steps']} vs {steps})")
    out["steps"] = int(steps)


def load_full_state(opt, full: dict) -> None:
    """Give ``opt`` (``MuonAdamW``, ``ZeroMuonAdamW``, or an optimizer made of such ``parts``) the
    part of ``full`` it owns; a missing entry is an error naming it."""
    if hasattr(opt, "parts"):  # the expert-parallel trainer's dense + expert optimizers
        for part in opt.parts.values():
            load_full_state(part, full)
        return

    def need(table: str, name: str) -> torch.Tensor:
        if name not in full[table]:
            raise ValueError(f"checkpoint has no optimizer state '{table}.{name}' for this layout")
        return full[table][name]

    def momentum(item) -> torch.Tensor:
        return torch.stack([need("muon", n) for n in item.members])

    with torch.no_grad():
        if isinstance(opt, MuonAdamW):
            items = {f"muon.{it.name}": it for it in opt.items}
            for k, t in opt.state.items():
                kind, name = k.split(".", 1)
                t.copy_(momentum(items[k]) if kind == "muon" else need(kind, name))
        else:
            for i in opt.mine:
                opt.momentum[i].copy_(momentum(opt.items[i]))
            for key, table in (("exp_avg", "m"), ("exp_avg_sq", "v")):
                flat = torch.zeros(opt.G * opt.S, device=opt.device)
                pos = 0
                for n in opt.adam_names:
                    k = opt.params[n].numel()
                    flat[pos:pos + k] = need(table, n).flatten().to(flat.device)
                    pos += k
                getattr(opt, key).copy_(flat[opt.local * opt.S:(opt.local + 1) * opt.S])
    opt.steps = full["steps"]
