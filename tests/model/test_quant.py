"""FP8 / FP4 formats and the official activation rounding, against reference math written
independently here (every representable value enumerated from its bit fields; Python floats)."""

import math

import pytest
import torch

from v4stack import ops
from v4stack.model import V4Model
from v4stack.model.quant import fp4_round, fp8_round, hadamard, set_act_rounding
from v4stack.ops.quantized import (
    QuantizedWeight,
    dequantize_fp4,
    dequantize_fp8,
    quantize_fp4,
    quantize_fp8,
    round_e2m1,
    round_e4m3,
)

from .conftest import tokens


def _e4m3_values():
    """All finite e4m3fn magnitudes with their codes, from the bit fields (bias 7, no inf)."""
    out = []
    for code in range(0x7F):  # 0x7F is NaN
        e, m = code >> 3, code & 7
        out.append((code, (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)))
    return out


def _e2m1_values():
    return [(code, (m / 2) * 1.0 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))
            for code in range(8) for e, m in [(code >> 1, code & 1)]]


def _nearest(x: float, table) -> float:
    """Round-to-nearest, ties to the even code, saturating: the IEEE rule, by enumeration."""
    a = min(abs(x), table[-1][1])
    best = min(table, key=lambda cv: (abs(cv[1] - a), cv[0] & 1))
    return math.copysign(best[1], x)


def _ref_round(x: torch.Tensor, table, qmax: float, block: int, floor: float) -> torch.Tensor:
    """Blockwise quantise-dequantise with power-of-two scales, element by element in Python."""
    flat = x.reshape(-1, x.shape[-1]).tolist()
    out = []
    for row in flat:
        r = []
        for i in range(0, len(row), block):
            b = row[i : i + block]
            amax = max(max(abs(v) for v in b), floor)
            scale = 2.0 ** math.ceil(math.log2(amax / qmax))
            r += [_nearest(v / scale, table) * scale for v in b]
        out.append(r)
    return torch.tensor(out, dtype=x.dtype).view(x.shape)


E4M3, E2M1 = _e4m3_values(), _e2m1_values()


def test_e4m3_and_e2m1_rounding_match_enumeration():
    g = torch.Generator().manual_seed(0)
    mids8 = [(a[1] + b[1]) / 2 for a, b in zip(E4M3, E4M3[1:])]
    mids4 = [(a[1] + b[1]) / 2 for a, b in zip(E2M1, E2M1[1:])]
    x8 = torch.tensor(mids8 + [-v for v in mids8] + [500.0, -1e4, 0.0], dtype=torch.float64)
    x8 = torch.cat((x8, torch.randn(2000, generator=g, dtype=torch.float64) * 50))
    assert round_e4m3(x8).tolist() == [_nearest(v, E4M3) for v in x8.tolist()]
    x4 = torch.tensor(mids4 + [-v for v in mids4] + [7.0, -0.1, 0.0], dtype=torch.float64)
    x4 = torch.cat((x4, torch.randn(2000, generator=g, dtype=torch.float64) * 3))
    assert round_e2m1(x4).tolist() == [_nearest(v, E2M1) for v in x4.tolist()]


def test_weight_formats_round_trip_within_half_a_step():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 300, generator=g) * torch.logspace(-3, 1, 300)  # blocks of mixed magnitude
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 3)
    d, sf = dequantize_fp8(q, s), s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    # e4m3: 3 mantissa bits -> half a step is 2^-4 of the value's binade; subnormal step 2^-9
    assert ((d - w).abs() <= torch.maximum(w.abs() * 2.0 ** -4, sf * 2.0 ** -10)).all()
    assert (w.abs().amax() / sf.amax()) <= 448
    w = w[:, :288]  # fp4 rows are whole 32-wide blocks
    p, s4 = quantize_fp4(w)
    assert p.dtype == torch.int8 and p.shape == (200, 144) and s4.shape == (200, 9)
    d4, sf4 = dequantize_fp4(p, s4), s4.float().repeat_interleave(32, 1)
    # e2m1: 1 mantissa bit -> half a step is 2^-2 of the binade; below 1 the step is 0.5
    assert ((d4 - w).abs() <= torch.maximum(w.abs() * 2.0 ** -2, sf4 * 0.25)).all()
    # low nibble = even column
    b = p.view(torch.uint8)[0, 0].item()
    lut = [v for _, v in E2M1] + [-v for _, v in E2M1]
    assert d4[0, 0].item() == lut[b & 15] * sf4[0, 0].item() and d4[0, 1].item() == lut[b >> 4] * sf4[0, 1].item()


def test_ops_linear_dispatches_on_the_weight_format():
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(64, 96, generator=g), torch.randn(5, 96, generator=g)
    for fmt, (data, scale) in (("fp8", quantize_fp8(w)), ("fp4", quantize_fp4(w))):
        qw = QuantizedWeight(fmt, data, scale)
        dense = qw.dequantize()
        for m in ("fast", "invariant"):
            with ops.mode(m):
                assert torch.equal(ops.linear(x, qw), ops.linear(x, dense))
        assert not torch.equal(dense, w)  # the quantised weight is really used


