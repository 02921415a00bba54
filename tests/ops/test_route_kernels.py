"""The MoE routing kernels (``kernels/triton_route.py``) under Triton's interpreter: the gate's
top-k and weights against float64 and the invariant-mode reference (ties to the lower expert id),
row-locality, the counting sort equal to the stable sort, the Hopper build, and the CUDA dispatch."""

import pytest
import torch

from tests.ops.hopper import check, ptx
from v4stack import ops
from v4stack.ops import fused

tr = pytest.importorskip("v4stack.kernels.triton_route")


def _routing(T, k, E, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k).long()
    return idx, torch.rand(T, k, generator=g)


@pytest.mark.parametrize("T,k,E", [(37, 6, 8), (90, 6, 256), (3, 2, 3), (0, 6, 8), (800, 6, 16)])  # 4800 pairs: blocks
def test_route_kernel_is_the_stable_sort(T, k, E):
    idx, w = _routing(T, k, E, seed=T + E)
    got = tr.moe_route(idx, w, E)
    want = fused.moe_route_reference(idx, w, E)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    off, order, rank, tok, ws = got
    assert off[0] == 0 and off[-1] == T * k and torch.equal(order[rank], torch.arange(T * k))
    if T > 1:  # inverse control: the pairs of an expert in reverse order are not what the kernel wrote
        e = int(torch.bincount(idx.reshape(-1)).argmax())
        seg = order[off[e]:off[e + 1]]
        assert len(seg) > 1 and not torch.equal(seg.flip(0), seg)


def test_gate_kernel_matches_float64_ties_to_the_lower_id_and_is_row_local():
    g = torch.Generator().manual_seed(3)
    T, k, E = 12, 6, 256
    lg = torch.randn(T, E, generator=g) * 3
    lg[4, :3] = 30.0  # softplus's linear branch, and a three-way tie: ids 0, 1, 2 in that order
    lg[5] = -40.0  # softplus ~ exp(x): log1p's small branch
    lg[5, 200] = -39.0
    bias = torch.randn(E, generator=g) * 0.1
    bias[:3] = 0.0
    idx, w = tr.moe_gate(lg, bias, None, None, k, 2.5)
    with ops.mode("invariant"):
        ri, rw = fused.moe_gate_reference(lg.double(), bias.double(), None, None, k, 2.5)
        ri32, _ = fused.moe_gate_reference(lg, bias, None, None, k, 2.5)
    assert torch.equal(idx, ri) and torch.equal(idx, ri32)
    assert idx[4, :3].tolist() == [0, 1, 2]
    torch.testing.assert_close(w.double(), rw, atol=1e-6, rtol=1e-6)
    ai, aw = tr.moe_gate(lg[9:10].clone(), bias, None, None, k, 2.5)
    assert torch.equal(ai[0], idx[9]) and torch.equal(aw[0], w[9])
    nan = lg[:2].clone()
    nan[1] = float("nan")
    ni = tr.moe_gate(nan, bias, None, None, k, 2.5)[0]
    assert ((ni >= 0) & (ni < E)).all()  # a NaN row still names experts that exist
    # inverse control: without the bias another choice is made
    assert not torch.equal(tr.moe_gate(lg, torch.zeros_like(bias), None, None, k, 2.5)[0], idx)


def test_gate_kernel_hash_layer_uses_the_table():
    g = torch.Generator().manual_seed(4)
    T, k, E, V = 17, 6, 8, 50
    lg = torch.randn(T, E, generator=g)
    tab = torch.randint(0, E, (V, k), generator=g, dtype=torch.int32)
    tok = torch.randint(0, V, (T,), generator=g)
    idx, w = tr.moe_gate(lg, None, tab, tok, k, 1.5)
    ri, rw = fused.moe_gate_reference(lg.double(), None, tab, tok, k, 1.5)
    assert torch.equal(idx, ri)
    torch.testing.assert_close(w.double(), rw, atol=1e-6, rtol=1e-6)


