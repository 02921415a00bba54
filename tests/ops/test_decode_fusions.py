"""Launches the decode step merges (Triton's interpreter; on a GPU too): the up projection's grouped
GEMM storing SwiGLU's activation (``fused.grouped_swiglu``), the mHC write combining the experts'
sorted rows itself (``fused.moe_hc_write``) and a layer's two projection norms in one launch
(``fused.rms_norm_pair``), each bit for bit the kernels it replaces, and the GPU dispatch taking them."""

import pytest
import torch

from v4stack import ops
from v4stack.ops import fused

tgr = pytest.importorskip("v4stack.kernels.triton_grouped")
tm = pytest.importorskip("v4stack.kernels.triton_mhc")
tr = pytest.importorskip("v4stack.kernels.triton_route")
trw = pytest.importorskip("v4stack.kernels.triton_rows")


def _experts(counts, N=48, K=64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    x = (torch.randn(sum(counts), K, generator=g) * 2).bfloat16()
    w1, w3 = ((torch.randn(E, N, K, generator=g) * K ** -0.5).bfloat16() for _ in range(2))
    off = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    ws = torch.rand(sum(counts), generator=g)
    return (t.to(device) for t in (x, w1, w3, off, ws))


def _tiles():
    from v4stack.kernels import tiles

    tma = [t for t in tiles.GROUPED_CANDIDATES if t.get("tma") and t["BK"] == tiles.GROUPED_FALLBACK["BK"]]
    return [tiles.GROUPED_FALLBACK, tma[0], next(t for t in tma if t.get("occ"))]


@pytest.mark.parametrize("limit", [0.0, 0.75])
def test_up_gemm_storing_the_activation_gives_the_two_kernels_bits(limit):
    x, w1, w3, off, ws = _experts([70, 0, 5, 1, 33])  # an expert over two row tiles, an empty one
    gate = tgr.grouped_linear(x, w1, off)
    for t in _tiles():
        up = tgr.grouped_linear(x, w3, off, t)
        for weight in (ws, None):
            want = tm.swiglu_act(gate, up, limit, weight, torch.bfloat16)
            got = tgr.grouped_linear(x, w3, off, t, act=(gate, limit, weight), out_dtype=torch.bfloat16)
            assert torch.equal(got, want), (t, weight is None)
    assert torch.equal(tgr.grouped_swiglu(x, w3, off, gate, limit, ws, torch.bfloat16),
                       tm.swiglu_act(gate, tgr.grouped_linear(x, w3, off), limit, ws, torch.bfloat16))
    # inverse control: the activation of the unrounded fp32 products (what an epilogue that skipped
    # the up GEMM's rounding would store) has other bits
    up32 = torch.cat([x[off[e]:off[e + 1]].float() @ w3[e].float().T for e in range(len(off) - 1)])
    assert not torch.equal(tm.swiglu_act(gate, up32, limit, ws, torch.bfloat16),
                           tm.swiglu_act(gate, up32.bfloat16(), limit, ws, torch.bfloat16))


def _combine_case(T=5, k=6, E=8, n=4, D=1100, seed=1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    idx[2, 3] = idx[2, 1]  # a repeated expert: ties in slot order
    w = torch.rand(T, k, generator=g)
    _, _, rank, _, _ = fused.moe_route_reference(idx, w, E, True)
    out = torch.randn(T * (k + 1), D, generator=g).bfloat16()
    x = torch.randn(T, n, D, generator=g).bfloat16()
    post = torch.rand(T, n, generator=g) * 2
    comb = torch.rand(T, n, n, generator=g)
    return x, out, rank, idx, post, comb


def test_write_combining_the_experts_rows_gives_the_two_kernels_bits():
    x, out, rank, idx, post, comb = _combine_case()
    want = trw.hc_write(x, tr.moe_unsort_combine(out, rank, idx, None, x.dtype, True), post, comb)
    got = tr.moe_hc_write(x, out, rank, idx, True, post, comb)
    assert got.dtype == x.dtype and torch.equal(got, want)
    # inverse controls: the combined row kept in fp32 (not rounded to the streams' dtype first), and
    # the shared expert's row left out, give other bits
    acc = fused.moe_unsort_combine_reference(out, rank, idx, None, torch.float32, True)
    assert not torch.equal(trw.hc_write(x.float(), acc, post, comb).bfloat16(), got)
    _, _, rank6, _, _ = fused.moe_route_reference(idx, torch.ones(idx.shape), 8, False)
    assert not torch.equal(tr.moe_hc_write(x, out[: rank6.numel()], rank6, idx, False, post, comb), got)


def test_two_norms_in_one_launch_give_each_norms_bits():
    g = torch.Generator().manual_seed(2)
    xp = (torch.randn(6, 1024 + 512 + 40, generator=g) * 3).bfloat16()  # packed projections: strided views
    a, b = xp[:, :1024], xp[:, 1024:1536]
    wa, wb = torch.rand(1024, generator=g) + 0.5, torch.rand(512, generator=g) + 0.5
    ya, yb = trw.rms_norm_pair(a, wa, b, wb, 1e-6)
    assert torch.equal(ya, trw.rms_norm(a, wa, 1e-6)) and torch.equal(yb, trw.rms_norm(b, wb, 1e-6))
    # inverse control: the other row set's weight gives other bits
    assert not torch.equal(trw.rms_norm_pair(a, wa, b, wb.flip(0), 1e-6)[1], yb)


def test_cpu_runs_the_compositions():
    x, out, rank, idx, post, comb = _combine_case()
    with ops.mode("fast"):
        got = fused.moe_hc_write(x, out, rank, idx, True, post, comb)
    assert torch.equal(got, ops.hc_write(x, fused.moe_unsort_combine(out, rank, idx, None, x.dtype, True), post, comb))
    xs, w1, w3, off, ws = _experts([9, 3])
    gate = ops.grouped_linear(xs, w1, off)
    assert torch.equal(fused.grouped_swiglu(xs, w3, off, gate, 0.5, ws, torch.bfloat16),
                       fused.swiglu_act(gate, ops.grouped_linear(xs, w3, off), 0.5, ws, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_the_fused_ends_serve_with_the_same_bits():
    from v4stack.ops.dispatch import counters, reset_counters

    x, w1, w3, off, ws = _experts([192, 200, 185, 256], N=2048, K=512, device="cuda")
    with ops.mode("fast"):
        gate = ops.grouped_linear(x, w1, off)
        reset_counters()
        got = fused.grouped_swiglu(x, w3, off, gate, 10.0, ws, torch.bfloat16)
        assert "triton_grouped_swiglu" in counters()["grouped_swiglu"]
        assert torch.equal(got, fused.swiglu_act(gate, ops.grouped_linear(x, w3, off), 10.0, ws, torch.bfloat16))
        xs, out, rank, idx, post, comb = (t.cuda() for t in _combine_case(T=256, D=4096))
        reset_counters()
        got = fused.moe_hc_write(xs, out, rank, idx, True, post, comb)
        assert "triton_moe_hc_write" in counters()["moe_hc_write"]
        assert torch.equal(got, ops.hc_write(xs, fused.moe_unsort_combine(out, rank, idx, None, xs.dtype, True),
                                             post, comb))
        xp = torch.randn(256, 1600, device="cuda").bfloat16()
        wa, wb = torch.rand(1024, device="cuda") + 0.5, torch.rand(512, device="cuda") + 0.5
        reset_counters()
        ya, yb = fused.rms_norm_pair(xp[:, :1024], wa, xp[:, 1024:1536], wb, 1e-6)
        assert "triton_rms_norm_pair" in counters()["rms_norm_pair"]
        assert torch.equal(ya, ops.rms_norm(xp[:, :1024], wa, 1e-6))
        assert torch.equal(yb, ops.rms_norm(xp[:, 1024:1536], wb, 1e-6))


def test_the_activation_epilogue_keeps_two_programs_an_sm():
    """Built for sm_90a as the decode launch runs it (64 x 128 tile, two programs of 128 threads an
    SM), the up projection storing the activation does not spill and its registers still let two
    programs share an SM's 64K (the plain tile's build for comparison: it needs far fewer)."""
    from tests.ops.hopper import registers

    got = registers(("grouped_gemm_bf16_tma_decode", "grouped_swiglu_bf16_tma"))
    act, plain = got["grouped_swiglu_bf16_tma"], got["grouped_gemm_bf16_tma_decode"]
    assert act["spill_bytes"] == 0 and plain["spill_bytes"] == 0
    assert 2 * 128 * (-(-act["registers"] // 8) * 8) <= 65536
    assert plain["registers"] < act["registers"]
