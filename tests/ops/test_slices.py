"""The fixed-K-slice GEMM (``kernels/triton_slices.py``): bf16 linear, fp32 linear (3xTF32) and
hc_mix under Triton's interpreter on the CPU, and the same checks on the GPU (marker ``gpu``).

On the CPU the interpreter multiplies a BK block with NumPy (its own order inside the block), so
the bit comparisons across tiles hold the K step fixed; on the GPU the MMA chain is the same for
every K step of a 16-wide instruction and every candidate of ``tiles.py`` is compared.
"""

import pytest
import torch

ts = pytest.importorskip("v4stack.kernels.triton_slices")
from v4stack.kernels import tiles  # noqa: E402
from v4stack.kernels import triton_gemm as tg  # noqa: E402

g = torch.Generator().manual_seed(3)


def r(*s, scale=1.0):
    return torch.randn(*s, generator=g) * scale


def _run(x, w, tile, split, tf32x3, dtype):
    return ts.run(x, w, torch.empty(x.shape[0], w.shape[0], dtype=dtype), tile, split, tf32x3)


def _same_step(cands, bk):
    return [t for t in cands if t["BK"] == bk and not t.get("tma")]


def test_bf16_every_form_and_tile_gives_the_same_bits_alone_or_in_a_batch():
    x, w = r(70, 300).bfloat16(), r(40, 300).bfloat16()
    split = 128  # three slices, the last one cut at K = 300
    cands = _same_step(tiles.HALF_CANDIDATES, 64)
    assert {t.get("grid", False) for t in cands} == {True, False}  # both forms are compared
    ys = [_run(x, w, t, split, False, torch.bfloat16) for t in cands]
    assert all(torch.equal(y, ys[0]) for y in ys)
    deep = _same_step(tiles.HALF_CANDIDATES, 128)  # the BK = 128 tiles agree among themselves too
    assert {t.get("grid", False) for t in deep} == {True, False}
    yd = [_run(x, w, t, split, False, torch.bfloat16) for t in deep]
    assert all(torch.equal(y, yd[0]) for y in yd)
    for i in (0, 33, 69):
        assert torch.equal(_run(x[i:i + 1], w, cands[0], split, False, torch.bfloat16)[0], ys[0][i])
    want = (x.double() @ w.double().T)
    torch.testing.assert_close(ys[0].double(), want, atol=0.3, rtol=1e-2)
    # the order is the slices': a row summed in other slices is rounded differently (inverse control)
    other = _run(x, w, cands[0], 64, False, torch.bfloat16)
    assert not torch.equal(other, ys[0])
    assert ts.counters("cpu").abs().sum() == 0  # every grid-form launch leaves its counters at zero


def test_tma_kernels_give_the_slices_kernel_bits():
    from v4stack.kernels import triton_tma as tt

    # the second half of K cancels the first product for product: the exact result is 0 and what
    # the kernel returns is rounding, which depends on how K is cut into slices (the inverse control)
    h, w0 = r(70, 256).bfloat16(), r(96, 256).bfloat16()
    x, w = torch.cat([h, -h[:, 128:], -h[:, :128]], 1), torch.cat([w0, w0[:, 128:], w0[:, :128]], 1)
    y = [torch.empty(70, 96, dtype=torch.bfloat16) for _ in range(3)]
    tt.linear_tma(x, w, y[0], BM=64, BN=32, BK=64, num_warps=4, SPLIT=128, GRID=True, UNR=2)  # program per slice
    tt.linear_tma(x, w, y[1], BM=64, BN=32, BK=64, num_warps=4, SPLIT=128)  # persistent
    want = _run(x, w, dict(BM=64, BN=32, BK=64, num_warps=4, num_stages=2), 128, False, torch.bfloat16)
    assert torch.equal(y[0], want) and torch.equal(y[1], want)
    assert ts.counters("cpu").abs().sum() == 0
    tt.linear_tma(x, w, y[2], BM=64, BN=32, BK=64, num_warps=4, SPLIT=64, GRID=True, UNR=2)
    assert not torch.equal(y[2], want)  # inverse control: other slices, other bits


