"""Packed projections (model/packed.py): a serving step's projections of x as one GEMM, the same
bits in invariant mode, fewer GEMMs, and a packing that no longer holds is never used."""

import random

import torch

from v4stack import ops
from v4stack.model import V4Model, packed
from v4stack.ops.mode import mode

from .conftest import tokens
from .test_paged import _drive


def _attn(model):
    return [blk.attn for blk in model.layers]


def _linear_calls(model, seqs, schedule):
    ops.reset_counters()
    with mode("invariant"):
        got, _ = _drive(model, seqs, schedule)
    return got, sum(ops.counters().get("linear", {}).values())


@torch.no_grad()
def test_packed_step_same_bits_and_fewer_gemms(tiny_cfg):
    seqs = [tokens(n, seed=50 + n)[0] for n in (37, 29)]
    rng = random.Random(3)
    schedule = [[rng.choice([0, 1, 5, 13]) for _ in seqs] for _ in range(4)] + [[1, 1]] * 30
    plain = V4Model(tiny_cfg, seed=4).eval()
    ref, n_ref = _linear_calls(plain, seqs, schedule)
    model = V4Model(tiny_cfg, seed=4).eval()
    assert model.pack_projections() == len(model.layers) + len(model.mtp)
    assert model.pack_projections() == len(model.layers) + len(model.mtp)  # idempotent
    got, n_got = _linear_calls(model, seqs, schedule)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)
    # every layer runs one GEMM for wq_a + wkv (+ its compressors' four) in each step
    assert n_got < n_ref
    att = _attn(model)[0]
    w = packed.joined(att, att.x_linears())
    assert w is not None and att.wq_a.weight.data_ptr() == w.data_ptr()


@torch.no_grad()
def test_replaced_weight_is_not_read_from_the_stale_buffer(tiny_cfg):
    seqs = [tokens(30, seed=7)[0]]
    schedule = [[9]] + [[1]] * 21
    model = V4Model(tiny_cfg, seed=5).eval()
    model.pack_projections()
    att = next(a for a in _attn(model) if a.compressor is not None)
    stale = packed.joined(att, att.x_linears())
    new = torch.randn_like(att.compressor.wgate.weight)
    att.compressor.wgate.weight = torch.nn.Parameter(new)  # assigned, not copied in: the packing breaks
    with mode("invariant"):
        got, _ = _drive(model, seqs, schedule)
    assert packed.joined(att, att.x_linears()) is None  # detected, and the buffer dropped
    ref_model = V4Model(tiny_cfg, seed=5).eval()
    next(a for a in _attn(ref_model) if a.compressor is not None).compressor.wgate.weight.copy_(new)
    with mode("invariant"):
        ref, _ = _drive(ref_model, seqs, schedule)
    assert torch.equal(got[0], ref[0])
    # the control: the stale buffer's slice holds the old weight, so reading it would be wrong
    lin = att.x_linears()
    row = sum(m.weight.shape[0] for m in lin[:3])
    assert not torch.equal(stale[row:row + new.shape[0]], new)


def test_in_place_updates_reach_the_packed_weight(tiny_cfg):
    model = V4Model(tiny_cfg, seed=6)
    params_before = [id(p) for p in model.parameters()]
    model.pack_projections()
    assert [id(p) for p in model.parameters()] == params_before  # the same Parameter objects
    att = _attn(model)[0]
    opt = torch.optim.SGD([att.wkv.weight], lr=0.5)
    att.wkv.weight.grad = torch.ones_like(att.wkv.weight)
    opt.step()
    x = torch.randn(3, tiny_cfg.hidden_size)
    with torch.no_grad(), mode("invariant"):
        outs = packed.run(att, att.x_linears(), x)
        assert outs is not None
        for lin, o in zip(att.x_linears(), outs):
            assert torch.equal(o, ops.linear(x, lin.weight))
    # under autograd the packed buffer is not used (the Parameters are what is differentiated)
    assert packed.run(att, att.x_linears(), x) is None


def test_quantised_layers_are_left_unpacked(tiny_cfg):
    model = V4Model(tiny_cfg, seed=6)
    att = _attn(model)[0]
    att.wkv.qweight = object()  # any quantised weight: the linear no longer reads .weight
    assert not att.pack_projections()
    assert packed.joined(att, att.x_linears()) is None
