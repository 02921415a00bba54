"""Each op, invariant mode: a row's bits never depend on the batch it is computed in.

Every invariance test has an inverse control. Where the framework default (``fast``) is itself
batch-dependent on CPU (GEMM: MKL's kernel changes with M; sigmoid / silu / softplus: a scalar
formula for the ragged tail), the control shows ``fast`` differing on the same data. For every
op, a second control shows the comparison is sensitive to reduction order: the same math with
the reduced axis permuted gives different bits, so an order that moved with the batch would be
caught.
"""

import pytest
import torch

from v4stack import ops

M = 37  # rows; split below into batches of 1, 3, 8 and the rest, in a shuffled order


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _perm(n, seed):
    return torch.randperm(n, generator=_g(seed))


# Each case: (rows: tensors whose dim 0 is the row, shared: other args, call, reorder)
# reorder(rows, shared, p) -> (rows', shared', unperm) permutes the reduced axis with p; the op's
# value is unchanged in exact arithmetic; unperm maps the output back to the original layout.
def _cases():
    g = _g(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ident = lambda y: y  # noqa: E731
    yield "linear_fp32", (r(M, 96),), (r(40, 96),), lambda x, w: ops.linear(x, w), \
        lambda R, S, p: ((R[0][:, p],), (S[0][:, p],), ident), 96
    yield "rms_norm", (r(M, 72),), (r(72),), lambda x, w: ops.rms_norm(x, w, 1e-6), \
        lambda R, S, p: ((R[0][:, p],), (S[0][p],), lambda y: y[:, p.argsort()]), 72
    yield "softmax", (r(M, 50) * 3,), (), lambda x: ops.softmax(x, -1), \
        lambda R, S, p: ((R[0][:, p],), (), lambda y: y[:, p.argsort()]), 50
    yield "log_softmax", (r(M, 50) * 3,), (), lambda x: ops.log_softmax(x, -1), \
        lambda R, S, p: ((R[0][:, p],), (), lambda y: y[:, p.argsort()]), 50
    yield "sum", (r(M, 45),), (), lambda x: ops.sum(x, -1), \
        lambda R, S, p: ((R[0][:, p],), (), ident), 45
    yield "hc_mix", (r(M, 256),), (r(24, 256),), lambda x, fn: ops.hc_mix(x, fn, 1e-6), \
        lambda R, S, p: ((R[0][:, p],), (S[0][:, p],), ident), 256
    yield "weighted_pool", (r(M, 8, 48), r(M, 8, 48)), (), lambda kv, s: ops.weighted_pool(kv, s, 1), \
        lambda R, S, p: ((R[0][:, p], R[1][:, p]), (), ident), 8
    yield "indexer_scores", (r(M, 6, 16), r(M, 6)), (r(9, 16),), ops.indexer_scores, \
        lambda R, S, p: ((R[0][:, p], R[1][:, p]), S, ident), 6
    yield "attention_with_sink", (r(M, 4, 32), r(M, 20, 32), torch.rand(M, 20, generator=g) > 0.2), (r(4),), \
        lambda q, k, m, s: ops.attention_with_sink(q, k, m, s, 0.2), \
        lambda R, S, p: ((R[0], R[1][:, p], R[2][:, p]), S, ident), 20
    yield "hc_read", (r(M, 4, 64), torch.rand(M, 4, generator=g)), (), ops.hc_read, \
        lambda R, S, p: ((R[0][:, p], R[1][:, p]), (), ident), 4
    yield "hc_write", (r(M, 4, 64), r(M, 64), torch.rand(M, 4, generator=g), torch.rand(M, 4, 4, generator=g)), (), \
        ops.hc_write, lambda R, S, p: ((R[0][:, p], R[1], R[2], R[3][:, p]), (), ident), 4


CASES = {c[0]: c[1:] for c in _cases()}
FAST_BATCH_DEPENDENT = {"linear_fp32", "hc_mix"}


def _batched(call, rows, shared, seed):
    """Rows computed in a shuffled order, in batches of 1, 3, 8 and the rest, put back in place."""
    order = _perm(M, seed)
    out, i = None, 0
    for size in (1, 3, 8, M - 12):
        idx = order[i : i + size]
        y = call(*[t[idx] for t in rows], *shared)
        if out is None:
            out = torch.empty((M, *y.shape[1:]), dtype=y.dtype)
        out[idx] = y
        i += size
    return out


def _same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("name", list(CASES))
def test_invariant_rows_do_not_depend_on_the_batch(name):
    rows, shared, call, _, _ = CASES[name]
    with ops.mode("invariant"):
        full = call(*rows, *shared)
        for seed in (0, 1):
            assert _same_bits(_batched(call, rows, shared, seed), full)
        assert _same_bits(call(*rows, *shared), full)  # determinism


@pytest.mark.parametrize("name", list(CASES))
def test_control_reduction_order_is_visible_in_the_bits(name):
    rows, shared, call, reorder, width = CASES[name]
    with ops.mode("invariant"):
        full = call(*rows, *shared)
        r2, s2, unperm = reorder(rows, shared, _perm(width, 7))
        moved = unperm(call(*r2, *s2))
    assert not _same_bits(moved, full)
    torch.testing.assert_close(moved, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(FAST_BATCH_DEPENDENT))
def test_control_fast_mode_is_batch_dependent(name):
    rows, shared, call, _, _ = CASES[name]
    with ops.mode("fast"):
        full = call(*rows, *shared)
        assert not _same_bits(_batched(call, rows, shared, 0), full)


@pytest.mark.parametrize("name", list(CASES))
def test_invariant_matches_fast_numerically(name):
    rows, shared, call, _, _ = CASES[name]
    with ops.mode("invariant"):
        inv = call(*rows, *shared)
    with ops.mode("fast"):
        fast = call(*rows, *shared)
    torch.testing.assert_close(inv, fast, rtol=1e-4, atol=1e-4)


def test_bf16_linear_accumulates_in_fp32_and_rounds_once():
    """bf16 products are exact in fp32, so the bf16 result is the fp32 result of the upcast
    inputs rounded once (a bf16 row is then as invariant as the fp32 row above)."""
    x, w = torch.randn(M, 96, generator=_g(9)).bfloat16(), torch.randn(40, 96, generator=_g(10)).bfloat16()
    with ops.mode("invariant"):
        y = ops.linear(x, w)
        assert y.dtype == torch.bfloat16
        assert _same_bits(y, ops.linear(x.float(), w.float()).bfloat16())
        assert _same_bits(_batched(lambda a, b: ops.linear(a, b), (x,), (w,), 0), y)


def test_cpu_mm_fp32_changes_from_m8_but_invariant_linear_does_not():
    """The spec's measured fact, on this machine: row 0 of x @ w.T changes once M reaches 8."""
    x, w = torch.randn(64, 256, generator=_g(2)), torch.randn(128, 256, generator=_g(3))
    with ops.mode("fast"):
        ref = ops.linear(x[:1], w)
        fast_rows = {m: _same_bits(ops.linear(x[:m], w)[:1], ref) for m in (1, 8, 16, 64)}
    with ops.mode("invariant"):
        ref = ops.linear(x[:1], w)
        inv_rows = {m: _same_bits(ops.linear(x[:m], w)[:1], ref) for m in (1, 8, 16, 64)}
    assert fast_rows[1] and not all(fast_rows.values())
    assert all(inv_rows.values())


@pytest.mark.parametrize("fn", ["sigmoid", "silu", "softplus", "exp", "cos", "sin"])
def test_pointwise_element_bits_do_not_depend_on_position(fn):
    x = torch.randn(33, 5, generator=_g(4)) * 4
    f = getattr(ops, fn)
    with ops.mode("invariant"):
        full = f(x)
        assert _same_bits(torch.cat([f(x[i : i + 1]) for i in range(33)]), full)
        assert _same_bits(f(x.t().contiguous()).t(), full)
        assert _same_bits(f(torch.stack((x, x), -1)[..., 0]), full)  # strided input


@pytest.mark.parametrize("fn", ["sigmoid", "silu", "softplus"])
def test_control_fast_pointwise_tail_differs(fn):
    """torch's CPU kernel uses a scalar formula for the tail / a single element."""
    x = torch.randn(20000, generator=_g(5)) * 3
    f = getattr(ops, fn)
    with ops.mode("fast"):
        full = f(x)
        alone = torch.cat([f(x[i : i + 1]) for i in range(0, 20000, 1)])
    assert not _same_bits(alone, full)


def test_moe_combine_sums_in_expert_order_whatever_the_slot_order():
    g = _g(6)
    y = torch.randn(M, 4, 32, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(M)])
    p = _perm(4, 8)
    with ops.mode("invariant"):
        a, b = ops.moe_combine(y, idx), ops.moe_combine(y[:, p], idx[:, p])
        assert _same_bits(a, b)
        assert _same_bits(_batched(ops.moe_combine, (y, idx), (), 0), a)
    with ops.mode("fast"):  # control: slot order changes the fast sum's bits
        assert not _same_bits(ops.moe_combine(y, idx), ops.moe_combine(y[:, p], idx[:, p]))