def test_fp32_is_3xtf32_accurate_and_the_same_in_every_form():
    x, w = r(65, 300), r(33, 300)  # two slices, the last one cut
    want = x.double() @ w.double().T
    cands = _same_step(tiles.F32_CANDIDATES, tiles.F32_BK)
    assert len(cands) == len(tiles.F32_CANDIDATES)  # fp32 candidates all use the fixed K step
    ys = [_run(x, w, t, tiles.F32_SPLIT, True, torch.float32) for t in cands]
    assert all(torch.equal(y, ys[0]) for y in ys)
    assert torch.equal(_run(x[7:8], w, cands[0], tiles.F32_SPLIT, True, torch.float32)[0], ys[0][7])
    scale = want.abs().max()
    err = ((ys[0].double() - want).abs().max() / scale).item()
    sgemm = (((x @ w.T).double() - want).abs().max() / scale).item()  # fp32 GEMM on the CPU
    assert err <= 8 * sgemm, (err, sgemm)
    # inverse control: one TF32 product (hi * hi, no correction terms) is far less accurate
    hi = lambda t: (t.view(torch.int32) & -8192).view(torch.float32)  # noqa: E731
    one = (((hi(x).double() @ hi(w).double().T) - want).abs().max() / scale).item()
    assert one > 50 * err, (one, err)


def test_tf32_split_is_exact_in_tf32_and_close_to_the_input():
    x = torch.cat([r(4000), torch.tensor([0.0, -0.0, 1e-30, -3e30, 1.0, -1.0])])
    hi = (x.view(torch.int32) & -8192).view(torch.float32)
    lo = (((x - hi).view(torch.int32) + 4096) & -8192).view(torch.float32)
    assert torch.equal(hi.view(torch.int32) & 8191, torch.zeros_like(x, dtype=torch.int32))
    assert torch.equal(lo.view(torch.int32) & 8191, torch.zeros_like(x, dtype=torch.int32))
    rel = ((hi.double() + lo.double() - x.double()).abs() / x.double().abs().clamp(min=1e-300))
    assert rel.max() <= 2.0 ** -21


def test_hc_mix_tiles_agree_and_match_float64():
    f, fn = r(9, 600), r(24, 600, scale=0.05)
    want = (f.double() @ fn.double().T) / torch.sqrt((f.double() ** 2).mean(-1, keepdim=True) + 1e-6)
    ys = [tg.hc_mix(f, fn, 1e-6, t) for t in tiles.HC_CANDIDATES]
    assert all(torch.equal(y, ys[0]) for y in ys)
    assert torch.equal(tg.hc_mix(f[4:5], fn, 1e-6)[0], ys[0][4])
    torch.testing.assert_close(ys[0].double(), want, atol=1e-5, rtol=1e-5)
    # bf16 streams read and widened in the kernel: the bits of their fp32 copy
    fb = f.bfloat16()
    assert torch.equal(tg.hc_mix(fb, fn, 1e-6), tg.hc_mix(fb.float(), fn, 1e-6))


def test_the_finishing_launch_adds_the_slices_in_order():
    # 38 slices (padded to 64 columns in the finishing launch) over a wide range of magnitudes, so
    # that another order of the adds would round differently; the forms agree bit for bit
    x = r(9, 600) * torch.logspace(-4, 4, 600)
    w = r(5, 600)
    base = dict(BM=16, BN=16, BK=16, num_warps=4, num_stages=2)
    for eps in (None, 1e-6):
        ys = [ts.run(x, w, torch.empty(9, 5), t, 16, True, rms_eps=eps)
              for t in (base, dict(base, grid=True), dict(base, grid=True, two=True))]
        assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])


def test_add_in_order_takes_the_columns_in_order():
    import triton
    import triton.language as tl

    @triton.jit
    def k(X, Y, W: tl.constexpr):
        x = tl.load(X + tl.arange(0, W)[None, None, :] + tl.zeros([1, 2, 1], tl.int32))
        t = ts._add_in_order(tl.zeros([1, 2], tl.float32), x, 1, 2, W)
        tl.store(Y + tl.arange(0, 2)[None, :], t)

    v = (torch.randn(64, generator=g) * torch.logspace(-7, 7, 64)).float()
    y = torch.empty(2)
    k[(1,)](v, y, W=64)
    seq = torch.zeros((), dtype=torch.float32)
    for e in v:
        seq = seq + e
    assert torch.equal(y, seq.expand(2))
    rev = torch.zeros((), dtype=torch.float32)
    for e in v.flip(0):  # inverse control: the reverse order rounds differently
        rev = rev + e
    assert not torch.equal(rev, seq)


def test_calls_captured_in_a_graph_take_the_graph_table(monkeypatch):
    a, b = dict(tiles.HALF_CANDIDATES[5]), dict(tiles.HALF_CANDIDATES[1])
    eager, graph = ((1 << 62, a),), ((1 << 62, b),)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tg._tile(eager, graph, 5, True) == b
    assert tg._tile(eager, graph, 5, False) == a  # tensors off the GPU never ask
    assert tg._tile(eager, eager, 5, True) == a
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert tg._tile(eager, graph, 5, True) == a


