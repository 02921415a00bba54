"""The Triton kernels of invariant mode against float64 torch (Triton's interpreter on the CPU).

Small shapes: the interpreter runs the kernels' logic (masks, loops, tiling), not their speed.
Bit-invariance over batches is checked on the GPU (``bench/ops_gpu_check.py``).
"""

import pytest
import torch

from v4stack.ops import quantized

tr = pytest.importorskip("v4stack.kernels.triton_rows")
tg = pytest.importorskip("v4stack.kernels.triton_gemm")
g = torch.Generator().manual_seed(0)


def r(*s):
    return torch.randn(*s, generator=g)


def close(got, want, tol):
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("block", [4096, 128])  # one slice, and the looped path of wide rows
def test_softmax_and_log_softmax(monkeypatch, block):
    monkeypatch.setattr(tr, "ROW_BLOCK", block)
    x = r(5, 300) * 3
    close(tr.softmax(x), torch.softmax(x.double(), -1), 1e-6)
    close(tr.log_softmax(x), torch.log_softmax(x.double(), -1), 1e-5)


def test_rms_norm_and_dense_attention_through_the_sparse_kernel():
    x, w = r(4, 300), r(300)
    want = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()
    close(tr.rms_norm(x, w, 1e-6), want, 1e-6)
    ta = pytest.importorskip("v4stack.kernels.triton_attention")
    from v4stack.ops import core
    q, keys, sink = r(3, 4, 32), r(3, 70, 32), r(4)
    mask = torch.rand(3, 70, generator=g) > 0.3
    want = core.attention_with_sink(q.double(), keys.double(), mask, sink.double(), 0.2)
    close(ta.attention_with_sink(q, keys, mask, sink, 0.2), want, 1e-5)


def test_weighted_pool_and_moe_combine():
    kv, s = r(6, 5, 40), r(6, 5, 40)
    close(tr.weighted_pool(kv, s, 1), (torch.softmax(s.double(), 1) * kv.double()).sum(1), 1e-6)
    y, idx = r(7, 6, 50), torch.randint(0, 4, (7, 6), generator=g)  # repeated ids: ties in slot order
    from v4stack.ops import invariant
    assert torch.equal(tr.moe_combine(y, idx), invariant.moe_combine(y, idx))  # same adds, same order


def test_gemms():
    x, w = r(40, 100), r(70, 100)
    close(tg.linear(x, w), x.double() @ w.double().T, 1e-5)
    x2, w2 = r(70, 2100), r(20, 2100)  # fp32 K in three fixed slices, the large-M tile
    close(tg.linear(x2, w2), x2.double() @ w2.double().T, 1e-4)
    xb, wb = x.bfloat16(), w.bfloat16()
    close(tg.linear(xb, wb), (xb.double() @ wb.double().T).bfloat16(), 1e-2)
    f, fn = r(5, 2100), r(24, 2100) * 0.05  # K over nine fixed slices, the last one cut
    want = (f.double() @ fn.double().T) / torch.sqrt((f.double() ** 2).mean(-1, keepdim=True) + 1e-6)
    close(tg.hc_mix(f, fn, 1e-6), want, 1e-5)
    q, wt, k = r(3, 8, 32), r(3, 8), r(100, 32)
    want = (torch.einsum("thd,sd->ths", q.double(), k.double()).relu() * wt.double()[:, :, None]).sum(1)
    close(tg.indexer_scores(q, wt, k), want, 1e-5)
    # per-row keys: the same rows of keys for every query give the same bits as shared keys
    assert torch.equal(tg.indexer_scores(q, wt, k.expand(3, -1, -1)), tg.indexer_scores(q, wt, k))


def test_weighted_pool_of_an_hca_entry_fits_its_registers():
    """An HCA entry pools 128 rows: at the launch's 32 columns the program builds for sm_90a without
    spilling (Triton's ptxas report); control: the 256 columns it took before spill. Its values are
    float64's to rounding."""
    from tests.ops.hopper import registers

    got = registers(("weighted_pool_p128", "weighted_pool_p128_wide"))
    assert got["weighted_pool_p128"]["spill_bytes"] == 0
    assert got["weighted_pool_p128_wide"]["spill_bytes"] > 0
    assert tr.POOL_ELEMS // 128 == 32
    kv, s = r(3, 128, 100), r(3, 128, 100)
    close(tr.weighted_pool(kv, s, 1), (torch.softmax(s.double(), 1) * kv.double()).sum(1), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_scores_read_by_index_equal_the_gathered_keys(dtype):
    from v4stack import ops

    q, wt, pool = r(5, 8, 32).to(dtype), r(5, 8).to(dtype), r(90, 32).to(dtype)
    rows = torch.randint(0, 90, (5, 300), generator=g)
    rows[:, 60:] = -1  # whole programs of padding (64 / 128 keys) past the entries: scored -inf unread
    rows[1, :5] = -1  # hidden entries inside the row, and a row past the 64-key program
    got = tg.indexer_scores(q, wt, pool, rows)
    gathered = tg.indexer_scores(q, wt, pool[rows.clamp(min=0)])
    assert torch.equal(got[rows >= 0], gathered[rows >= 0])  # the same MMA on the same key values
    assert bool((got[rows < 0] == float("-inf")).all())
    want = (torch.einsum("thd,tsd->ths", q.double(), pool[rows.clamp(min=0)].double()).relu()
            * wt.double()[:, :, None]).sum(1)
    close(got[rows >= 0], want[rows >= 0], 1e-5 if dtype == torch.float32 else 5e-2)
    # a query alone gets its bits from the batch
    assert torch.equal(tg.indexer_scores(q[3:4], wt[3:4], pool, rows[3:4]), got[3:4])
    # the references of both modes: the gathered per-row path, -inf where hidden
    for mode in ("invariant", "fast"):
        with ops.mode(mode):
            ref = ops.indexer_scores(q, wt, pool, rows=rows)
            per_row = ops.indexer_scores(q, wt, pool[rows.clamp(min=0)]).masked_fill(rows < 0, float("-inf"))
        assert torch.equal(ref, per_row)
    with pytest.raises(IndexError, match="past the pool"):
        ops.indexer_scores(q, wt, pool, rows=torch.full((5, 3), 90))


def test_fp8_block_scaled_gemm():
    wq, sc = quantized.quantize_fp8(r(200, 300))  # e8m0 scales; blocks cut by both edges
    x = r(9, 300).bfloat16()
    want = x.double() @ quantized.dequantize_fp8(wq, sc).double().T
    close(tg.fp8_linear(x, wq, quantized.scale_to_float(sc)), want.bfloat16(), 1e-2)


def test_mhc_read_and_write():
    from v4stack.ops import core

    x, pre = r(5, 4, 70), torch.rand(5, 4, generator=g)
    close(tr.hc_read(x, pre), core.hc_read(x.double(), pre.double()), 1e-6)
    out, post, comb = r(5, 70), torch.rand(5, 4, generator=g), torch.rand(5, 4, 4, generator=g)
    close(tr.hc_write(x, out, post, comb), core.hc_write(x.double(), out.double(), post.double(), comb.double()), 1e-6)
