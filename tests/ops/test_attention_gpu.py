"""On a CUDA GPU at V4-Flash widths (64 heads of 512, 640 candidates): every launch shape of the
sparse attention gives a row the same bits alone as in a batch, the shapes the bucket table ships
give one another's bits (so a row's bits never depend on which bucket its batch falls in), rows
alone equal rows in a batch through the dispatch table, and the check sees a change of summation
order (inverse control)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _data(T=64, H=64, D=512, K=640):
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(T, H, D, device="cuda", generator=g).bfloat16()
    keys = torch.randn(T, K, D, device="cuda", generator=g).bfloat16()
    mask = torch.rand(T, K, device="cuda", generator=g) > 0.2
    mask[:, -37:] = False
    return q, keys, mask, torch.randn(H, device="cuda", generator=g), D ** -0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_shape_same_bits_and_rows_alone_equal_the_batch():
    from v4stack import ops
    from v4stack.kernels import attention_tiles as AT
    from v4stack.kernels import triton_attention as ta
    from v4stack.ops import core

    q, keys, mask, sink, scale = _data()
    bits = lambda t: t.view(torch.int16)  # noqa: E731
    def run(tile, sl=slice(None)):
        return ta.attention_with_sink(q[sl], keys[sl], mask[sl], sink, scale, tiles=((1 << 62, tile),))

    outs = {}
    for i, tile in enumerate(AT.CANDIDATES):
        outs[i] = run(tile)
        assert torch.equal(bits(run(tile, slice(7, 8))), bits(outs[i][7:8])), tile
    shipped = [next(i for i, c in enumerate(AT.CANDIDATES) if c == t) for _, t in AT.TILES if t in AT.CANDIDATES]
    classes = [[j for j in outs if torch.equal(bits(outs[i]), bits(outs[j]))] for i in outs]
    print("bit classes of the candidates:", sorted({tuple(c) for c in classes}), "shipped:", shipped)
    for i in shipped:
        assert torch.equal(bits(outs[i]), bits(outs[shipped[0]])), (i, shipped)
    ref = outs[shipped[0]] if shipped else outs[0]
    with ops.mode("invariant"):
        batch = ops.attention_with_sink(q, keys, mask, sink, scale)
        for i in (0, 5, 63):
            assert torch.equal(bits(ops.attention_with_sink(q[i:i + 1], keys[i:i + 1], mask[i:i + 1], sink, scale)),
                               bits(batch[i:i + 1]))
    assert torch.equal(bits(batch), bits(ref))
    want = core.attention_with_sink(q.double(), keys.double(), mask, sink.double(), scale)
    assert ((ref.double() - want).norm() / want.norm()).item() < 2e-2
    # inverse control: the first chunk's candidates reversed (the same set, another order) move bits
    perm = torch.cat([torch.arange(63, -1, -1), torch.arange(64, keys.shape[1])]).cuda()
    first = AT.TILES[0][1]
    other = ta.attention_with_sink(q, keys[:, perm], mask[:, perm], sink, scale, tiles=((1 << 62, first),))
    assert not torch.equal(bits(other), bits(run(first)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_mode_runs_the_online_launch_for_many_rows_only():
    """256 rows: fast mode's dispatch runs the online-softmax kernel (close to float64, not the
    fixed-order bits), invariant mode the table's launch; one row: both the table's."""
    from v4stack import ops
    from v4stack.ops import core

    q, keys, mask, sink, scale = _data(T=256)
    T, K, D = keys.shape
    rows = torch.arange(T * K, device="cuda", dtype=torch.int32).view(T, K)
    pools, idx = [keys.reshape(T * K, D)], [torch.where(mask, rows, torch.full_like(rows, -1))]
    runs = {}
    for mode in ("fast", "invariant"):
        for n in (256, 1):
            ops.reset_counters()
            with ops.mode(mode):
                y = ops.sparse_attention(q[:n], pools, [idx[0][:n]], sink, scale)
            runs[mode, n] = (y, ops.counters()["sparse_attention"])
    assert runs["fast", 256][1] == {"triton_sparse_attention_online": 1}
    assert runs["invariant", 256][1] == runs["invariant", 1][1] == runs["fast", 1][1] == {"triton_sparse_attention": 1}
    want = core.attention_with_sink(q.double(), keys.double(), mask, sink.double(), scale)
    fast, inv = runs["fast", 256][0], runs["invariant", 256][0]
    assert ((fast.double() - want).norm() / want.norm()).item() < 2e-2
    assert not torch.equal(fast, inv)  # another arithmetic: the counter above is not the only evidence


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_mode_takes_the_query_norm_in_the_online_launch():
    """``normed_sparse_attention`` at 256 rows in fast mode: the online kernel normalising the
    queries it loads (``normalises_queries`` says so), close to float64 of normalise-then-attend with
    raw queries far from unit norm; at one row, and in invariant mode, the composite (the
    normalisation kernel, then the table's launch) and ``normalises_queries`` says no."""
    from v4stack import ops
    from v4stack.ops import core, fused

    q, keys, mask, sink, scale = _data(T=256)
    q = (q.float() * torch.linspace(0.2, 6.0, q.shape[1], device="cuda")[None, :, None]).bfloat16()
    T, K, D = keys.shape
    rows = torch.arange(T * K, device="cuda", dtype=torch.int32).view(T, K)
    pools, idx = [keys.reshape(T * K, D)], [torch.where(mask, rows, torch.full_like(rows, -1))]
    dq = q.double()
    want = core.attention_with_sink(dq * torch.rsqrt(dq.pow(2).mean(-1, keepdim=True) + 1e-6), keys.double(), mask,
                                    sink.double(), scale)
    for mode, n, impl in (("fast", 256, "triton_normed_sparse_attention_online"), ("fast", 1, "torch_composite"),
                          ("invariant", 256, "torch_composite")):
        ops.reset_counters()
        with ops.mode(mode):
            assert fused.normalises_queries(q[:n]) == (impl != "torch_composite")
            y = fused.normed_sparse_attention(q[:n], pools, [idx[0][:n]], sink, scale, 1e-6)
        assert ops.counters()["normed_sparse_attention"] == {impl: 1}, (mode, n)
        assert ((y.double() - want[:n]).norm() / want[:n].norm()).item() < 2e-2, (mode, n)
    with ops.mode("fast"):  # the control: without the norm the same launch is far off
        raw = ops.sparse_attention(q, pools, idx, sink, scale)
    assert ((raw.double() - want).norm() / want.norm()).item() > 0.1