def test_the_wrapper_serves_every_bucket():
    x, w = r(3, 600), r(20, 600)
    for m in (1, 70):
        xm = r(m, 600)
        torch.testing.assert_close(tg.linear(xm, w).double(), xm.double() @ w.double().T, atol=1e-4, rtol=1e-4)
    y = tg.linear(x.bfloat16().view(3, 1, 600), w.bfloat16())
    assert y.shape == (3, 1, 20)


def test_a_skinny_fp32_output_takes_a_narrow_tile_with_the_same_bits(monkeypatch):
    # the MoE gate's logits (N = experts): F32_SKINNY_TILES' tile, which gives the bits of the
    # tile M's own F32_TILES bucket holds (the fixed K step, so the interpreter agrees)
    M, N, K = 80, 8, 2 * tiles.F32_SPLIT
    x, w = r(M, K), r(N, K)
    own, narrow = tiles.pick(tiles.F32_TILES, M), tiles.pick(tiles.F32_SKINNY_TILES, M)
    assert own != narrow and narrow["BN"] <= 32
    seen = []
    real = tg.run
    monkeypatch.setattr(tg, "run", lambda a, b, y, t, *rest, **kw: seen.append(t) or real(a, b, y, t, *rest, **kw))
    y = tg.linear(x, w)
    assert seen == [narrow]
    assert torch.equal(y, _run(x, w, own, tiles.F32_SPLIT, True, torch.float32))
    tg.linear(x, r(tiles.F32_SKINNY_N + 1, K))  # inverse control: a wider output keeps F32_TILES' tile
    assert seen[-1] == own


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_every_candidate_gives_the_rows_computed_alone():
    import torch.nn.functional as F

    gd = torch.Generator(device="cuda").manual_seed(0)

    def rc(*s, dt=torch.float32, scale=1.0):
        return (torch.randn(*s, generator=gd, device="cuda") * scale).to(dt)

    wb, wf, fn = rc(512, 4096, dt=torch.bfloat16, scale=1 / 64), rc(256, 4096, scale=1 / 64), rc(24, 16384, scale=1 / 128)
    xb, xf, xh = rc(300, 4096, dt=torch.bfloat16), rc(300, 4096), rc(300, 16384)
    cases = ((lambda t, x: tg.linear(x, wb, t), tiles.HALF_CANDIDATES, xb),
             (lambda t, x: tg.linear(x, wf, t), tiles.F32_CANDIDATES, xf),
             (lambda t, x: tg.hc_mix(x, fn, 1e-6, t), tiles.HC_CANDIDATES, xh))
    for run, cands, x in cases:
        alone = [run(cands[0], x[i:i + 1]) for i in (0, 5, 299)]
        for t in cands:
            for m in (1, 7, 64, 300):
                y = run(t, x[:m])
                for a, i in zip(alone, (0, 5, 299)):
                    if i < m:
                        assert torch.equal(y[i:i + 1], a), (t, m, i)
    # 3xTF32 within 8x of cuBLAS SGEMM's error (TF32 off) against float64
    assert not torch.backends.cuda.matmul.allow_tf32
    want = xf.double() @ wf.double().T
    err = ((tg.linear(xf, wf).double() - want).abs().max() / want.abs().max()).item()
    sgemm = ((F.linear(xf, wf).double() - want).abs().max() / want.abs().max()).item()
    assert err <= 8 * sgemm, (err, sgemm)
    assert ts.counters(xf.device).abs().sum() == 0
    # bf16 streams widened in the kernel: the bits of their fp32 copy (the sum of squares is
    # reduced by an MMA, so the load's register layout does not enter)
    hb = xh[:70].bfloat16()
    assert torch.equal(tg.hc_mix(hb, fn, 1e-6), tg.hc_mix(hb.float(), fn, 1e-6))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_bf16_streams_give_their_fp32_copy_bits_at_the_shipped_tiles():
    """hc_pre reads the bf16 streams and skips their zero ``lo * hi_w`` product: the bits of the
    fp32 copy's three products, at the tiles the table ships for 1 to 300 rows."""
    gd = torch.Generator(device="cuda").manual_seed(1)
    fn = torch.randn(24, 16384, generator=gd, device="cuda") / 128
    x = torch.randn(300, 16384, generator=gd, device="cuda").bfloat16()
    for m in (1, 16, 64, 70, 256, 300):
        assert torch.equal(tg.hc_mix(x[:m], fn, 1e-6), tg.hc_mix(x[:m].float(), fn, 1e-6)), m


