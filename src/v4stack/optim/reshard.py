"""Optimizer state independent of how it was sharded, so a run can resume on another rank count.

The full state is ``{"steps", "muon": {item: momentum}, "m": {param: exp_avg}, "v": {param:
exp_avg_sq}}``: what one ``MuonAdamW`` holds, by name. ``full_state`` builds it from a
checkpoint's shards (one process's ``MuonAdamW`` state, or the ``ZeroMuonAdamW`` shards of every
rank, pipeline stages included), and ``load_full_state`` gives an optimizer of any layout the part
it owns. What cannot carry over: the stochastic-rounding generators are per rank, so a resharded
run draws new rounding noise (with rounding off, nothing random remains).
"""

from __future__ import annotations

import torch

from v4stack.optim.hybrid import MuonAdamW
from v4stack.optim.zero import ZeroMuonAdamW


def full_state(shards: list[dict]) -> dict:
    """Merge optimizer states saved by every rank (any mix of layouts) into the full state."""
    out: dict = {"steps": None, "muon": {}, "m": {}, "v": {}}
    by_group: dict[tuple, dict[int, dict]] = {}
    for sd in shards:
        _steps(out, sd["steps"])
        if "state" in sd:  # MuonAdamW
            for k, v in sd["state"].items():
                kind, name = k.split(".", 1)
                out[{"muon": "muon", "m": "m", "v": "v"}[kind]][name] = v
            continue
        for name, mom in sd["momentum"].items():
            out["muon"][name] = mom
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


def load_full_state(opt: MuonAdamW | ZeroMuonAdamW, full: dict) -> None:
    """Give ``opt`` the part of ``full`` it owns; a missing entry is an error naming it."""
    def need(table: str, name: str) -> torch.Tensor:
        if name not in full[table]:
            raise ValueError(f"checkpoint has no optimizer state '{table}.{name}' for this layout")
        return full[table][name]

    with torch.no_grad():
        if isinstance(opt, MuonAdamW):
            for k, t in opt.state.items():
                kind, name = k.split(".", 1)
                t.copy_(need(kind, name))
        else:
            for i in opt.mine:
                opt.momentum[i].copy_(need("muon", opt.items[i].name))
            for key, table in (("exp_avg", "m"), ("exp_avg_sq", "v")):
                flat = torch.zeros(opt.G * opt.S, device=opt.device)
                pos = 0
                for n in opt.adam_names:
                    k = opt.params[n].numel()
                    flat[pos:pos + k] = need(table, n).flatten().to(flat.device)
                    pos += k
                getattr(opt, key).copy_(flat[opt.local * opt.S:(opt.local + 1) * opt.S])
    opt.steps = full["steps"]