def test_unsort_combine_kernel_equals_the_invariant_reference_bits():
    T, k, E, D = 4, 6, 8, 1100  # two column blocks, the last one cut
    idx, w = _routing(T, k, E, seed=5)
    idx[2, 3] = idx[2, 1]  # a repeated expert (a hash table may have one): ties in slot order
    _, _, rank, _, _ = fused.moe_route_reference(idx, w, E)
    g = torch.Generator().manual_seed(6)
    out = torch.randn(T * k, D, generator=g).bfloat16()
    sh = torch.randn(T, D, generator=g)
    got = tr.moe_unsort_combine(out, rank, idx, sh, torch.float32)
    with ops.mode("invariant"):
        want = fused.moe_unsort_combine_reference(out, rank, idx, sh, torch.float32)
        plain = fused.moe_unsort_combine_reference(out, rank, idx, sh.bfloat16(), torch.bfloat16)
    assert torch.equal(got, want)
    ref = fused.moe_unsort_combine_reference(out.double(), rank, idx, sh.double(), torch.float64)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    # the interpreter truncates to bfloat16 (the GPU rounds to nearest even: the CUDA test checks those bits)
    b16 = tr.moe_unsort_combine(out, rank, idx, sh.bfloat16(), torch.bfloat16)  # the shared expert's dtype too
    assert b16.dtype == torch.bfloat16
    torch.testing.assert_close(b16.float(), plain.float(), atol=0, rtol=2 ** -7)
    # inverse control: the pairs read in pair order instead of through the rank give other sums
    assert not torch.equal(tr.moe_unsort_combine(out, torch.arange(T * k), idx, sh, torch.float32), got)


def test_cpu_calls_run_the_composite_reference_in_both_modes():
    idx, w = _routing(5, 2, 4, seed=1)
    for m in ("fast", "invariant"):
        with ops.mode(m):
            ops.reset_counters()
            fused.moe_route(idx, w, 4)
            fused.moe_gate(torch.randn(5, 4), torch.zeros(4), None, None, 2, 1.0)
            c = ops.counters()
            assert c["moe_route"] == {"torch_composite": 1} and c["moe_gate"] == {"torch_composite": 1}
    from v4stack.kernels.fused_gpu import moe_gate_ok, moe_route_ok

    assert not moe_route_ok(idx, w, 4) and not moe_gate_ok(torch.randn(5, 4), torch.zeros(4), None, None, 2, 1.0)


