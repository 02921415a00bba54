"""Safetensors round trip under the official names; every mismatch is a clear, named error."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from v4stack.model import V4Model
from v4stack.model.weights import WeightsError, load_model, save_model

from .conftest import tokens


@pytest.fixture
def saved(tmp_path, tiny_cfg):
    model = V4Model(tiny_cfg, seed=5).eval()
    save_model(model, tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


@torch.no_grad()
def test_round_trip_gives_identical_logits(saved):
    model, path = saved
    fresh = load_model(path).eval()
    t = tokens(30, seed=2)
    assert torch.equal(model(t), fresh(t))
    assert not list(path.glob(".*tmp"))  # nothing half-written left behind


def test_official_names(saved, tiny_cfg):
    _, path = saved
    names = set(load_file(str(path / "model.safetensors")))
    for n in ("embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.0.attn.wq_a.weight",
              "layers.0.attn.attn_sink", "layers.0.hc_attn_fn", "layers.0.hc_ffn_scale",
              "layers.0.ffn.gate.tid2eid", "layers.3.ffn.gate.bias", "layers.2.attn.compressor.ape",
              "layers.2.attn.indexer.wq_b.weight", "layers.2.attn.indexer.compressor.wkv.weight",
              "layers.3.attn.compressor.wgate.weight", "layers.1.ffn.experts.7.w3.weight",
              "layers.1.ffn.shared_experts.w2.weight", "mtp.0.e_proj.weight", "mtp.0.hc_head_base"):
        assert n in names, n
    assert "layers.3.attn.indexer.wq_b.weight" not in names  # HCA layers have no indexer


def _rewrite(path, fn):
    f = str(path / "model.safetensors")
    t = load_file(f)
    fn(t)
    save_file(t, f, metadata={"format": "pt"})


def test_missing_tensor_is_named(saved):
    _, path = saved
    _rewrite(path, lambda t: t.pop("layers.2.attn.compressor.ape"))
    with pytest.raises(WeightsError, match=r"missing tensors: layers\.2\.attn\.compressor\.ape"):
        load_model(path)


def test_extra_tensor_is_named(saved):
    _, path = saved
    _rewrite(path, lambda t: t.__setitem__("layers.9.attn.bogus", torch.zeros(2)))
    with pytest.raises(WeightsError, match=r"unexpected tensors: layers\.9\.attn\.bogus"):
        load_model(path)


def test_misshaped_tensor_is_named(saved):
    _, path = saved
    _rewrite(path, lambda t: t.__setitem__("head.weight", torch.zeros(3, 3)))
    with pytest.raises(WeightsError, match=r"'head\.weight' has shape \(3, 3\), expected \(256, 64\)"):
        load_model(path)


def test_quantised_tensor_is_refused(saved):
    _, path = saved
    _rewrite(path, lambda t: t.__setitem__("layers.0.attn.wkv.weight",
                                           t["layers.0.attn.wkv.weight"].to(torch.float8_e4m3fn)))
    with pytest.raises(WeightsError, match=r"'layers\.0\.attn\.wkv\.weight' is quantised"):
        load_model(path)


def test_flipped_byte_is_detected_by_name(saved):
    _, path = saved
    f = path / "model.safetensors"
    raw = bytearray(f.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    start, _ = header["norm.weight"]["data_offsets"]
    raw[8 + header_len + start + 1] ^= 0x40
    f.write_bytes(bytes(raw))
    with pytest.raises(WeightsError, match=r"'norm\.weight' .* corrupt"):
        load_model(path)


def test_truncated_file_is_a_clear_error(saved):
    _, path = saved
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(WeightsError, match="not a readable safetensors file"):
        load_model(path)
