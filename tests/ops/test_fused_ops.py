"""The fused decode-path ops (``ops/fused.py``): the Triton kernels under the interpreter against
float64 references, row-locality (a row alone == the row in a batch), and the dispatch keys."""

import pytest
import torch

from v4stack import ops
from v4stack.ops import fused

tm = pytest.importorskip("v4stack.kernels.triton_mhc")
g = torch.Generator().manual_seed(0)


def _mix(N, n=4):
    return torch.randn(N, n * n + 2 * n, generator=g) * 2, torch.rand(3, generator=g) + 0.5, torch.randn(n * n + 2 * n, generator=g)


def test_hc_split_kernel_matches_float64_and_is_row_local():
    mix, scale, base = _mix(37)
    pre, post, comb = tm.hc_split(mix, scale, base, 4, 20, 1e-6)
    want = fused.hc_split_reference(mix.double(), scale.double(), base.double(), 4, 20, 1e-6)
    for got, ref in zip((pre, post, comb), want):
        torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=2e-6)
    alone = tm.hc_split(mix[20:21].clone(), scale, base, 4, 20, 1e-6)
    for a, b in zip(alone, (pre, post, comb)):
        assert torch.equal(a[0], b[20])
    # inverse control: fewer Sinkhorn rounds give a different projection
    assert not torch.allclose(tm.hc_split(mix, scale, base, 4, 2, 1e-6)[2], comb, atol=1e-4)


def test_hc_pre_kernel_matches_float64_and_is_row_local(monkeypatch):
    """hc_pre against float64, a row alone as in the batch, and the bits of the projection then
    the split; at 9 rows the projection's tile sums its partials in a second launch, which then
    does the split as well (the fused launch is seen taken: the bits are checked on it)."""
    from v4stack.kernels import triton_gemm as tg

    x = torch.randn(9, 4, 80, generator=g).bfloat16()  # K = 320: two fixed slices, the last one cut
    fn = torch.randn(24, 320, generator=g) * 0.05
    _, scale, base = _mix(1)
    fused_split = []
    mix = tg.hc_mix

    def spy(*a, **kw):
        out = mix(*a, **kw)
        fused_split.append(kw.get("finish") is not None and out[1] is not None)
        return out

    monkeypatch.setattr(tg, "hc_mix", spy)
    got = tm.hc_pre(x, fn, scale, base, 4, 20, 1e-6, 1e-6)
    monkeypatch.setattr(tg, "hc_mix", mix)
    assert fused_split == [True]
    want = fused.hc_pre_reference(x.double(), fn.double(), scale.double(), base.double(), 4, 20, 1e-6, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
    alone = tm.hc_pre(x[6:7].clone(), fn, scale, base, 4, 20, 1e-6, 1e-6)
    assert all(torch.equal(a[0], b[6]) for a, b in zip(alone, got))
    # the bits of the projection then the split, called one after the other
    two = tm.hc_split(tg.hc_mix(x.reshape(9, -1).float(), fn, 1e-6), scale, base, 4, 20, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, two))


@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_swiglu_act_kernel_matches_float64(limit):
    gate, up, w = torch.randn(5, 1100, generator=g) * 2, torch.randn(5, 1100, generator=g) * 2, torch.rand(5, generator=g)
    for weight in (None, w):
        got = tm.swiglu_act(gate.bfloat16(), up.bfloat16(), limit, weight, torch.float32)
        want = fused.swiglu_act_reference(gate.bfloat16().double(), up.bfloat16().double(), limit,
                                          None if weight is None else weight.double(), torch.float64)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert got.abs().max() <= (limit * limit * w.max() if limit else float("inf"))


