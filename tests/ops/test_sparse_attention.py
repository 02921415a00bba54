"""ops.sparse_attention: the CPU reference equals today's invariant attention over the same
candidates bit for bit, trailing -1 columns change no bit, and the GPU kernel (Triton's
interpreter on the CPU) agrees with a float64 reference in both launch shapes."""

import importlib

import pytest
import torch

from v4stack import ops
from v4stack.ops import fused

T, H, D = 3, 4, 32


def _case(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    p0, p1 = torch.randn(50, D, generator=g).to(dtype), torch.randn(20, D, generator=g).to(dtype)
    i0 = torch.randint(0, 50, (T, 70), generator=g)
    i0[:, 60:] = -1
    i0[1, 5] = -1
    i1 = torch.randint(0, 20, (T, 10), generator=g)
    i1[2] = -1
    return q, [p0, p1], [i0, i1], torch.randn(H, generator=g)


def test_invariant_reference_is_attention_with_sink_over_the_same_candidates():
    q, pools, idx, sink = _case()
    keys = torch.cat([pools[0][idx[0].clamp(min=0)], pools[1][idx[1].clamp(min=0)]], 1)
    mask = torch.cat([idx[0] >= 0, idx[1] >= 0], 1)
    with ops.mode("invariant"):
        want = ops.attention_with_sink(q, keys, mask, sink, D ** -0.5)
        got = ops.sparse_attention(q, pools, idx, sink, D ** -0.5)
        # trailing -1 columns (the padding of a longer batch) change no bit ...
        pad = [idx[0], torch.cat([idx[1], torch.full((T, 77), -1)], 1)]
        padded = ops.sparse_attention(q, pools, pad, sink, D ** -0.5)
        # ... while moving a candidate to another column does (the order is the candidate list's)
        rolled = ops.sparse_attention(q, pools, [idx[0].roll(7, 1), idx[1]], sink, D ** -0.5)
    assert torch.equal(got, want) and torch.equal(padded, got)
    assert not torch.equal(rolled, got) and torch.allclose(rolled, got, atol=1e-5)
    fast = ops.sparse_attention(q, pools, idx, sink, D ** -0.5)
    torch.testing.assert_close(fast, got, atol=1e-5, rtol=1e-5)


def test_bad_indices_are_refused():
    q, pools, idx, sink = _case()
    with pytest.raises(IndexError, match="past the pool"):
        ops.sparse_attention(q, pools, [idx[0], idx[1] + 50], sink, 1.0)
    with pytest.raises(ValueError, match="one index tensor per pool"):
        ops.sparse_attention(q, pools, idx[:1], sink, 1.0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_kernel_matches_float64(dtype, tol):
    ta = pytest.importorskip("v4stack.kernels.triton_attention")
    ref = importlib.import_module("v4stack.ops.sparse_attention")
    q, pools, idx, sink = _case(dtype)
    want = ref.reference(q.double(), [p.double() for p in pools], idx, sink.double(), D ** -0.5)
    split = ta.sparse_attention(q, pools, idx, sink, D ** -0.5, path="split")
    fused = ta.sparse_attention(q, pools, idx, sink, D ** -0.5, path="fused")
    assert split.dtype == dtype
    torch.testing.assert_close(split.double(), want, atol=tol, rtol=tol)
    assert torch.equal(split, fused)  # one arithmetic, two launch shapes
    one = ta.sparse_attention(q, pools[:1], idx[:1], sink, D ** -0.5, path="fused")
    torch.testing.assert_close(one.double(), ref.reference(q.double(), [pools[0].double()], idx[:1], sink.double(),
                                                           D ** -0.5), atol=tol, rtol=tol)


def test_fused_launch_stops_at_the_last_visible_chunk_with_the_same_bits():
    """A row's trailing all-hidden chunks (a short context's padded top-k list) are not run by the
    fused launch; the split launch runs every chunk, and the two agree bit for bit. Control: hiding
    the candidates of the last chunk that is run moves bits, so a launch that stopped one chunk
    early would be seen."""
    ta = pytest.importorskip("v4stack.kernels.triton_attention")
    q, pools, idx, sink = _case()
    i1 = torch.cat([idx[1], torch.full((T, 150), -1)], 1)  # 70 + 160 columns: 4 chunks, 2 of them live
    i1[0, 100] = 5  # row 0 has a visible candidate in chunk 2 (column 170): 3 live chunks
    padded = [idx[0], i1]
    split = ta.sparse_attention(q, pools, padded, sink, D ** -0.5, path="split")
    fused = ta.sparse_attention(q, pools, padded, sink, D ** -0.5, path="fused")
    assert torch.equal(split, fused)
    assert torch.equal(fused[1:], ta.sparse_attention(q, pools, idx, sink, D ** -0.5, path="fused")[1:])
    cut = [idx[0], i1.clone()]
    cut[1][0, 100] = -1
    assert not torch.equal(ta.sparse_attention(q, pools, cut, sink, D ** -0.5, path="fused")[0], fused[0])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_online_kernel_matches_float64_and_reads_no_row_outside_its_pool(dtype, tol):
    """Fast mode's many-row launch (online softmax, accumulated in place) agrees with float64 over
    two pools, one pool and a padded list that stops at the last live chunk; an index outside
    its pool is no candidate (the same bits as -1 there), while moving a visible candidate to
    another row of the pool does change the output (the control: the comparison can fail)."""
    ta = pytest.importorskip("v4stack.kernels.triton_attention_online")
    ref = importlib.import_module("v4stack.ops.sparse_attention")
    q, pools, idx, sink = _case(dtype)
    dq, dp = q.double(), [p.double() for p in pools]
    got = ta.sparse_attention(q, pools, idx, sink, D ** -0.5, force=True)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), ref.reference(dq, dp, idx, sink.double(), D ** -0.5), atol=tol, rtol=tol)
    one = ta.sparse_attention(q, pools[:1], idx[:1], sink, D ** -0.5, force=True)
    torch.testing.assert_close(one.double(), ref.reference(dq, dp[:1], idx[:1], sink.double(), D ** -0.5), atol=tol,
                               rtol=tol)
    padded = [idx[0], torch.cat([idx[1], torch.full((T, 150), -1)], 1)]
    assert torch.equal(ta.sparse_attention(q, pools, padded, sink, D ** -0.5, force=True), got)
    wild, hidden = [idx[0].clone(), idx[1].clone()], [idx[0].clone(), idx[1].clone()]
    wild[1][0, 3], hidden[1][0, 3] = 20 + 7, -1  # pool 1 holds 20 rows
    wild[0][1, 0], hidden[0][1, 0] = -(1 << 40), -1
    assert torch.equal(ta.sparse_attention(q, pools, wild, sink, D ** -0.5, force=True),
                       ta.sparse_attention(q, pools, hidden, sink, D ** -0.5, force=True))
    moved = [idx[0].clone(), idx[1]]
    moved[0][0, 0] = (moved[0][0, 0] + 1) % 50
    assert not torch.equal(ta.sparse_attention(q, pools, moved, sink, D ** -0.5, force=True)[0], got[0])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_online_kernel_normalises_the_queries_on_its_scores(dtype, tol):
    """With ``q_eps`` the many-row launch is attention of the per-head RMS-normalised queries
    (against float64 of the normalisation then the attention), with raw queries far from unit
    norm; the control: the same launch without it is far from that reference."""
    ta = pytest.importorskip("v4stack.kernels.triton_attention_online")
    ref = importlib.import_module("v4stack.ops.sparse_attention")
    q, pools, idx, sink = _case(dtype)
    q = (q.float() * torch.linspace(0.2, 6.0, H)[None, :, None]).to(dtype)  # a scale a head
    dq, dp = q.double(), [p.double() for p in pools]
    normed = dq * torch.rsqrt(dq.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = ref.reference(normed, dp, idx, sink.double(), D ** -0.5)
    got = ta.sparse_attention(q, pools, idx, sink, D ** -0.5, force=True, q_eps=1e-6)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    raw = ta.sparse_attention(q, pools, idx, sink, D ** -0.5, force=True)
    assert (raw.double() - want).abs().max() > 20 * tol
    # the op's composite (every device, every mode) is the same computation
    torch.testing.assert_close(fused.normed_sparse_attention(q, pools, idx, sink, D ** -0.5, 1e-6).double(),
                               want, atol=tol, rtol=tol)


def test_online_launch_only_where_the_table_launches_64_heads_fused():
    from v4stack.kernels import attention_tiles as at

    for rows in (1, 8, 64, 65, 256, 4096):
        t = at.pick(rows, 64)
        assert at.takes_online(rows, 64) == (t["path"] == "fused" and t["BH"] == 64 and not t["DV"])
    assert not at.takes_online(1, 64)  # decode of one request: the split launch
