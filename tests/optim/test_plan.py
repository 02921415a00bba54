"""`plan muon` on the real V4 matrix lists, built from the presets on the meta device."""

import json

import pytest

from v4stack.config import preset
from v4stack.optim.plan import PlanError, model_items, plan_from_items, plan_muon, stage_blocks


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_default_deployment_meets_the_claim(name):
    cfg = preset(name)
    plan = plan_muon(cfg, preset=name)
    json.dumps(plan)  # the CLI prints it as JSON
    assert plan["padding"] < 0.10
    assert plan["max_matrices_per_rank"] <= 5
    assert plan["meets_claim"]
    for kind in ("dense", "expert"):
        k = plan[kind]
        assert all(k["domain"] % g == 0 for g in k["zero_group_size"])
        assert [k["domain"] // g for g in k["zero_group_size"]] == k["replicated_groups"]
    assert plan["zero_group_size"] == plan["dense"]["zero_group_size"]
    assert len(plan["zero_group_size"]) == plan["pp"]


def test_item_lists_match_the_config():
    cfg = preset("flash")
    items = model_items(cfg)
    blocks = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    experts = [it for it in items if it.expert]
    assert len(experts) == 3 * blocks  # w1, w2, w3 stacks per layer
    assert all(it.k == cfg.n_routed_experts for it in experts)
    w1 = next(it for it in experts if it.name == "layers.5.ffn.experts.*.w1.weight")
    assert (w1.rows, w1.cols) == (cfg.moe_intermediate_size, cfg.hidden_size)
    assert any(it.name == "mtp.0.e_proj.weight" and it.block == cfg.num_hidden_layers for it in items)
    names = {it.name for it in items}
    assert "embed.weight" not in names and "head.weight" not in names


def test_where_the_claim_breaks():
    cfg = preset("pro")
    items = model_items(cfg)
    # power-of-two dp: a 4-block stage holds 52 dense matrices, the cap needs >= 11 ranks, and the
    # divisors of 128 from 11 up are 16, 32, ...: the three big attention projections per block
    # (67M-117M elements, 12 per stage) cannot spread evenly over 16 ranks
    bad = plan_from_items(items, cfg, dp=128, pp=16, ep=16)
    assert bad["feasible"] and not bad["meets_claim"] and bad["padding"] >= 0.10
    # too few data-parallel ranks for the cap: infeasible, with the reason
    small = plan_from_items(items, cfg, dp=8, pp=16, ep=8)
    assert not small["feasible"] and "needing >=" in small["dense"]["reason"]


def test_stage_partition_and_field_errors():
    assert [len(r) for r in stage_blocks(44, 8)] == [6, 6, 6, 6, 5, 5, 5, 5]
    cfg = preset("flash")
    with pytest.raises(PlanError, match="'ep' must divide 'dp'"):
        plan_muon(cfg, dp=96, pp=8, ep=64)
    with pytest.raises(PlanError, match=r"'pp' must be in \[1, 44\]"):
        plan_muon(cfg, dp=96, pp=45, ep=16)
    with pytest.raises(PlanError, match="'dp' must be an integer >= 1"):
        plan_muon(cfg, dp=0, pp=8, ep=16)
