"""Fast mode's narrow projections of bf16 rows (``kernels/triton_wide.py``) under the interpreter:
``hc_pre`` and ``linear_widened`` against float64, a row alone == the row in a batch, the three
bf16 parts of an fp32 weight (their inverse control: the top part alone is far off), and the
dispatch keys (fast mode on CUDA only; invariant mode keeps the slice kernels)."""

import pytest
import torch

from v4stack.ops import fused

tw = pytest.importorskip("v4stack.kernels.triton_wide")
g = torch.Generator().manual_seed(3)
SMALL = dict(BM=16, KC=128, BK=64, num_warps=4, num_stages=1)  # K = 320: three chunks, the last one cut


def _coeffs(n=4):
    return torch.rand(3, generator=g) + 0.5, torch.randn(n * n + 2 * n, generator=g)


def test_hc_pre_wide_matches_float64_and_is_row_local():
    x = torch.randn(19, 4, 80, generator=g).bfloat16()
    fn = torch.randn(24, 320, generator=g) * 0.05
    scale, base = _coeffs()
    got = tw.hc_pre(x, fn, scale, base, 4, 20, 1e-6, 1e-6, tile=SMALL)
    want = fused.hc_pre_reference(x.double(), fn.double(), scale.double(), base.double(), 4, 20, 1e-6, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-6, rtol=2e-6)
    alone = tw.hc_pre(x[17:18].clone(), fn, scale, base, 4, 20, 1e-6, 1e-6, tile=SMALL)
    assert all(torch.equal(a[0], b[17]) for a, b in zip(alone, got))


