import json

import pytest

from v4stack.config import ConfigError, ModelConfig, preset


@pytest.mark.parametrize("name", ["tiny", "flash", "pro"])
def test_presets_round_trip_through_config_json(tmp_path, name):
    cfg = preset(name)
    path = cfg.save(tmp_path)
    raw = json.loads(path.read_text())
    for key in ("compress_ratios", "hc_mult", "index_topk", "n_routed_experts", "num_experts_per_tok",
                "sliding_window", "o_groups", "o_lora_rank", "q_lora_rank", "rope_scaling"):
        assert key in raw
    assert ModelConfig.load(tmp_path) == cfg


def test_tiny_keeps_every_mechanism_alive():
    cfg = preset("tiny")
    ratios = cfg.layer_ratios
    assert 0 in ratios and any(cfg.is_csa(r) for r in ratios) and any(r and not cfg.is_csa(r) for r in ratios)
    assert (cfg.sliding_window, cfg.csa_ratio, cfg.block_tokens) == (16, 4, 16)
    assert 0 < cfg.num_hash_layers < cfg.num_hidden_layers and cfg.n_shared_experts == 1
    assert cfg.num_nextn_predict_layers == 1


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size", 0, "'hidden_size' must be a positive integer"),
    ("compress_ratios", [0, 4], "'compress_ratios' must list"),
    ("o_groups", 3, "'o_groups' \\(3\\) must divide"),
    ("num_experts_per_tok", 999, "'num_experts_per_tok'"),
    ("model_type", "llama", "'model_type' must be 'deepseek_v4'"),
])
def test_bad_fields_are_named(field, value, match):
    raw = preset("tiny").to_dict()
    raw[field] = value
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_unknown_preset_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.load(tmp_path)