def test_topk_ties_go_to_the_lower_index_in_invariant_mode():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]]).repeat(5, 1)
    with ops.mode("invariant"):
        vals, idx = ops.topk(x, 4)
    assert idx.tolist() == [[1, 2, 4, 5]] * 5 and vals[0].tolist() == [3.0, 3.0, 3.0, 2.0]
    with ops.mode("fast"):
        assert ops.topk(x, 4, stable=True)[1].tolist() == [[1, 2, 4, 5]] * 5


def test_linear_errors_name_the_width():
    with ops.mode("invariant"), pytest.raises(ValueError, match="in_features 8, input has 9"):
        ops.linear(torch.randn(2, 9), torch.randn(3, 8))


def test_empty_reductions():
    with ops.mode("invariant"):
        assert ops.linear(torch.randn(3, 0), torch.randn(4, 0)).abs().sum() == 0
        assert ops.sum(torch.randn(3, 0), -1).tolist() == [0.0, 0.0, 0.0]
        assert ops.linear(torch.randn(0, 5), torch.randn(4, 5)).shape == (0, 4)


def test_trailing_hidden_candidates_leave_attention_bits_unchanged():
    """A row's candidate list grows with hidden entries when its prompt is chunked differently
    (entries that close later in the same step). Invariant mode: the same bits; fast: not."""
    g = _g(11)
    q, k = torch.randn(M, 4, 32, generator=g), torch.randn(M, 20, 32, generator=g)
    mask, sink = torch.rand(M, 20, generator=g) > 0.2, torch.randn(4, generator=g)
    k2 = torch.cat((k, torch.randn(M, 50, 32, generator=g)), 1)  # crosses a 64-candidate block
    m2 = torch.cat((mask, torch.zeros(M, 50, dtype=torch.bool)), 1)
    with ops.mode("invariant"):
        assert _same_bits(ops.attention_with_sink(q, k2, m2, sink, 0.2), ops.attention_with_sink(q, k, mask, sink, 0.2))
    with ops.mode("fast"):
        assert not _same_bits(ops.attention_with_sink(q, k2, m2, sink, 0.2),
                              ops.attention_with_sink(q, k, mask, sink, 0.2))
