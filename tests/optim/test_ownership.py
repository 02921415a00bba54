"""Knapsack ownership: whole items, the cap, near-optimal max load, padding, group-size search."""

import itertools
import random

import pytest

from v4stack.optim.ownership import (OwnershipError, assign, padding_lower_bound, search_group_size)


def brute_force_opt(sizes, g, cap):
    best = None
    for owners in itertools.product(range(g), repeat=len(sizes)):
        counts = [owners.count(r) for r in range(g)]
        if max(counts) > cap:
            continue
        loads = [0] * g
        for s, r in zip(sizes, owners):
            loads[r] += s
        m = max(loads)
        best = m if best is None else min(best, m)
    return best


def test_every_item_once_and_cap_holds():
    rng = random.Random(0)
    sizes = [rng.randint(1, 1000) for _ in range(47)]
    a = assign(sizes, 10, cap=5)
    assert len(a.owners) == 47 and all(0 <= r < 10 for r in a.owners)
    assert sum(a.loads) == sum(sizes)
    assert a.max_count <= 5
    assert sorted(i for r in range(10) for i in a.items_of(r)) == list(range(47))
    full = 10 * max(a.loads)
    assert a.padding == pytest.approx((full - sum(sizes)) / full)


def test_matches_brute_force_on_small_instances():
    rng = random.Random(1)
    exact, worst_ratio = 0, 1.0
    cases = 60
    for _ in range(cases):
        g = rng.choice([2, 3])
        cap = rng.choice([2, 3])
        n = rng.randint(g, min(7, g * cap))
        sizes = [rng.choice([rng.randint(1, 20), rng.randint(50, 100)]) for _ in range(n)]
        opt = brute_force_opt(sizes, g, cap)
        got = assign(sizes, g, cap).max_load
        assert got >= opt
        exact += got == opt
        worst_ratio = max(worst_ratio, got / opt)
    assert worst_ratio <= 4 / 3  # LPT's guarantee, kept under the cap by the local search
    assert exact >= 0.9 * cases


def test_refinement_beats_plain_lpt():
    # LPT puts 3,3 | 2,2,2 -> max 6 ... with (3,3,2,2,2) on 2 ranks the optimum is 6 either way;
    # a case where greedy is off: 8,7,6,5,4 on 2 ranks, cap 3 -> LPT 8+5+4=17 / 7+6=13; optimum 15/15
    a = assign([8, 7, 6, 5, 4], 2, cap=3)
    assert a.max_load == 15
    assert a.padding == 0.0


def test_too_many_matrices_for_the_cap():
    with pytest.raises(OwnershipError, match="group_size >= 3"):
        assign([1] * 11, 2, cap=5)


def test_one_large_matrix_forces_padding_and_replicated_groups_fix_it():
    sizes = [90] + [30] * 7  # mean load at G=8 is 37.5 < 90
    lb = padding_lower_bound(sizes, 8)
    assert lb == pytest.approx(1 - 300 / 720)
    a = assign(sizes, 8)
    assert a.padding >= lb - 1e-12
    choice = search_group_size([sizes], domain=8, cap=5, target=0.10)
    # G=8 and G=4 both pad >= 10% (the 90 dominates); G=2 splits 90+30+30 | 5 x 30 exactly
    assert choice.group_size == 2 and choice.replicated_groups == 4
    assert choice.padding == 0.0 and choice.max_count == 5
    tried = {t["zero_group_size"]: t for t in choice.tried}
    assert tried[8]["padding"] >= lb - 1e-6
    assert tried[4]["padding"] == pytest.approx(1 - 300 / 360, abs=1e-6)
    assert tried[1]["feasible"] is False  # 8 items on one rank break the cap


def test_search_prefers_the_largest_balanced_group():
    sizes = [64] * 40  # equal items: any G dividing 40 balances exactly
    choice = search_group_size([sizes, sizes[:24]], domain=16, cap=5)
    # G=16: 40 items -> 3 on some ranks, 2 on others -> 16.7% padding; G=8: 5 and 3 per rank, exact
    assert choice.group_size == 8 and choice.padding == 0.0 and choice.max_count == 5


def test_search_reports_infeasible_domain():
    with pytest.raises(OwnershipError, match="needing >= 4 ranks"):
        search_group_size([[1] * 18], domain=3, cap=5)


def test_pigeonhole_lower_bound():
    # 5 large items on 4 ranks: some rank holds two, whatever the assignment
    sizes = [10] * 5 + [1] * 10
    lb = padding_lower_bound(sizes, 4)
    assert lb == pytest.approx(1 - 60 / (4 * 20))
    a = assign(sizes, 4, cap=5)
    assert a.max_load >= 20 and a.padding >= lb - 1e-12
    # and the bound is met here: 10+10 | 10+1*5 | 10+1*4... -> the search cannot do better than 20
    assert a.max_load == 20
