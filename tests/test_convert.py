"""A synthetic checkpoint in the released layout (tiny dims, FP8 / FP4 tensors with e8m0 block
scales, three shards) converts, loads and gives the logits of its dequantised fp32 reference; the
conversion round trip is byte-identical; bad files fail naming the tensor."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from v4stack.cli import app
from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.model.released import export_released, to_project
from v4stack.model.weights import WeightsError, load_model, read_tensors

E4M3 = {c: ((c & 7) / 8 * 2.0 ** -6 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7)) for c in range(127)}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _decode(name, t, tensors):
    """Independent dequantisation, from the bytes, in float64."""
    scale = tensors.get(name[:-7] + ".scale")
    if scale is None:
        return t.to(torch.float64)
    s = torch.pow(2.0, scale.view(torch.uint8).to(torch.float64) - 127)
    b = t.view(torch.uint8).to(torch.int64)
    if t.dtype == torch.float8_e4m3fn:
        mag = torch.tensor([E4M3[c] for c in range(127)] + [float("nan")], dtype=torch.float64)[b & 127]
        v = torch.where(b >= 128, -mag, mag)
        return v * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: v.shape[0], : v.shape[1]]
    lut = torch.tensor(E2M1 + [-x for x in E2M1], dtype=torch.float64)
    v = torch.stack((lut[b & 15], lut[b >> 4]), -1).view(t.shape[0], -1)
    return v * s.repeat_interleave(v.shape[1] // s.shape[1], 1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model = V4Model(preset("tiny"), seed=11).eval()
    export_released(model, root / "released", shards=3)
    return root


def _copy(ckpt, tmp_path):
    dst = tmp_path / "rel"
    shutil.copytree(ckpt / "released", dst)
    return dst


def test_released_layout_has_scaled_fp8_fp4_tensors_in_shards(ckpt):
    rel = ckpt / "released"
    index = json.loads((rel / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    t = read_tensors(rel)
    assert t["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert t["layers.0.ffn.experts.3.w2.weight"].dtype == torch.int8
    assert t["layers.0.ffn.experts.3.w2.weight"].shape == (64, 16) and t["layers.0.ffn.experts.3.w2.scale"].shape == (64, 1)
    assert t["embed.weight"].dtype == torch.bfloat16 and t["layers.0.hc_attn_fn"].dtype == torch.float32
    assert "quantization_config" in json.loads((rel / "config.json").read_text())
    with pytest.raises(WeightsError, match="released layout; run `v4stack convert"):
        load_model(rel)


@torch.no_grad()
def test_converts_loads_and_equals_the_dequantised_reference(ckpt, tmp_path):
    """Tolerance: 0. An e4m3 (4 significant bits) or e2m1 (2 bits) value times a power-of-two
    e8m0 scale is exact in fp32, and bf16 widens exactly, so the loaded weights equal the
    reference's bit for bit and the same ops give the same logits."""
    proj = to_project(ckpt / "released", tmp_path / "proj")
    model = load_model(proj).eval()
    assert model.act_rounding  # on by default for a quantised checkpoint
    quant = [m for m in model.modules() if getattr(m, "qweight", None) is not None]
    assert {m.qweight.fmt for m in quant} == {"fp8", "fp4"} and len(quant) == 226
    raw = read_tensors(ckpt / "released")
    ref = V4Model(preset("tiny"), seed=None)
    ref.load_state_dict({n: _decode(n, t, raw).to(torch.float32) if t.is_floating_point() or t.dtype == torch.int8 and
                         n.endswith(".weight") else t for n, t in raw.items() if not n.endswith(".scale")})
    from v4stack.model.quant import set_act_rounding

    set_act_rounding(ref.eval(), True)
    tok = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(tok), ref(tok))
    # control: one scale byte off (x2 on one block) moves the logits
    q = next(m for m in quant if m.qweight.fmt == "fp8")
    q.qweight.scale.view(torch.uint8)[0, 0] += 1
    q.qweight._dense.clear()
    assert not torch.equal(model(tok), ref(tok))