def test_activation_rounding_matches_reference_math():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 200, generator=g, dtype=torch.float64) * torch.logspace(-2, 2, 200, dtype=torch.float64)
    assert torch.equal(fp8_round(x, 64), _ref_round(x, E4M3, 448.0, 64, 1e-4))  # ragged last block
    y = torch.randn(6, 128, generator=g, dtype=torch.float64)
    assert torch.equal(fp4_round(y, 32), _ref_round(y, E2M1, 6.0, 32, 6 * 2.0 ** -126))


def test_hadamard_is_orthonormal_and_keeps_scores():
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(7, 128, generator=g, dtype=torch.float64), torch.randn(9, 128, generator=g, dtype=torch.float64)
    assert torch.allclose(hadamard(hadamard(q)), q, atol=1e-12)  # H/sqrt(d) is symmetric, orthonormal
    assert torch.allclose(hadamard(q) @ hadamard(k).T, q @ k.T, atol=1e-12)
    # with the FP4 rounding the scores move, which is why the rotation precedes it
    assert not torch.allclose(fp4_round(hadamard(q)) @ fp4_round(hadamard(k)).T, q @ k.T, atol=1e-3)


def _capture_inputs(model):
    seen = {}

    def hook(mod, args):
        seen[id(mod)] = (args[0].clone(), args[1].clone())

    hs = [blk.attn.register_forward_pre_hook(hook) for blk in model.layers]
    return seen, hs


@torch.no_grad()
@pytest.mark.parametrize("on", [True, False])
def test_rounding_is_applied_where_the_official_inference_applies_it(tiny_cfg, on):
    """Per layer, from the layer's own input: window KV rows and compressed entries hold their
    FP8-rounded non-RoPE dims and exact RoPE dims; the indexer's keys and queries are rotated and
    FP4-rounded. With rounding off (the control) the same comparisons fail."""
    model = set_act_rounding(V4Model(tiny_cfg, seed=7).cast(torch.float64).eval(), on)
    T, r = 40, tiny_cfg.qk_rope_head_dim
    t = tokens(T, seed=5)[0]
    seen, hooks = _capture_inputs(model)
    st = model.new_state()
    model.step([(t, st)])
    for h in hooks:
        h.remove()
    set_act_rounding(model, False)  # recompute the unrounded activations from the same inputs
    checked = {"window": 0, "compressed": 0, "index_keys": 0, "index_q": 0}
    for i, blk in enumerate(model.layers):
        a, ls = blk.attn, st.layers[i]
        x, pos = seen[id(a)]
        kv = a.rotary.apply(a.kv_norm(a.wkv(x)), pos)
        win = ls.read_window(T - a.window, T)
        want = torch.cat((_ref_round(kv[-a.window :, :-r], E4M3, 448.0, 64, 1e-4), kv[-a.window :, -r:]), -1)
        assert torch.equal(win, want) == on and torch.equal(win[:, -r:], want[:, -r:])
        checked["window"] += 1
        if a.compressor is not None:
            ckv, cs = a.compressor.project(x, pos)
            ents = a.compressor.pool(ckv, cs, 0, range(T // a.ratio), x.dtype)
            want = torch.cat((_ref_round(ents[:, :-r], E4M3, 448.0, 64, 1e-4), ents[:, -r:]), -1)
            assert torch.equal(ls.compressed_kv, want) == on
            checked["compressed"] += 1
        if a.indexer is not None:
            ic = a.indexer.compressor
            ikv, isc = ic.project(x, pos)
            keys = ic.pool(ikv, isc, 0, range(T // a.ratio), x.dtype)
            assert torch.equal(ls.index_keys, _ref_round(hadamard(keys), E2M1, 6.0, 32, 6 * 2.0 ** -126)) == on
            qr = a.q_norm(a.wq_a(x))
            q_off, _ = a.indexer.project(qr, x, pos)
            set_act_rounding(model, True)
            q_on, _ = a.indexer.project(qr, x, pos)
            set_act_rounding(model, False)
            assert torch.equal(q_on, _ref_round(hadamard(q_off), E2M1, 6.0, 32, 6 * 2.0 ** -126))
            checked["index_keys"] += 1
            checked["index_q"] += 1
    assert checked == {"window": 6, "compressed": 4, "index_keys": 2, "index_q": 2}


@torch.no_grad()
def test_rounding_moves_logits_and_keeps_decode_equivalence(tiny_cfg):
    model = V4Model(tiny_cfg, seed=8).cast(torch.float64).eval()
    t = tokens(36, seed=6)
    off = model(t)[0]
    set_act_rounding(model, True)
    on = model(t)[0]
    assert (on - off).abs().max() > 1e-3
    st = model.new_state()
    inc = torch.cat([model.step([(t[0, a:b], st)])[0] for a, b in ((0, 13), (13, 14), (14, 36))])
    assert (inc - on).abs().max() < 1e-9  # rounding is per row / per entry: chunking-independent
