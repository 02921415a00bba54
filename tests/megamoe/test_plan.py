import pytest

from v4stack.megamoe.plan import H200, Hardware, experts_per_wave, overlap_budget, plan_waves


def test_overlap_budget_values():
    assert overlap_budget(3072) == 6144
    assert overlap_budget(2048) == 4096
    assert overlap_budget(3072, dispatch_bytes=2) == 4608
    assert overlap_budget(2048, dispatch_bytes=2, combine_bytes=2) == 3072


@pytest.mark.parametrize("kw, field", [({"expert_width": 0}, "expert_width"),
                                       ({"expert_width": 64, "dispatch_bytes": 0}, "dispatch_bytes"),
                                       ({"expert_width": 64, "combine_bytes": -1}, "combine_bytes")])
def test_overlap_budget_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        overlap_budget(**kw)


def test_one_wave_below_one_token_per_expert():
    # 16 tokens x top-6 over 256 experts: 0.375 rows per expert expected -> everything in one wave
    assert experts_per_wave(16, 6, 256, 32, H200) == 32
    plan = plan_waves([1, 0, 2, 0] * 8, H200, tokens=16, topk=6, n_experts=256, expert_width=2048,
                      ring_tiles=64)
    assert plan.waves == [list(range(32))]


def test_wave_reaches_twice_the_sms():
    # 8192 tokens/rank x EP8, top-6, 256 experts: 1536 rows/expert = 12 tiles -> ceil(264/12) = 22
    tokens = 8192 * 8
    assert experts_per_wave(tokens, 6, 256, 32, H200) == 22
    plan = plan_waves([1536] * 32, H200, tokens=tokens, topk=6, n_experts=256, expert_width=2048,
                      ring_tiles=1024)
    assert [len(w) for w in plan.waves] == [22, 10]
    assert plan.tiles == [22 * 12, 10 * 12]
    assert plan.tiles[0] >= 2 * H200.compute_units


def test_ring_caps_a_wave_and_a_big_expert_stands_alone():
    hw = Hardware(peak_flops=1e12, link_bytes_per_s=1e10, compute_units=64, block_m=4)
    # many tiles wanted per wave, but the ring holds 8 tiles -> at most 4 per wave
    plan = plan_waves([4, 4, 4, 4, 4, 40, 0, 4], hw, tokens=64, topk=2, n_experts=8, expert_width=32,
                      ring_tiles=8)
    assert plan.waves == [[0, 1, 2, 3], [4], [5], [6, 7]]
    assert plan.tiles == [4, 1, 10, 1]
    assert sorted(e for w in plan.waves for e in w) == list(range(8))


def test_comm_hidden_flag():
    plan = plan_waves([8] * 4, H200, tokens=64, topk=2, n_experts=16, expert_width=3072, ring_tiles=8,
                      dispatch_bytes=1, combine_bytes=2)
    assert plan.flops_per_byte_offered == 6144
    assert plan.comm_hidden  # 989e12 / 450e9 ~ 2198 FLOP/byte < 6144
    slow_link = Hardware(peak_flops=989e12, link_bytes_per_s=25e9, compute_units=132)
    assert not plan_waves([8] * 4, slow_link, tokens=64, topk=2, n_experts=16, expert_width=3072,
                          ring_tiles=8).comm_hidden


def test_planner_errors_name_the_field():
    with pytest.raises(ValueError, match="ring_tiles"):
        plan_waves([1], H200, tokens=1, topk=1, n_experts=1, expert_width=8, ring_tiles=1)
    with pytest.raises(ValueError, match="compute_units"):
        plan_waves([1], Hardware(1e12, 1e9, 0), tokens=1, topk=1, n_experts=1, expert_width=8, ring_tiles=4)