def test_hc_head_pre_kernel_matches_float64_and_is_row_local():
    """The head's stream weights from bf16 streams read in the projection's kernel: against float64
    of the same formula (the composite), a row alone as in the batch; the control: another bias."""
    x = (torch.randn(11, 4, 64, generator=g) * 2).bfloat16()
    fn, scale, base = torch.randn(4, 256, generator=g) / 8, torch.rand(1, generator=g) + 0.5, torch.randn(4, generator=g)
    got = tm.hc_head_pre(x, fn, scale, base, 1e-6, 1e-6)
    want = fused.hc_head_pre_reference(x.double(), fn.double(), scale.double(), base.double(), 1e-6, 1e-6)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(tm.hc_head_pre(x[3:4].clone(), fn, scale, base, 1e-6, 1e-6)[0], got[3])
    assert not torch.allclose(tm.hc_head_pre(x, fn, scale, base + 0.5, 1e-6, 1e-6), got, atol=1e-3)


@pytest.mark.parametrize("D", [300, 2500, 5000])
def test_hc_read_norm_kernel_is_the_read_then_the_norm_and_row_local(D):
    """The mHC read and the RMS norm in one row kernel: against float64 of the read rounded to the
    streams' dtype then the norm, in one block (up to 4096 wide) and in several; a row alone gives the bits
    it gets in a batch. The control: other read weights change the output."""
    tr = pytest.importorskip("v4stack.kernels.triton_rows")
    x = (torch.randn(9, 4, D, generator=g) * 3).bfloat16()
    pre = torch.rand(9, 4, generator=g) + 0.1
    w = (torch.rand(D, generator=g) + 0.5).bfloat16()
    got = tr.hc_read_norm(x, pre, w, 1e-6)
    read = (pre[:, :, None].double() * x.double()).sum(1).bfloat16().double()
    want = read * torch.rsqrt(read.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)
    assert torch.equal(tr.hc_read_norm(x[4:5].clone(), pre[4:5].clone(), w, 1e-6)[0], got[4])
    assert torch.equal(tr.hc_read_norm(x, pre, None, 1e-6), tr.rms_norm(tr.hc_read(x, pre), None, 1e-6))
    assert not torch.allclose(tr.hc_read_norm(x, pre.flip(1), w, 1e-6).float(), got.float(), atol=1e-2)
    assert torch.equal(fused.hc_read_norm(x, pre, w, 1e-6), fused.hc_read_norm_reference(x, pre, w, 1e-6))