def test_round_trip_is_byte_identical_through_the_cli(ckpt, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["convert", str(ckpt / "released"), str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["convert", str(tmp_path / "p"), str(tmp_path / "back")])
    assert r.exit_code == 0, r.output
    files = sorted(f.name for f in (ckpt / "released").iterdir())
    assert files == sorted(f.name for f in (tmp_path / "back").iterdir()) and len(files) == 5
    for f in files:
        assert (ckpt / "released" / f).read_bytes() == (tmp_path / "back" / f).read_bytes(), f
    r = runner.invoke(app, ["convert", str(ckpt / "released"), str(tmp_path / "p")])
    assert r.exit_code == 2 and "already exists" in r.output


def _rewrite(rel, name, fn):
    index = json.loads((rel / "model.safetensors.index.json").read_text())
    shard = rel / index["weight_map"][name]
    with safe_open(str(shard), framework="pt") as h:
        t = {k: h.get_tensor(k) for k in h.keys()}
    fn(t)
    save_file(t, str(shard), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in t or v != shard.name}
    (rel / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_scale_is_named(ckpt, tmp_path):
    rel = _copy(ckpt, tmp_path)
    _rewrite(rel, "layers.1.attn.wo_b.scale", lambda t: t.pop("layers.1.attn.wo_b.scale"))
    with pytest.raises(WeightsError, match=r"'layers\.1\.attn\.wo_b\.weight' .*scale 'layers\.1\.attn\.wo_b\.scale' is missing"):
        to_project(rel, tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_wrong_block_shape_is_named(ckpt, tmp_path):
    rel = _copy(ckpt, tmp_path)
    name = "layers.2.ffn.experts.5.w1.scale"
    _rewrite(rel, name, lambda t: t.__setitem__(name, t[name][:, :1].repeat(1, 4).contiguous()))
    with pytest.raises(WeightsError, match=r"scale of 'layers\.2\.ffn\.experts\.5\.w1\.weight' has shape \(32, 4\)"):
        to_project(rel, tmp_path / "p")


def test_truncated_shard_is_named(ckpt, tmp_path):
    rel = _copy(ckpt, tmp_path)
    shard = rel / "model-00002-of-00003.safetensors"
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    shard.write_bytes(raw[:-3])
    with pytest.raises(WeightsError, match=rf"tensor '{last}' in model-00002-of-00003\.safetensors is cut short"):
        to_project(rel, tmp_path / "p")


def test_round_trip_keeps_a_foreign_writers_header_bytes(ckpt, tmp_path):
    """Another writer's header (its own key order and spacing) comes back byte for byte."""
    from v4stack.model.released import to_released

    rel = _copy(ckpt, tmp_path)
    shard = rel / "model-00001-of-00003.safetensors"
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    foreign = json.dumps(dict(reversed(list(header.items()))), indent=1).encode()
    foreign += b" " * (-len(foreign) % 8)
    shard.write_bytes(len(foreign).to_bytes(8, "little") + foreign + raw[8 + n :])
    to_released(to_project(rel, tmp_path / "p"), tmp_path / "back")
    assert (tmp_path / "back" / shard.name).read_bytes() == shard.read_bytes()


def test_export_converts_one_shard_at_a_time(monkeypatch, tmp_path):
    """A fresh export holds one shard's tensors in the released formats at a time (the output is
    the same bytes as converting everything at once: the round-trip tests above)."""
    import v4stack.model.released as R

    calls, real = [], R.released_tensors
    monkeypatch.setattr(R, "released_tensors", lambda t: calls.append(len(t)) or real(t))
    model = V4Model(preset("tiny"), seed=1)
    n = len(model.state_dict())
    R.export_released(model, tmp_path / "r", shards=4)
    assert len(calls) == 4 and sum(calls) >= n and max(calls) < n // 3, (calls, n)  # not all at once
