"""Knapsack ownership: whole matrices to the ranks of a ZeRO group, at most ``cap`` per rank.

Muon orthogonalises a whole matrix, so a matrix cannot be cut element-wise across ranks as AdamW
state is. Each matrix (or expert stack) is owned by one rank of its ZeRO group; gradients travel
to the owner in one all-to-all whose per-peer buffer is uniform, so every rank's buffer is as
large as the most loaded rank's share. The waste is

    padding = (G * max_load - total) / (G * max_load)

The problem is multiway number partitioning with a cardinality cap (NP-hard). ``assign`` runs
longest-processing-time first under the cap, then a local search (moves and swaps out of the most
loaded rank) until no move lowers the maximum. Lower bound: max(largest item, total / G,
(k + 1) * the (kG + 1)-th largest), so a single matrix larger than the mean load forces padding of
at least 1 - total / (G * largest), and G + 1 large matrices force a rank to hold two; the group
size is therefore part of the plan. ``search_group_size`` tries every group size G that
divides the data-parallel domain D (the rest is covered by D / G replicated groups) and keeps the
largest G whose padding meets the target - the largest G because optimizer state per rank falls
with G.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

DEFAULT_CAP = 5
DEFAULT_TARGET = 0.10


class OwnershipError(ValueError):
    """The items cannot be placed under the given group size and cap."""


@dataclass
class Assignment:
    group_size: int
    cap: int
    sizes: list[int]
    owners: list[int]
    loads: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.loads = [0] * self.group_size
        self.counts = [0] * self.group_size
        for s, r in zip(self.sizes, self.owners):
            self.loads[r] += s
            self.counts[r] += 1

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def max_load(self) -> int:
        return max(self.loads)

    @property
    def max_count(self) -> int:
        return max(self.counts)

    @property
    def padding(self) -> float:
        full = self.group_size * self.max_load
        return (full - self.total) / full if full else 0.0

    def items_of(self, rank: int) -> list[int]:
        return [i for i, r in enumerate(self.owners) if r == rank]

    def summary(self) -> dict:
        return {"zero_group_size": self.group_size, "padding": round(self.padding, 6),
                "max_matrices_per_rank": self.max_count, "max_load": self.max_load,
                "mean_load": self.total / self.group_size, "items": len(self.sizes),
                "lower_bound_padding": round(padding_lower_bound(self.sizes, self.group_size), 6)}


def padding_lower_bound(sizes: list[int], group_size: int) -> float:
    """Padding no assignment can beat. The max load is at least the mean, the largest item, and,
    by pigeonhole, (k + 1) times the (k * G + 1)-th largest item: of the k * G + 1 largest items
    some rank holds k + 1."""
    total = sum(sizes)
    if not total:
        return 0.0
    desc = sorted(sizes, reverse=True)
    lb = max(desc[0], math.ceil(total / group_size))
    k = 1
    while k * group_size < len(desc):
        lb = max(lb, (k + 1) * desc[k * group_size])
        k += 1
    return (group_size * lb - total) / (group_size * lb)


def assign(sizes: list[int], group_size: int, cap: int = DEFAULT_CAP, max_rounds: int | None = None) -> Assignment:
    """Place every item on one of ``group_size`` ranks, <= ``cap`` items each, minimising the max load."""
    n = len(sizes)
    if group_size < 1:
        raise OwnershipError(f"group_size must be >= 1, got {group_size}")
    if cap < 1:
        raise OwnershipError(f"cap must be >= 1, got {cap}")
    if n > cap * group_size:
        raise OwnershipError(f"{n} matrices cannot fit {group_size} ranks at <= {cap} each "
                             f"(need group_size >= {math.ceil(n / cap)})")
    owners = [0] * n
    loads = [0] * group_size
    counts = [0] * group_size
    heap = [(0, r) for r in range(group_size)]
    for i in sorted(range(n), key=lambda i: (-sizes[i], i)):
        load, r = heapq.heappop(heap)
        owners[i] = r
        loads[r] = load + sizes[i]
        counts[r] += 1
        if counts[r] < cap:
            heapq.heappush(heap, (loads[r], r))
    _refine(sizes, owners, loads, counts, cap, max_rounds if max_rounds is not None else 20 * n + 100)
    return Assignment(group_size, cap, list(sizes), owners)


def _refine(sizes, owners, loads, counts, cap, max_rounds) -> None:
    """Local search: move or swap an item out of the most loaded rank while that lowers it."""
    members: list[list[int]] = [[] for _ in loads]
    for i, r in enumerate(owners):
        members[r].append(i)
    for _ in range(max_rounds):
        a = max(range(len(loads)), key=lambda r: (loads[r], -r))
        top = loads[a]
        best = None  # (new pair max, kind, x, b, y)
        for b in range(len(loads)):
            if b == a or loads[b] >= top:
                continue
            for x in members[a]:
                sx = sizes[x]
                if counts[b] < cap and loads[b] + sx < top:
                    cand = (max(top - sx, loads[b] + sx), 0, x, b, -1)
                    if best is None or cand < best:
                        best = cand
                for y in members[b]:
                    d = sx - sizes[y]
                    if d > 0 and loads[b] + d < top:
                        cand = (max(top - d, loads[b] + d), 1, x, b, y)
                        if best is None or cand < best:
                            best = cand
        if best is None:
            return
        _, kind, x, b, y = best
        members[a].remove(x)
        members[b].append(x)
        owners[x] = b
        loads[a] -= sizes[x]
        loads[b] += sizes[x]
        if kind == 0:
            counts[a] -= 1
            counts[b] += 1
        else:
            members[b].remove(y)
            members[a].append(y)
            owners[y] = a
            loads[a] += sizes[y]
            loads[b] -= sizes[y]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class GroupChoice:
    """The chosen ZeRO group size for a domain of ``domain`` ranks, and every size tried."""

    domain: int
    assignments: list[Assignment]  # one per item list (e.g. per pipeline stage), at the chosen size
    tried: list[dict]

    @property
    def group_size(self) -> int:
        return self.assignments[0].group_size if self.assignments else 0

    @property
    def replicated_groups(self) -> int:
        return self.domain // self.group_size if self.group_size else 0

    @property
    def padding(self) -> float:
        return max((a.padding for a in self.assignments), default=0.0)

    @property
    def max_count(self) -> int:
        return max((a.max_count for a in self.assignments), default=0)


def search_group_size(item_lists: list[list[int]], domain: int, cap: int = DEFAULT_CAP,
                      target: float = DEFAULT_TARGET) -> GroupChoice:
    """One group size G for several item lists that share a domain size (e.g. the pipeline stages).

    Tries every G dividing ``domain`` that fits the cap for every list, largest first, and keeps the
    first whose worst padding is below ``target``; when none is, the G with the least worst padding.
    """
    if domain < 1:
        raise OwnershipError(f"data-parallel domain must be >= 1 rank, got {domain}")
    lists = [l for l in item_lists if l]
    if not lists:
        return GroupChoice(domain, [], [])
    need = max(math.ceil(len(l) / cap) for l in lists)
    tried, best, chosen = [], None, None
    for g in sorted(divisors(domain), reverse=True):
        if g < need:
            tried.append({"zero_group_size": g, "feasible": False,
                          "reason": f"more than {cap} matrices per rank"})
            continue
        assigns = [assign(l, g, cap) for l in lists]
        worst = max(a.padding for a in assigns)
        tried.append({"zero_group_size": g, "feasible": True, "padding": round(worst, 6),
                      "max_matrices_per_rank": max(a.max_count for a in assigns)})
        if chosen is None and worst < target:
            chosen = assigns
        if best is None or worst < max(a.padding for a in best):
            best = assigns
    if chosen is None:
        chosen = best
    if chosen is None:
        raise OwnershipError(f"no ZeRO group size fits: the largest list has {max(len(l) for l in lists)} "
                             f"matrices, needing >= {need} ranks at <= {cap} each, but the domain has {domain}")
    return GroupChoice(domain, chosen, tried)