@pytest.mark.parametrize("shape", [(5, 3, 48), (6, 40)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_kernel_matches_float64(shape, inverse):
    x = torch.randn(*shape, generator=g)
    pos = torch.randint(0, 70000, (shape[0],), generator=g)
    freqs = 1.0 / (1e4 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    got = tm.rope(x, pos, freqs, inverse)
    want = fused.rope_reference(x.double(), pos, freqs, inverse)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[..., : shape[-1] - 16], x[..., : shape[-1] - 16])
    back = fused.rope_reference(got.double(), pos, freqs, not inverse)
    torch.testing.assert_close(back, x.double(), atol=1e-5, rtol=1e-5)  # the inverse undoes it


def test_cpu_calls_run_the_composite_reference_in_both_modes():
    mix, scale, base = _mix(3)
    for m in ("fast", "invariant"):
        with ops.mode(m):
            ops.reset_counters()
            fused.hc_split(mix, scale, base, 4, 3, 1e-6)
            assert ops.counters()["hc_split"] == {"torch_composite": 1}
    from v4stack.kernels.fused_gpu import hc_split_ok, rope_ok

    assert not hc_split_ok(mix, scale, base, 4, 3, 1e-6)  # CPU tensors: the kernel's contract refuses
    assert not rope_ok(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.float64), False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_kernels_on_cuda_match_float64_and_are_row_local():
    from v4stack.kernels.fused_gpu import hc_split_ok

    mix, scale, base = (t.cuda() for t in _mix(300))
    assert hc_split_ok(mix, scale, base, 4, 20, 1e-6)
    for m in ("fast", "invariant"):
        with ops.mode(m):
            ops.reset_counters()
            got = fused.hc_split(mix, scale, base, 4, 20, 1e-6)
            assert ops.counters()["hc_split"] == {"triton_hc_split": 1}
            alone = fused.hc_split(mix[123:124].clone(), scale, base, 4, 20, 1e-6)
            assert all(torch.equal(a[0], b[123]) for a, b in zip(alone, got))
    want = fused.hc_split_reference(mix.double(), scale.double(), base.double(), 4, 20, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-6, rtol=2e-6)
    from v4stack.kernels import fused_gpu

    assert not fused_gpu.refused, fused_gpu.refused  # no kernel fell back to its reference
    xs = torch.randn(70, 4, 4096, device="cuda").bfloat16()
    fn = torch.randn(24, 4 * 4096, device="cuda") * 0.01
    for m in ("fast", "invariant"):
        with ops.mode(m):
            ops.reset_counters()
            got = fused.hc_pre(xs, fn, scale, base, 4, 20, 1e-6, 1e-6)
            # fast mode: triton_wide's kernels (tests/ops/test_wide.py); the bits below are invariant mode's
            assert ops.counters()["hc_pre"] == {"triton_hc_pre_wide" if m == "fast" else "triton_hc_pre": 1}
            alone = fused.hc_pre(xs[33:34].clone(), fn, scale, base, 4, 20, 1e-6, 1e-6)
            assert not fused_gpu.refused, fused_gpu.refused
            assert all(torch.equal(a[0], b[33]) for a, b in zip(alone, got))
    from v4stack.kernels import triton_gemm as tg  # hc_pre's bits are hc_mix's then hc_split's

    two = fused.hc_split(tg.hc_mix(xs.reshape(70, -1).float(), fn, 1e-6), scale, base, 4, 20, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, two))
    want = fused.hc_pre_reference(xs.double(), fn.double(), scale.double(), base.double(), 4, 20, 1e-6, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
    x = torch.randn(50, 8, 512, device="cuda").bfloat16()
    pos = torch.randint(0, 100000, (50,), device="cuda")
    freqs = (1.0 / (1e4 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))).cuda()
    ops.reset_counters()
    y = fused.rope(x, pos, freqs)
    assert ops.counters()["rope"] == {"triton_rope": 1}
    torch.testing.assert_close(y.double(), fused.rope_reference(x.double(), pos, freqs, False), atol=2e-2, rtol=1e-2)
    assert torch.equal(fused.rope(x[7:8].clone(), pos[7:8], freqs)[0], y[7])
    xs3 = (torch.randn(70, 4, 4096, device="cuda") * 3).bfloat16()
    pre3 = torch.rand(70, 4, device="cuda") + 0.1
    w3 = (torch.rand(4096, device="cuda") + 0.5).bfloat16()
    for mode in ("invariant", "fast"):
        with ops.mode(mode):
            ops.reset_counters()
            rn = fused.hc_read_norm(xs3, pre3, w3, 1e-6)
            assert ops.counters()["hc_read_norm"] == {"triton_hc_read_norm": 1}
            assert torch.equal(fused.hc_read_norm(xs3[33:34].clone(), pre3[33:34].clone(), w3, 1e-6)[0], rn[33])
    torch.testing.assert_close(rn.double(), fused.hc_read_norm_reference(xs3.cpu().double(), pre3.cpu().double(),
                                                                         w3.cpu().double(), 1e-6).cuda(),
                               atol=3e-2, rtol=2e-2)
    # the head's stream weights from the bf16 streams (read in the projection's kernel): the bits of
    # the projection of the streams copied to fp32, then the sigmoid
    fnh = torch.randn(4, 4 * 4096, device="cuda") / 64
    sch, bah = torch.rand(1, device="cuda") + 0.5, torch.randn(4, device="cuda")
    with ops.mode("invariant"):
        ops.reset_counters()
        ph = fused.hc_head_pre(xs3, fnh, sch, bah, 1e-6, 1e-6)
        assert ops.counters()["hc_head_pre"] == {"triton_hc_head_pre": 1}
        mixh = ops.hc_mix(xs3.reshape(70, -1).float(), fnh, 1e-6)
        torch.testing.assert_close(ph, torch.sigmoid(mixh * sch + bah) + 1e-6, atol=1e-6, rtol=1e-6)
        assert torch.equal(fused.hc_head_pre(xs3[5:6].clone(), fnh, sch, bah, 1e-6, 1e-6)[0], ph[5])
    gt, up, rw = (torch.randn(33, 2048, device="cuda") * 3).bfloat16(), torch.randn(33, 2048, device="cuda").bfloat16(), \
        torch.rand(33, device="cuda")
    ops.reset_counters()
    act = fused.swiglu_act(gt, up, 10.0, rw, torch.bfloat16)
    assert ops.counters()["swiglu_act"] == {"triton_swiglu_act": 1}
    torch.testing.assert_close(act.double(), fused.swiglu_act_reference(gt.double(), up.double(), 10.0, rw.double(),
                                                                         torch.float64), atol=2e-2, rtol=1e-2)
    o, w = torch.randn(5, 8, 64, device="cuda").bfloat16(), torch.randn(8, 32, 64, device="cuda").bfloat16()
    with ops.mode("fast"):
        torch.testing.assert_close(fused.group_linear(o, w).float(), fused.group_linear_reference(o, w).float(),
                                   atol=1e-2, rtol=1e-2)
    # invariant mode: wo_a as one grouped GEMM reading each group's rows in place (from 64 rows), a row's
    # bits the same alone (the gathered rows' path) and in a batch, and those of the gathered rows
    from v4stack.kernels.fused_gpu import group_linear_rows

    o, w = torch.randn(70, 8, 512, device="cuda").bfloat16(), torch.randn(8, 128, 512, device="cuda").bfloat16() / 20
    with ops.mode("invariant"):
        ops.reset_counters()
        y = fused.group_linear(o, w)
        assert ops.counters()["group_linear"] == {"grouped_in_place": 1}
        assert torch.equal(y, group_linear_rows(o, w))
        ops.reset_counters()
        assert torch.equal(fused.group_linear(o[40:41].clone(), w)[0], y[40])
        assert ops.counters()["group_linear"] == {"grouped_rows": 1}
    torch.testing.assert_close(y.double(), fused.group_linear_reference(o.double(), w.double()), atol=2e-2, rtol=2e-2)


def test_group_linear_as_grouped_rows_is_the_per_group_linears():
    """The CUDA path of invariant ``group_linear`` (one ``grouped_linear`` whose experts are the
    groups): its arithmetic is the per-group linears' (here through the CPU references, bit for
    bit); the registration takes CUDA tensors only."""
    from v4stack.kernels.fused_gpu import group_linear_ok, group_linear_rows

    x, w = torch.randn(5, 4, 24, generator=g), torch.randn(4, 6, 24, generator=g)
    for dt in (torch.float32, torch.bfloat16):
        with ops.mode("invariant"):
            got = group_linear_rows(x.to(dt), w.to(dt))
            assert torch.equal(got, fused.group_linear_reference(x.to(dt), w.to(dt)))
    assert got.shape == (5, 24) and group_linear_rows(x[:0], w).shape == (0, 24)
    # inverse control: a group's rows taken from another group change its columns
    with ops.mode("invariant"):
        other = group_linear_rows(x.roll(1, dims=1), w)
    assert not torch.equal(other[:, :6], group_linear_rows(x, w)[:, :6])
    assert not group_linear_ok(x, w)


def test_feed_ids_kernel_takes_the_named_draws_in_place():
    """``feed_ids``: rows with ``src >= 0`` take ``fed[src]``, the rest keep their id (the kernel
    under the interpreter equals the composition; several programs: 1500 rows)."""
    from v4stack.kernels import triton_layout as tl_

    T = 1500
    ids = torch.randint(0, 1000, (T,), generator=g)
    fed = torch.randint(1000, 2000, (300,), generator=g)
    src = torch.randint(-1, 300, (T,), generator=g)
    want = fused.feed_ids_reference(ids.clone(), src, fed)
    got = ids.clone()
    assert tl_.feed_ids(got, src, fed) is got and torch.equal(got, want)
    assert torch.equal(want[src < 0], ids[src < 0]) and torch.equal(want[src >= 0], fed[src[src >= 0]])
    ops.reset_counters()
    out = fused.feed_ids(ids.clone(), src, fed)  # CPU: the composition
    assert ops.counters()["feed_ids"] == {"torch_composite": 1} and torch.equal(out, want)
    # inverse control: the sources off by one row take other ids
    assert not torch.equal(tl_.feed_ids(ids.clone(), torch.where(src >= 0, (src + 1) % 300, src), fed), want)


def _layout(R, n, gen):
    """A static step's layout as ``layout_in`` reads it: ids, positions, ends, slots, sources, rest."""
    stage = torch.randint(0, 1 << 40, (n,), generator=gen)
    stage[4 * R : 5 * R] = torch.randint(-1, 300, (R,), generator=gen)
    return stage


def test_layout_in_kernel_copies_the_layout_and_feeds_the_ids():
    """``layout_in``: the buffer takes the staging's every element, except ids whose source is >= 0,
    which take ``fed[src]`` - the kernel under the interpreter (several programs: 2600 elements)
    equals the composition (a copy, then ``feed_ids``), which the CPU dispatch runs."""
    from v4stack.kernels import triton_layout as tl_

    R, n = 256, 2600
    stage, fed = _layout(R, n, g), torch.randint(1000, 2000, (300,), generator=g)
    ref = torch.zeros(n, dtype=torch.long)
    fused.layout_in_reference(ref, stage, fed, R)
    got = torch.full((n,), -7, dtype=torch.long)
    assert tl_.layout_in(got, stage, fed, R) is got and torch.equal(got, ref)
    src = stage[4 * R : 5 * R]
    assert torch.equal(got[R:], stage[R:]) and torch.equal(got[:R][src < 0], stage[:R][src < 0])
    assert torch.equal(got[:R][src >= 0], fed[src[src >= 0]])
    ops.reset_counters()
    out = torch.zeros(n, dtype=torch.long)
    fused.layout_in(out, stage, fed, R)  # CPU: the composition
    assert ops.counters()["layout_in"] == {"torch_composite": 1} and torch.equal(out, ref)
    # inverse control: the sources off by one row take other ids
    shifted = stage.clone()
    shifted[4 * R : 5 * R] = torch.where(src >= 0, (src + 1) % 300, src)
    bad = torch.zeros(n, dtype=torch.long)
    assert not torch.equal(tl_.layout_in(bad, shifted, fed, R)[:R], ref[:R])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layout_in_reads_pinned_staging_inside_a_graph():
    """On CUDA ``layout_in`` reads the pinned staging through the device's mapping: captured once in
    a graph, every replay sees what the host wrote into the staging just before it (the loads skip
    the caches), with the ids fed from the device; the kernel served it (no fallback to the copy).
    The control, a graph holding the capture-time layout, fails the same per-replay check."""
    from v4stack.kernels import fused_gpu

    R, n = 256, 40_000
    gen = torch.Generator().manual_seed(11)
    stage = torch.empty(n, dtype=torch.long).pin_memory()
    fed = torch.randint(1000, 2000, (300,), generator=gen).cuda()
    buf = torch.zeros(n, dtype=torch.long, device="cuda")
    stage.copy_(_layout(R, n, gen))
    ops.reset_counters()
    fused.layout_in(buf, stage, fed, R)  # built outside the capture
    assert ops.counters()["layout_in"] == {"triton_layout_in": 1}
    # inverse control: a graph that holds the layout as it was at capture (a device copy made then)
    snap, stale = stage.cuda(), torch.zeros_like(buf)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph, stale_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            fused.layout_in(buf, stage, fed, R)
        with torch.cuda.graph(stale_graph):
            fused.layout_in(stale, snap, fed, R)  # (a device staging: the composition, a device-to-device copy)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(4):
        host = _layout(R, n, gen)
        stage.copy_(host)
        graph.replay()
        stale_graph.replay()
        want = torch.zeros(n, dtype=torch.long)
        fused.layout_in_reference(want, host, fed.cpu(), R)
        assert torch.equal(buf.cpu(), want)
        assert not torch.equal(stale.cpu(), want)  # the check catches a read of the capture-time layout
    assert not fused_gpu.refused, fused_gpu.refused
