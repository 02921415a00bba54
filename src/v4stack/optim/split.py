"""Which optimizer takes which parameter, and how Muon's matrices group into ownership items.

Muon takes the 2-D weights of linear layers: attention projections (wq_a, wq_b, wkv, wo_a, wo_b),
the router gate, routed and shared experts (w1, w2, w3), compressor and indexer projections (wkv,
wgate, wq_b, weights_proj) and MTP's e_proj / h_proj. AdamW takes the rest: embedding, output head,
every RMSNorm weight, the mHC static biases / gates / scales (hc_*), attention sinks, the
compressors' ape, and the gate bias.

An *item* is the unit of ZeRO ownership and of orthogonalisation traffic: a plain matrix, or all
experts' matrices of one projection type in one layer stacked as [E, n, m] (each expert is still
orthogonalised on its own; the stack is never cut inside one expert's matrix).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MUON_LINEARS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "wgate", "weights_proj", "gate",
                "w1", "w2", "w3", "e_proj", "h_proj")
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>w[123])\.weight$")


def muon_reason(name: str, shape: tuple[int, ...]) -> str | None:
    """Why ``name`` goes to Muon, or None when it goes to AdamW."""
    parts = name.split(".")
    if len(shape) == 2 and len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in MUON_LINEARS:
        return f"2-D linear weight ({parts[-2]})"
    return None


def adamw_reason(name: str, shape: tuple[int, ...]) -> str:
    last = name.split(".")[-2:] if "." in name else [name]
    leaf = name.split(".")[-1]
    if name.startswith("embed."):
        return "embedding"
    if name.startswith("head.") or name == "head.weight":
        return "output head"
    if "norm" in ".".join(last):
        return "RMSNorm weight"
    if leaf.startswith("hc_") or (len(last) > 1 and last[0].startswith("hc_")):
        return "mHC static bias / gate"
    if leaf == "attn_sink":
        return "attention sink"
    if leaf == "ape":
        return "compressor position bias (ape)"
    if leaf == "bias":
        return "bias"
    return f"not a 2-D linear weight (shape {tuple(shape)})"


@dataclass(frozen=True)
class Item:
    """One ownership unit: ``members`` (parameter names) share ``shape`` and stack to [k, n, m]."""

    name: str
    members: tuple[str, ...]
    shape: tuple[int, int]

    @property
    def k(self) -> int:
        return len(self.members)

    @property
    def numel(self) -> int:
        return self.k * self.shape[0] * self.shape[1]

    @property
    def stacked(self) -> bool:
        return self.k > 1 or ".experts.*." in self.name


@dataclass
class ParamSplit:
    muon: dict[str, tuple[int, ...]] = field(default_factory=dict)
    adamw: dict[str, tuple[int, ...]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """A printable table: optimizer, parameter, shape, reason; then the totals."""
        lines = []
        for opt, group in (("muon", self.muon), ("adamw", self.adamw)):
            for name, shape in group.items():
                lines.append(f"{opt:<6}{name:<56}{str(tuple(shape)):<22}{self.reasons[name]}")
        nm = sum(_numel(s) for s in self.muon.values())
        na = sum(_numel(s) for s in self.adamw.values())
        lines.append(f"muon: {len(self.muon)} tensors, {nm:,} params; adamw: {len(self.adamw)} tensors, {na:,} params")
        return "\n".join(lines)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def split_params(named_shapes) -> ParamSplit:
    """``named_shapes``: iterable of (name, shape) or (name, tensor). Order is kept."""
    out = ParamSplit()
    for name, t in named_shapes:
        shape = tuple(t.shape) if hasattr(t, "shape") else tuple(t)
        why = muon_reason(name, shape)
        if why is not None:
            out.muon[name] = shape
            out.reasons[name] = why
        else:
            out.adamw[name] = shape
            out.reasons[name] = adamw_reason(name, shape)
    return out


def muon_items(muon: dict[str, tuple[int, ...]]) -> list[Item]:
    """Group Muon matrices into items: experts of one layer and projection stack into one item."""
    stacks: dict[str, list[tuple[int, str]]] = {}
    order: list[str] = []
    singles: dict[str, Item] = {}
    for name, shape in muon.items():
        m = _EXPERT.match(name)
        if m:
            key = f"{m['prefix']}.*.{m['proj']}.weight"
            if key not in stacks:
                stacks[key] = []
                order.append(key)
            stacks[key].append((int(m["e"]), name))
        else:
            singles[name] = Item(name, (name,), (int(shape[0]), int(shape[1])))
            order.append(name)
    items = []
    for key in order:
        if key in singles:
            items.append(singles[key])
            continue
        members = tuple(n for _, n in sorted(stacks[key]))
        shapes = {tuple(muon[n]) for n in members}
        if len(shapes) != 1:
            raise ValueError(f"expert stack {key} mixes shapes {sorted(shapes)}; one item needs one shape")
        (shape,) = shapes
        items.append(Item(key, members, (int(shape[0]), int(shape[1]))))
    return items