def test_route_kernels_build_for_hopper():
    # kernels/builds.py: each compiles for sm_90a with the declared float semantics
    check(ptx(("moe_gate", "moe_gate_e8", "moe_gate_hashed", "moe_gate_e8_partials", "moe_route", "moe_route_e8", "moe_unsort_combine")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_route_kernels_on_cuda_match_the_reference_in_both_modes():
    from v4stack.kernels import fused_gpu

    idx, w = (t.cuda() for t in _routing(300, 6, 256, seed=7))
    lg = (torch.randn(300, 256) * 3).cuda()
    bias = (torch.randn(256) * 0.1).cuda()
    for m in ("fast", "invariant"):
        with ops.mode(m):
            ops.reset_counters()
            got = fused.moe_route(idx, w, 256)
            gi, gw = fused.moe_gate(lg, bias, None, None, 6, 2.5)
            assert ops.counters()["moe_route"] == {"triton_moe_route": 1}
            assert ops.counters()["moe_gate"] == {"triton_moe_gate": 1}
            assert not {k: v for k, v in fused_gpu.refused.items() if k.startswith("moe_")}, fused_gpu.refused  # this file's kernels (the record is per process)
            assert all(torch.equal(a, b) for a, b in zip(got, fused.moe_route_reference(idx, w, 256)))
            ai, aw = fused.moe_gate(lg[77:78].clone(), bias, None, None, 6, 2.5)
            assert torch.equal(ai[0], gi[77]) and torch.equal(aw[0], gw[77])
    with ops.mode("invariant"):
        ri, rw = fused.moe_gate_reference(lg.double(), bias.double(), None, None, 6, 2.5)
    assert torch.equal(gi, ri)
    torch.testing.assert_close(gw.double(), rw, atol=1e-5, rtol=1e-5)  # exp / log: the approximate PTX ones
    rank = got[2]
    out = torch.randn(300 * 6, 4096, device="cuda").bfloat16()
    sh = torch.randn(300, 4096, device="cuda")
    with ops.mode("invariant"):
        ops.reset_counters()
        y = fused.moe_unsort_combine(out, rank, idx, sh, torch.bfloat16)
        assert ops.counters()["moe_unsort_combine"] == {"triton_moe_unsort_combine": 1}
        assert torch.equal(y, fused.moe_unsort_combine_reference(out, rank, idx, sh, torch.bfloat16))
        ya = fused.moe_unsort_combine(out, rank[6 * 40:6 * 41].clone(), idx[40:41].clone(), sh[40:41], torch.bfloat16)
        assert torch.equal(ya[0], y[40])
    assert not {k: v for k, v in fused_gpu.refused.items() if k.startswith("moe_")}, fused_gpu.refused  # this file's kernels (the record is per process)


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The three routing kernels registered for CPU tensors (interpreter) for one test."""
    from v4stack.ops import dispatch

    monkeypatch.setattr(dispatch, "_table", {k: list(v) for k, v in dispatch._table.items()})
    for op in ("moe_gate", "moe_route", "moe_unsort_combine"):
        dispatch.register(op, f"triton_{op}", getattr(tr, op), device="cpu", first=True)
    yield
    dispatch._resolved.clear()


@pytest.mark.parametrize("hashed", [False, True])
def test_moe_layer_through_the_kernels_matches_the_composition(kernels_on_cpu, hashed):
    """The wiring in ``model/moe.py``: one MoE layer (fp32, with a shared expert) run through the
    kernels equals the torch composition up to the gate's rounding, in both modes."""
    from v4stack.config import ModelConfig, preset
    from v4stack.model.moe import MoE

    cfg = ModelConfig.from_dict({**preset("tiny").to_dict(), "n_routed_experts": 8, "num_experts_per_tok": 3,
                                 "n_shared_experts": 1, "num_hash_layers": 1})
    g = torch.Generator().manual_seed(11)
    moe = MoE(cfg, 0 if hashed else 1)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        if hashed:
            moe.gate.tid2eid.copy_(torch.randint(0, 8, moe.gate.tid2eid.shape, generator=g))
    x = torch.randn(6, cfg.hidden_size, generator=g)
    tok = torch.randint(0, 100, (6,), generator=g)
    from v4stack.ops import dispatch

    for m in ("fast", "invariant"):
        with torch.no_grad(), ops.mode(m):
            ops.reset_counters()
            got = moe(x, tok)
            assert ops.counters()["moe_unsort_combine"] == {"triton_moe_unsort_combine": 1}
            saved = dispatch._table
            dispatch._table = {k: [i for i in v if not i.name.startswith("triton_moe")] for k, v in saved.items()}
            dispatch._resolved.clear()
            try:
                want = moe(x, tok)
            finally:
                dispatch._table = saved
                dispatch._resolved.clear()
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("T,k,E", [(37, 6, 8), (5, 2, 3), (700, 6, 8)])
def test_joined_shared_expert_equals_the_padded_pairs(T, k, E):
    """``joined``: one more pair a token for expert E with weight 1, as if the inputs were padded
    (what the MoE did with two padded copies); the kernels equal the composition, and the combine
    adds the joined expert last."""
    idx, w = _routing(T, k, E, seed=T * k)
    pad_i = torch.nn.functional.pad(idx, (0, 1), value=E)
    pad_w = torch.nn.functional.pad(w, (0, 1), value=1.0)
    want = fused.moe_route_reference(pad_i, pad_w, E + 1)
    got = tr.moe_route(idx, w, E, joined=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(fused.moe_route_reference(idx, w, E, joined=True), want))
    # inverse control: without the joined slot the offsets stop at T k
    assert tr.moe_route(idx, w, E)[0][-1] == T * k != got[0][-1]
    out = torch.randn(T * (k + 1), 16)
    rank = got[2]
    # the kernel with the joined slot = the kernel on the padded ids; the same for the composition
    padded = tr.moe_unsort_combine(out, rank, pad_i, None, torch.float32)
    assert torch.equal(tr.moe_unsort_combine(out, rank, idx, None, torch.float32, joined=True), padded)
    ref = fused.moe_unsort_combine_reference(out, rank, pad_i, None, torch.float32)
    assert torch.equal(fused.moe_unsort_combine_reference(out, rank, idx, None, torch.float32, joined=True), ref)
    assert torch.allclose(padded, ref, rtol=1e-5, atol=1e-5)
