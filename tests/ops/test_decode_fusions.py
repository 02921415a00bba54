"""Launches the decode step merges (Triton's interpreter; on a GPU too): the mHC write combining the
experts' sorted rows itself (``fused.moe_hc_write``), a layer's two projection norms in one launch
(``fused.rms_norm_pair``), the MoE's routing with its rows' gather (``fused.moe_route_rows``) and the
streams' first copies (``fused.embed_streams``), each bit for bit the kernels it replaces, and the GPU
dispatch taking them."""

import pytest
import torch

from v4stack import ops
from v4stack.ops import fused

tr = pytest.importorskip("v4stack.kernels.triton_route")
trw = pytest.importorskip("v4stack.kernels.triton_rows")


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


def _route_case(T=83, k=6, E=8, D=700, seed=3):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    idx[:, 0] = torch.where(torch.arange(T) % 3 == 0, 7, idx[:, 0])  # an uneven expert: more rows than a step
    idx[4, 2] = idx[4, 0]  # a repeated expert: ties in pair order
    w = torch.rand(T, k, generator=g)
    x = torch.randn(T, D, generator=g).bfloat16()
    return x, idx, w


@pytest.mark.parametrize("joined", [False, True])
def test_routing_with_its_rows_gives_the_route_and_the_gather(joined):
    x, idx, w = _route_case()
    want = tr.moe_route(idx, w, 8, joined)
    got = tr.moe_route_rows(x, idx, w, 8, joined, x.dtype)
    for a, b in zip(got[:5], want):
        assert torch.equal(a, b)
    rows = got[5]
    assert rows.shape == (idx.numel() + joined * idx.shape[0], x.shape[1]) and torch.equal(rows, x[want[3]])
    # inverse control: rows copied in pair order (not each expert's placement order) are other rows
    pair_tok = torch.arange(rows.shape[0]) // (idx.shape[1] + joined)
    assert not torch.equal(rows, x[pair_tok])
    # and a column block past the first is copied too (the tile is narrower than the rows)
    assert tr.ROWS_TILE["BC"] < x.shape[1] and torch.equal(rows[:, -5:], x[want[3]][:, -5:])
    # an expert's rows span several steps of the tile's rows, the last one partly filled
    per = (want[0][1:] - want[0][:-1]).tolist()
    step = tr.ROWS_TILE["BR"]
    assert max(per) > 2 * step and any(n % step for n in per)


def test_streams_first_copies_are_the_embedding_rows():
    g = torch.Generator().manual_seed(4)
    table = torch.randn(50, 1500, generator=g).bfloat16()
    ids = torch.tensor([3, 0, 49, 3, 17])
    got = trw.embed_streams(ids, table, 4)
    assert torch.equal(got, fused.embed_streams_reference(ids, table, 4))
    # inverse control: another id's row is another stream content; an id past the table writes zeros
    assert not torch.equal(trw.embed_streams(ids.flip(0), table, 4), got)
    assert trw.embed_streams(torch.tensor([50]), table, 2).abs().sum() == 0


def test_cpu_runs_the_compositions():
    x, out, rank, idx, post, comb = _combine_case()
    with ops.mode("fast"):
        got = fused.moe_hc_write(x, out, rank, idx, True, post, comb)
    assert torch.equal(got, ops.hc_write(x, fused.moe_unsort_combine(out, rank, idx, None, x.dtype, True), post, comb))
    a, b = x[:, 0], x[:, 1, :512]
    wa, wb = torch.rand(a.shape[1]), torch.rand(512)
    ya, yb = fused.rms_norm_pair(a, wa, b, wb, 1e-6)
    assert torch.equal(ya, ops.rms_norm(a, wa, 1e-6)) and torch.equal(yb, ops.rms_norm(b, wb, 1e-6))
    xr, idx, w = _route_case()
    got = fused.moe_route_rows(xr, idx, w, 8, True, torch.float32)
    want = fused.moe_route_reference(idx, w, 8, True)
    assert all(torch.equal(a, b) for a, b in zip(got[:5], want)) and torch.equal(got[5], xr[want[3]].float())
    ids = torch.tensor([1, 4, 2])
    assert torch.equal(fused.embed_streams(ids, xr, 3), torch.stack([xr[ids]] * 3, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_the_fused_ends_serve_with_the_same_bits():
    from v4stack.kernels import fused_gpu
    from v4stack.ops.dispatch import counters, reset_counters

    with ops.mode("fast"):
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
        xr, idx, w = (t.cuda() for t in _route_case(T=256, D=4096))
        reset_counters()
        got = fused.moe_route_rows(xr, idx, w, 8, True, torch.bfloat16)
        assert "triton_moe_route_rows" in counters()["moe_route_rows"]
        want = fused.moe_route_reference(idx, w, 8, True)
        assert all(torch.equal(a, b) for a, b in zip(got[:5], want)) and torch.equal(got[5], xr[want[3]])
        def accepted(T):
            ids = torch.zeros(T, 6, dtype=torch.long, device="cuda")
            return fused_gpu.moe_route_rows_ok(torch.zeros(T, 64, device="cuda"), ids, ids.float(), 8, True,
                                               torch.float32)

        # past one block's pairs (700 tokens x 7) the composition serves; 500 x 7 fit (the control)
        assert accepted(500) and not accepted(700)
        table = torch.randn(1000, 4096, device="cuda").bfloat16()
        ids = torch.randint(0, 1000, (256,), device="cuda")
        reset_counters()
        got = fused.embed_streams(ids, table, 4)
        assert "triton_embed_streams" in counters()["embed_streams"]
        assert torch.equal(got, fused.embed_streams_reference(ids, table, 4))
