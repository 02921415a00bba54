"""`v4stack plan muon`: the ownership plan of a real V4 matrix list over a deployment.

Deployment model (V3/V4 style, no tensor parallelism): ``dp * pp`` ranks; each pipeline stage holds
a contiguous run of blocks (main layers, then the MTP block on the last stage) and is replicated
over ``dp`` data-parallel ranks; expert parallelism runs inside those ``dp`` ranks, each holding
``E / ep`` routed experts of every layer of its stage.

Two kinds of ZeRO group per stage, each planned by the knapsack:

- dense matrices (attention, compressor, indexer, router gate, shared expert, MTP projections)
  are on all ``dp`` ranks of the stage: domain ``dp``;
- expert stacks (one item per layer and projection type: the stage's ``E / ep`` local experts'
  w1, w2 or w3) are on the ``dp / ep`` ranks holding the same expert shard: domain ``dp / ep``.

Each stage's ranks are distinct processes, so each stage and kind searches its own group size;
``zero_group_size`` / ``replicated_groups`` are per-stage lists (dense kind at the top level, the
expert kind under ``expert``); ``padding`` and ``max_matrices_per_rank`` are the worst over every
group of the plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from v4stack.config import ModelConfig
from v4stack.optim.ownership import (DEFAULT_CAP, DEFAULT_TARGET, OwnershipError, padding_lower_bound,
                                     search_group_size)
from v4stack.optim.split import Item, muon_items, split_params

# the default deployment: see docs/training.md for why
DEFAULTS = {"flash": {"dp": 96, "pp": 8, "ep": 16}, "pro": {"dp": 144, "pp": 16, "ep": 16},
            "tiny": {"dp": 4, "pp": 1, "ep": 2}}
DEFAULT_FALLBACK = {"dp": 96, "pp": 8, "ep": 16}

_BLOCK = re.compile(r"^(layers|mtp)\.(\d+)\.")


class PlanError(ValueError):
    """A deployment field is out of range for this model."""


@dataclass(frozen=True)
class PlanItem:
    name: str
    block: int  # main layer index, or num_hidden_layers + j for mtp.j
    expert: bool
    k: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.k * self.rows * self.cols


def model_items(cfg: ModelConfig) -> list[PlanItem]:
    """The Muon items of the V4 network built from ``cfg`` on the meta device."""
    return list(_model_items_cached(_cfg_key(cfg)))


def _cfg_key(cfg: ModelConfig) -> str:
    import json

    return json.dumps(cfg.to_dict(), sort_keys=True)


@lru_cache(maxsize=8)
def _model_items_cached(key: str) -> tuple[PlanItem, ...]:
    import json

    import torch

    from v4stack.model import V4Model

    cfg = ModelConfig.from_dict(json.loads(key))
    with torch.device("meta"):
        model = V4Model(cfg, seed=None)
    split = split_params((n, p.shape) for n, p in model.named_parameters())
    return tuple(_plan_item(it, cfg) for it in muon_items(split.muon))


def _plan_item(it: Item, cfg: ModelConfig) -> PlanItem:
    m = _BLOCK.match(it.name)
    if not m:
        raise PlanError(f"Muon matrix {it.name} belongs to no block")
    block = int(m[2]) + (cfg.num_hidden_layers if m[1] == "mtp" else 0)
    expert = ".experts." in it.name and ".shared_experts." not in it.name
    return PlanItem(it.name, block, expert, it.k, it.shape[0], it.shape[1])


def stage_blocks(n_blocks: int, pp: int) -> list[range]:
    """Contiguous, near-equal runs of blocks; the earlier stages take the remainder."""
    base, extra = divmod(n_blocks, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def _check(cfg: ModelConfig, dp: int, pp: int, ep: int) -> int:
    n_blocks = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    for name, v in (("dp", dp), ("pp", pp), ("ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise PlanError(f"'{name}' must be an integer >= 1, got {v!r}")
    if pp > n_blocks:
        raise PlanError(f"'pp' must be in [1, {n_blocks}] (one block per stage at most), got {pp}")
    if dp % ep:
        raise PlanError(f"'ep' must divide 'dp' (experts are sharded inside the data-parallel ranks); "
                        f"got dp={dp}, ep={ep}")
    if cfg.n_routed_experts % ep:
        raise PlanError(f"'ep' must divide n_routed_experts={cfg.n_routed_experts}, got {ep}")
    return n_blocks


def plan_from_items(items: list[PlanItem], cfg: ModelConfig, dp: int, pp: int, ep: int,
                    cap: int = DEFAULT_CAP, target: float = DEFAULT_TARGET) -> dict:
    n_blocks = _check(cfg, dp, pp, ep)
    stages = stage_blocks(n_blocks, pp)
    dense = [[it.numel for it in items if not it.expert and it.block in r] for r in stages]
    expert = [[it.numel // ep for it in items if it.expert and it.block in r] for r in stages]
    out = {"dp": dp, "pp": pp, "ep": ep, "ranks": dp * pp, "cap": cap, "target_padding": target}
    kinds = {kind: _plan_kind(lists, domain, cap, target)
             for kind, lists, domain in (("dense", dense, dp), ("expert", expert, dp // ep))}
    feasible = all(k["feasible"] for k in kinds.values())
    out["feasible"] = feasible
    out["zero_group_size"] = kinds["dense"].get("zero_group_size")
    out["replicated_groups"] = kinds["dense"].get("replicated_groups")
    out["padding"] = max(k["padding"] for k in kinds.values()) if feasible else None
    out["max_matrices_per_rank"] = max(k["max_matrices_per_rank"] for k in kinds.values()) if feasible else None
    out["meets_claim"] = bool(feasible and out["padding"] < target and out["max_matrices_per_rank"] <= cap)
    out["dense"], out["expert"] = kinds["dense"], kinds["expert"]
    out["stage_blocks"] = [[r.start, r.stop] for r in stages]
    return out


def _plan_kind(lists: list[list[int]], domain: int, cap: int, target: float) -> dict:
    """Each stage's ranks are distinct processes, so each stage searches its own group size."""
    choices = []
    for sizes in lists:
        try:
            choices.append(search_group_size([sizes], domain, cap, target))
        except OwnershipError as e:
            return {"feasible": False, "reason": str(e), "domain": domain,
                    "max_items_per_stage": max(len(l) for l in lists)}
    return {
        "feasible": True, "domain": domain,
        "zero_group_size": [c.group_size for c in choices],
        "replicated_groups": [c.replicated_groups for c in choices],
        "padding": round(max(c.padding for c in choices), 6),
        "max_matrices_per_rank": max(c.max_count for c in choices),
        "max_items_per_stage": max(len(l) for l in lists),
        "stage_padding": [round(c.padding, 6) for c in choices],
        "stage_lower_bound": [round(padding_lower_bound(sizes, c.group_size), 6)
                              for sizes, c in zip(lists, choices)],
        "tried": [c.tried for c in choices],
    }


