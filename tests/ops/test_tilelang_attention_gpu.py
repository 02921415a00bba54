"""On a CUDA GPU with TileLang installed: fast mode's sparse attention at batch by the TileLang
kernel (kernels/tilelang_attention.py) against the float64 reference, with -1 padding, indices
past the pool, rows of the sink alone, one or two pools, the queries' normalisation folded in;
a row alone equals the row in a batch; the dispatch serves it at batch and not below
``MIN_ROWS``; it captures and replays in a CUDA graph."""

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("tilelang")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from v4stack import ops  # noqa: E402
from v4stack.kernels import tilelang_attention as tla  # noqa: E402
from v4stack.ops import fused, sparse_attention as sa  # noqa: E402


def _data(T=160, H=64, D=512, K0=128, K1=200, N0=4000, N1=3000):
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(T, H, D, device="cuda", generator=g).bfloat16()
    p0 = torch.randn(N0, D, device="cuda", generator=g).bfloat16()
    p1 = torch.randn(N1, D, device="cuda", generator=g).bfloat16()
    i0 = torch.randint(0, N0, (T, K0), device="cuda", generator=g)
    i1 = torch.randint(0, N1, (T, K1), device="cuda", generator=g)
    i0[:, :5] = -1  # early positions: no window row yet
    i1[:, 150:] = -1  # padding past the visible entries
    i1[3, 7] = N1 + 10  # outside the pool: no candidate either
    i0[9], i1[9] = -1, -1  # a row of the sink alone
    return q, [p0, p1], [i0, i1], torch.randn(H, device="cuda", generator=g), D ** -0.5


def _want(q, pools, idx, sink, scale):
    idx = [torch.where(j < p.shape[0], j, -1) for p, j in zip(pools, idx)]  # past the pool: no candidate
    return sa.reference(q.double(), [p.double() for p in pools], idx, sink.double(), scale)


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp(min=1e-30)).item()


def test_the_kernel_matches_float64_and_a_row_alone_its_batch_row():
    q, pools, idx, sink, scale = _data()
    got = tla.sparse_attention(q, pools, idx, sink, scale)
    assert not tla._refused, tla._refused
    assert _rel(got, _want(q, pools, idx, sink, scale)) < 1e-2
    assert torch.equal(got[9], torch.zeros_like(got[9]))  # the sink alone: every weight 0
    one = tla.sparse_attention(q[:1], pools, [i[:1] for i in idx], sink, scale)
    assert torch.equal(one, got[:1])
    # one pool (a window-only layer)
    got0 = tla.sparse_attention(q, pools[:1], idx[:1], sink, scale)
    assert _rel(got0, _want(q, pools[:1], idx[:1], sink, scale)) < 1e-2
    # the control: pool 1 left out changes the rows that had entries there
    assert not torch.allclose(got0[0].float(), got[0].float(), atol=1e-2)


def test_the_normalisation_folded_in_matches_normalising_first():
    q, pools, idx, sink, scale = _data()
    got = tla.normed_sparse_attention(q, pools, idx, sink, scale, 1e-6)
    qn = ops.rms_norm(q, None, 1e-6)
    assert _rel(got, _want(qn, pools, idx, sink, scale)) < 1e-2
    assert not torch.allclose(got.float(), tla.sparse_attention(q, pools, idx, sink, scale).float(), atol=1e-2)


def test_fast_mode_serves_it_at_batch_only_and_in_a_graph():
    q, pools, idx, sink, scale = _data()
    with ops.mode("fast"):
        ops.reset_counters()
        big = ops.sparse_attention(q, pools, idx, sink, scale)
        assert ops.counters()["sparse_attention"] == {"tilelang_sparse_attention": 1}
        n = tla.MIN_ROWS - 1
        ops.reset_counters()
        ops.sparse_attention(q[:n], pools, [i[:n] for i in idx], sink, scale)
        assert "tilelang_sparse_attention" not in ops.counters()["sparse_attention"]
        assert fused.normalises_queries(q)
        out = torch.empty_like(big)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out.copy_(ops.sparse_attention(q, pools, idx, sink, scale))
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out.copy_(ops.sparse_attention(q, pools, idx, sink, scale))
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, big)