@pytest.mark.parametrize("with_weight", [True, False])
def test_hc_pre_read_norm_wide_is_the_two_ops_and_row_local(with_weight):
    """One launch for the coefficients' finish and the read with its norm: against float64 (the
    composition of the two references), a row alone == the row in the batch, and the same as the
    wide ``hc_pre`` followed by ``hc_read_norm``'s kernel (the pre it reads is the one it stored)."""
    from v4stack.kernels import triton_rows as trw

    x = torch.randn(13, 4, 80, generator=g).bfloat16()
    fn = torch.randn(24, 320, generator=g) * 0.05
    scale, base = _coeffs()
    wt = (torch.rand(80, generator=g) + 0.5).bfloat16() if with_weight else None
    y, post, comb = tw.hc_pre_read_norm(x, fn, scale, base, 4, 20, 1e-6, 1e-6, wt, 1e-5, tile=SMALL)
    xd = x.double()
    want = fused.hc_pre_read_norm_reference(xd, fn.double(), scale.double(), base.double(), 4, 20, 1e-6, 1e-6,
                                            None if wt is None else wt.double(), 1e-5)
    torch.testing.assert_close(post.double(), want[1], atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(comb.double(), want[2], atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(y.double(), want[0], atol=3e-2, rtol=2e-2)  # bf16 output
    pre, post2, comb2 = tw.hc_pre(x, fn, scale, base, 4, 20, 1e-6, 1e-6, tile=SMALL)
    assert torch.equal(post, post2) and torch.equal(comb, comb2)
    assert torch.equal(y, trw.hc_read_norm(x, pre, wt, 1e-5))
    alone = tw.hc_pre_read_norm(x[9:10].clone(), fn, scale, base, 4, 20, 1e-6, 1e-6, wt, 1e-5, tile=SMALL)
    assert all(torch.equal(a[0], b[9]) for a, b in zip(alone, (y, post, comb)))
    # inverse control: another sublayer's pre (the rows reversed) reads other inputs
    assert not torch.equal(trw.hc_read_norm(x, pre.flip(0), wt, 1e-5), y)


def test_hc_head_pre_wide_matches_float64_and_is_row_local():
    x = torch.randn(11, 4, 80, generator=g).bfloat16()
    fn = torch.randn(4, 320, generator=g) * 0.05
    scale, base = torch.rand(1, generator=g) + 0.5, torch.randn(4, generator=g)
    got = tw.hc_head_pre(x, fn, scale, base, 1e-6, 1e-6, tile=SMALL)
    want = fused.hc_head_pre_reference(x.double(), fn.double(), scale.double(), base.double(), 1e-6, 1e-6)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)
    assert torch.equal(tw.hc_head_pre(x[4:5].clone(), fn, scale, base, 1e-6, 1e-6, tile=SMALL)[0], got[4])
    # inverse control: without the RMS factor (a norm eps that swamps the rows' mean square) it is far off
    assert not torch.allclose(tw.hc_head_pre(x, fn, scale, base, 1e-6, 1e3, tile=SMALL), got, atol=1e-3)


@pytest.mark.parametrize("with_weight", [True, False])
def test_hc_head_read_norm_wide_is_the_head_weights_then_the_read_norm(with_weight):
    """One launch for the head projection's finish, its stream weights and the read with the final
    norm: against float64, a row alone == the row in the batch, and the same bits as the wide
    ``hc_head_pre`` followed by ``hc_read_norm``'s kernel. Inverse control: other stream weights
    (the rows' order reversed) give another input."""
    from v4stack.kernels import triton_rows as trw

    x = torch.randn(13, 4, 80, generator=g).bfloat16()
    fn = torch.randn(4, 320, generator=g) * 0.05
    scale, base = torch.rand(1, generator=g) + 0.5, torch.randn(4, generator=g)
    wt = (torch.rand(80, generator=g) + 0.5).bfloat16() if with_weight else None
    y = tw.hc_head_read_norm(x, fn, scale, base, 1e-6, 1e-6, wt, 1e-5, tile=SMALL)
    want = fused.hc_head_read_norm_reference(x.double(), fn.double(), scale.double(), base.double(), 1e-6, 1e-6,
                                             None if wt is None else wt.double(), 1e-5)
    torch.testing.assert_close(y.double(), want, atol=3e-2, rtol=2e-2)  # bf16 output
    pre = tw.hc_head_pre(x, fn, scale, base, 1e-6, 1e-6, tile=SMALL)
    assert torch.equal(y, trw.hc_read_norm(x, pre, wt, 1e-5))
    alone = tw.hc_head_read_norm(x[9:10].clone(), fn, scale, base, 1e-6, 1e-6, wt, 1e-5, tile=SMALL)
    assert torch.equal(alone[0], y[9])
    assert not torch.equal(trw.hc_read_norm(x, pre.flip(0), wt, 1e-5), y)


def test_weight_parts_sum_to_the_fp32_weight():
    """The projection with an fp32 weight is as close to float64 as fp32 allows; the same rows
    against the weight's top bf16 part alone (what one bf16 MMA would use) are ~1000x further."""
    x = torch.randn(8, 512, generator=g).bfloat16()
    w = torch.randn(8, 512, generator=g)
    got = tw.linear_widened(x, w, tile=SMALL)
    exact = x.double() @ w.double().T
    err = (got.double() - exact).abs().max().item()
    assert err < 2e-5
    top = tw.linear_widened(x, w.bfloat16(), tile=SMALL)  # the inverse control: one part only
    assert (top.double() - exact).abs().max().item() > 100 * err


def test_linear_widened_bf16_weight_is_exact_products_and_row_local():
    x = torch.randn(21, 320, generator=g).bfloat16()
    w = torch.randn(8, 320, generator=g).bfloat16()
    got = tw.linear_widened(x, w, tile=SMALL)
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, atol=2e-5, rtol=1e-6)
    alone = tw.linear_widened(x[5:6].clone(), w, tile=SMALL)
    assert torch.equal(alone[0], got[5])
    assert torch.equal(tw.linear_widened(x, w, w.float(), SMALL), got)  # the dispatch's arguments
    ref = fused.linear_widened_reference(x, w, w.float())
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-6)