def test_the_sweep_choice_keeps_only_bit_identical_tiles():
    from bench import gemm_tiles as G

    fast, slow = dict(tiles.HC_CANDIDATES[6]), dict(tiles.HC_CANDIDATES[0])

    def rec(fast_bits_ok: bool):
        rows = []
        for m, _ in G.BUCKETS["HC_TILES"][1]:
            rows.append({"M": m, "variants": [
                {"tile": fast, "bits_equal_ref": True, "bits_equal_alone": True, "bits_equal_also": fast_bits_ok,
                 "s": 1e-5, "graph_s": 1e-5},
                {"tile": slow, "bits_equal_ref": True, "bits_equal_alone": True, "bits_equal_also": True,
                 "s": 3e-5, "graph_s": 3e-5}]})
        return {"hc_mix": rows}

    both = G.choose(rec(True))
    assert both["HC_TILES"] == both["HC_HALF_TILES"] == [[1 << 62, fast]]
    # the faster tile differs on bf16 streams: never chosen for them, even where it is the shipped
    # default; fp32 inputs (where its bits agree) keep it
    half = {"HC_HALF_TILES": ((1 << 62, fast),)}
    assert G.choose(rec(False))["HC_HALF_TILES"] == [[1 << 62, slow]]
    assert G.choose(rec(False), defaults=half)["HC_HALF_TILES"] == [[1 << 62, slow]]
    assert G.choose(rec(False))["HC_TILES"] == [[1 << 62, fast]]
    assert G.choose(rec(True), defaults={"HC_HALF_TILES": ((1 << 62, slow),)})["HC_HALF_TILES"] == [[1 << 62, fast]]


def _sweep_records(section: str) -> dict:
    """``{(M, tile as json): variant}`` over every committed H200 sweep of the fixed-slice GEMMs
    (``bench/results/gemm_tiles*_h200.json``), the later sweeps last."""
    import json
    from pathlib import Path

    out = {}
    res = Path(__file__).resolve().parents[2] / "bench/results"
    for name in ("gemm_tiles_h200.json", "gemm_tiles2_h200.json", "gemm_tiles3_h200.json", "gemm_tiles4_h200.json"):
        if (res / name).exists():
            for row in json.loads((res / name).read_text()).get(section, []):
                for v in row["variants"]:
                    if "error" not in v:
                        out[(row["M"], json.dumps(v["tile"], sort_keys=True))] = v
    return out


def test_bf16_streams_take_only_tiles_whose_bits_agree_there():
    # the committed pick: hc_mix on bf16 / fp16 streams (hc_pre) keeps to wgmma tiles (BM >= 64); the
    # H200 sweeps found the mma.sync tiles' bits differ on such streams (gemm_tiles_h200.json)
    import json

    from bench import gemm_tiles as G

    recs = _sweep_records("hc_mix")
    for table in ("HC_HALF_TILES", "HC_HALF_TILES_GRAPH"):
        assert all(t["BM"] >= 64 for _, t in getattr(tiles, table))
        for m, _ in G.BUCKETS[table][1]:
            v = recs.get((m, json.dumps(tiles.pick(getattr(tiles, table), m), sort_keys=True)))
            assert v is None or v.get("bits_equal_also"), (table, m)
    for table in ("HC_TILES", "HC_TILES_GRAPH"):  # fp32 streams: every served tile's bits were checked
        for m, _ in G.BUCKETS[table][1]:
            v = recs.get((m, json.dumps(tiles.pick(getattr(tiles, table), m), sort_keys=True)))
            assert v is None or (v.get("bits_equal_ref") and v.get("bits_equal_alone")), (table, m)


def test_the_shipped_linear_tiles_were_bit_checked_at_their_buckets():
    # every bucket of HALF_TILES (and the decode buckets of F32_TILES and hc_mix), in both the eager
    # and the graph tables, serves a tile whose rows an H200 sweep found equal to the rows computed
    # alone, at the M the bucket was measured at
    import json

    from bench import gemm_tiles as G

    for table, ms in (("HALF_TILES", (1, 8, 64, 256, 4096)), ("F32_TILES", (1, 8)), ("HC_TILES", (1, 8, 64, 256))):
        recs = _sweep_records(G.BUCKETS[table][0])
        for tb in (table, tiles.GRAPH[table]):
            for m in ms:
                tile = tiles.pick(getattr(tiles, tb), m)
                v = recs[(m, json.dumps(tile, sort_keys=True))]
                assert G._bits_ok(v, also=False), (tb, m, tile)
    # inverse control: a row whose bits differed is refused
    assert not G._bits_ok({"bits_equal_alone": False, "bits_equal_ref": True})