def plan_muon(cfg: ModelConfig, dp: int | None = None, pp: int | None = None, ep: int | None = None,
              preset: str | None = None, cap: int = DEFAULT_CAP, target: float = DEFAULT_TARGET) -> dict:
    """The plan for ``cfg`` over (dp, pp, ep); unset values take the preset's default deployment."""
    d = DEFAULTS.get(preset or "", DEFAULT_FALLBACK)
    dp = d["dp"] if dp is None else dp
    pp = d["pp"] if pp is None else pp
    ep = d["ep"] if ep is None else ep
    _check(cfg, dp, pp, ep)
    out = plan_from_items(model_items(cfg), cfg, dp, pp, ep, cap, target)
    if preset:
        out = {"preset": preset, **out}
    return out


def format_plan(plan: dict) -> str:
    """Human-readable lines for the CLI."""
    lines = [f"deployment       dp={plan['dp']} pp={plan['pp']} ep={plan['ep']} ({plan['ranks']} ranks)"]
    for kind in ("dense", "expert"):
        k = plan[kind]
        if not k["feasible"]:
            lines.append(f"{kind:<17}infeasible: {k['reason']}")
            continue
        sizes = "/".join(str(g) for g in sorted(set(k["zero_group_size"])))
        lines.append(f"{kind:<17}ZeRO groups of {sizes} ranks (domain {k['domain']}), "
                     f"padding {100 * k['padding']:.2f}%, <= {k['max_matrices_per_rank']} matrices per rank "
                     f"({k['max_items_per_stage']} items in the largest stage)")
    if plan["feasible"]:
        verdict = "meets" if plan["meets_claim"] else "misses"
        lines.append(f"worst            padding {100 * plan['padding']:.2f}%, "
                     f"{plan['max_matrices_per_rank']} matrices per rank: {verdict} the < "
                     f"{100 * plan['target_padding']:.0f}% / <= {plan['cap']} claim")
    return "\n".join(lines)