@pytest.mark.parametrize("hashed", [False, True])
def test_router_sums_the_logits_partials_in_the_gate_with_their_bits(hashed):
    """``triton_wide.router``: the gate's kernel adds the logits' slice partials itself - the same
    expert ids and weights, bit for bit, as ``linear_widened`` then the gate on its logits (K = 320:
    three slices, the last one cut); a token alone as in the batch."""
    from v4stack.kernels import triton_route as trt

    T, E, k = 21, 8, 3
    x = torch.randn(T, 320, generator=g).bfloat16()
    w = torch.randn(E, 320, generator=g) * 0.05
    bias = None if hashed else torch.randn(E, generator=g) * 0.1
    table = torch.randint(0, E, (50, k), generator=g, dtype=torch.int32) if hashed else None
    ids = torch.randint(0, 50, (T,), generator=g) if hashed else None
    got = tw.router(x, w, w, bias, table, ids, k, 2.5, tile=SMALL)
    want = trt.moe_gate(tw.linear_widened(x, w, w, SMALL), bias, table, ids, k, 2.5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref = fused.moe_gate_reference(x.double() @ w.double().T, None if bias is None else bias.double(), table, ids,
                                   k, 2.5)
    torch.testing.assert_close(got[1].double(), ref[1], atol=1e-5, rtol=1e-5)
    one = tw.router(x[7:8].clone(), w, w, bias, table, None if ids is None else ids[7:8].clone(), k, 2.5, tile=SMALL)
    assert torch.equal(one[0][0], got[0][7]) and torch.equal(one[1][0], got[1][7])
    if not hashed:  # inverse control: the partials of other rows route otherwise
        other = tw.router(x.flip(0), w, w, bias, table, ids, k, 2.5, tile=SMALL)
        assert not torch.equal(other[1], got[1])


def test_wide_kernels_take_fast_mode_on_cuda_only():
    from v4stack.kernels import fused_gpu
    from v4stack.ops.dispatch import _candidates

    assert [i.name for i in _candidates(("hc_pre", "fast", "bfloat16", "cuda"))][:2] == ["triton_hc_pre_wide",
                                                                                         "triton_hc_pre"]
    assert [i.name for i in _candidates(("hc_head_pre", "fast", "bfloat16", "cuda"))][0] == "triton_hc_head_pre_wide"
    assert [i.name for i in _candidates(("hc_pre_read_norm", "fast", "bfloat16", "cuda"))][0] == \
        "triton_hc_pre_read_norm_wide"
    assert [i.name for i in _candidates(("hc_pre_read_norm", "invariant", "bfloat16", "cuda"))] == ["composite"]
    assert [i.name for i in _candidates(("hc_head_read_norm", "fast", "bfloat16", "cuda"))][0] == \
        "triton_hc_head_read_norm_wide"
    assert [i.name for i in _candidates(("hc_head_read_norm", "invariant", "bfloat16", "cuda"))] == ["composite"]
    assert [i.name for i in _candidates(("router", "fast", "bfloat16", "cuda"))][0] == "triton_router_wide"
    assert [i.name for i in _candidates(("router", "invariant", "bfloat16", "cuda"))] == ["composite"]
    assert "triton_hc_pre_wide" not in [i.name for i in _candidates(("hc_pre", "invariant", "bfloat16", "cuda"))]
    assert "triton_linear_widened" not in [i.name for i in _candidates(("linear_widened", "invariant", "bfloat16",
                                                                         "cuda"))]
    x = torch.empty(4, 64, dtype=torch.bfloat16)
    # a CPU tensor, fp16 rows and a weight too tall for one tile are all refused
    assert not fused_gpu.linear_widened_ok(x, torch.empty(8, 64), torch.empty(8, 64))
    assert not fused_gpu.linear_widened_ok(x.half(), torch.empty(8, 64), torch.empty(8, 64))


def test_fused_read_norm_is_for_decode_sized_calls(monkeypatch):
    """The fused coefficients-and-read launch takes up to ``READ_NORM_FUSED_ROWS`` rows (where it was
    measured faster); a prefill's rows take the two launches. Control: the same call at the bound
    is accepted, so the refusal is the row count's."""
    from v4stack.kernels import fused_gpu

    monkeypatch.setattr(fused_gpu, "hc_pre_wide_ok", lambda *a: True)  # the device checks, on the CPU
    weight, rows = torch.empty(4096, device="meta"), fused_gpu.READ_NORM_FUSED_ROWS

    def ok(m):
        x = torch.empty(m, 4, 4096, device="meta")
        return fused_gpu.hc_pre_read_norm_wide_ok(x, None, None, None, 4, 20, 1e-6, 1e-6, weight, 1e-5)

    assert ok(rows) and ok(1)
    assert not ok(rows + 1) and not ok(4096)
    monkeypatch.setattr(fused_gpu, "hc_head_pre_wide_ok", lambda *a: True)

    def head_ok(m):
        x = torch.empty(m, 4, 4096, device="meta")
        return fused_gpu.hc_head_read_norm_wide_ok(x, None, None, None, 1e-6, 1e-6, weight, 1e-5)

    assert head_ok(rows) and head_ok(1)
    assert not head_ok(rows + 1) and not head_ok(4096)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_wide_kernels_on_the_device_at_v4_widths():
    """On the GPU at V4-Flash widths (streams 4 x 4096, router 8 x 4096): fast mode's dispatch
    runs the wide kernels, within fp32 rounding of float64, a row alone as in its batch."""
    from v4stack import ops

    x = torch.randn(256, 4, 4096, device="cuda").bfloat16()
    fn = torch.randn(24, 16384, device="cuda") * 0.01
    scale, base = (t.cuda() for t in _coeffs())
    want = fused.hc_pre_reference(x.double(), fn.double(), scale.double(), base.double(), 4, 20, 1e-6, 1e-6)
    ops.reset_counters()
    with ops.mode("fast"):
        got = fused.hc_pre(x, fn, scale, base, 4, 20, 1e-6, 1e-6)
        alone = fused.hc_pre(x[100:101].clone(), fn, scale, base, 4, 20, 1e-6, 1e-6)
        r = torch.randn(256, 4096, device="cuda").bfloat16()
        w = (torch.randn(8, 4096, device="cuda") * 0.02).bfloat16()
        logits = fused.linear_widened(r, w, w.float())
        fh = torch.randn(4, 16384, device="cuda") / 64
        sh, bh = torch.rand(1, device="cuda") + 0.5, torch.randn(4, device="cuda")
        head = fused.hc_head_pre(x, fh, sh, bh, 1e-6, 1e-6)
        nw = (torch.rand(4096, device="cuda") + 0.5).bfloat16()
        hy = fused.hc_head_read_norm(x, fh, sh, bh, 1e-6, 1e-6, nw, 1e-6)
        hy_alone = fused.hc_head_read_norm(x[7:8].clone(), fh, sh, bh, 1e-6, 1e-6, nw, 1e-6)
        hy2 = fused.hc_read_norm(x, head, nw, 1e-6)
        y, post, comb = fused.hc_pre_read_norm(x, fn, scale, base, 4, 20, 1e-6, 1e-6, nw, 1e-6)
        y2 = fused.hc_read_norm(x, got[0], nw, 1e-6)
        rb = torch.randn(8, device="cuda") * 0.1
        routed = fused.router(r, w, w.float(), rb, None, None, 6, 2.5)
        gated = fused.moe_gate(logits, rb, None, None, 6, 2.5)
    assert "triton_router_wide" in str(ops.counters())
    assert torch.equal(routed[0], gated[0]) and torch.equal(routed[1], gated[1])  # the logits' bits, summed in the gate
    assert "triton_hc_head_pre_wide" in str(ops.counters())
    assert "triton_hc_head_read_norm_wide" in str(ops.counters())
    # the head's one launch against its two ops (what a trainer hook runs): the same bits; a row
    # alone as in its batch
    assert torch.equal(hy, hy2) and torch.equal(hy_alone[0], hy[7])
    assert "triton_hc_pre_read_norm_wide" in str(ops.counters())
    # the one launch against the two: the coefficients within rounding (its reductions run in eight
    # warps), the input as the norm of the read
    torch.testing.assert_close(post, got[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(comb, got[2], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(y.float(), y2.float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(head.double(), fused.hc_head_pre_reference(x.double(), fh.double(), sh.double(),
                                                                          bh.double(), 1e-6, 1e-6),
                               atol=1e-5, rtol=1e-5)
    assert "triton_hc_pre_wide" in str(ops.counters()) and "triton_linear_widened" in str(ops.counters())
    from v4stack.kernels import fused_gpu

    assert not fused_gpu.refused, fused_gpu.refused  # neither kernel raised and fell back to its reference
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a[0], b[100]) for a, b in zip(alone, got))
    torch.testing.assert_close(logits.double(), r.double() @ w.double().T, atol=1e-5, rtol=1e-6)


def test_wide_kernels_build_for_hopper_on_bf16_wgmma():
    """``kernels/builds.py``: the partials kernel (fp32 weight in parts, and a bf16 weight), the
    coefficients' finish with the read, and the greedy block kernels compile for sm_90a with correctly rounded arithmetic; the projections run
    on bf16 ``wgmma`` (no TF32 anywhere), the fp32 weight's parts rounded to nearest."""
    from tests.ops.hopper import check, ptx

    got = ptx(("wide_partials", "wide_partials_bf16w", "greedy_blocks", "greedy_lean", "moe_route_one",
               "finish_read_norm", "finish_head_read_norm"))
    check(got)
    for name in ("wide_partials", "wide_partials_bf16w"):
        assert "wgmma.mma_async" in got[name] and ".bf16" in got[name], name
    assert "cvt.rn.bf16" in got["wide_partials"]  # the split's rounding (the bf16-weight build has none)
