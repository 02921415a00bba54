"""ops.grouped_linear: per-expert GEMM whose rows never depend on how many rows share an expert."""

import pytest
import torch

from v4stack import ops

E, N, K = 4, 24, 40


def _case(counts, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), K, generator=g).to(dtype)
    w = torch.randn(E, N, K, generator=g).to(dtype)
    off = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    return x, w, off


def _per_expert_f64(x, w, off):
    y = torch.empty(x.shape[0], N, dtype=torch.float64)
    for e in range(E):
        y[off[e]:off[e + 1]] = x[off[e]:off[e + 1]].double() @ w[e].double().T
    return y


def test_invariant_rows_do_not_depend_on_the_expert_batch():
    x, w, off = _case([9, 0, 17, 4])
    with ops.mode("invariant"):
        y = ops.grouped_linear(x, w, off)
        for r, e in ((0, 0), (12, 2), (26, 3)):  # one row alone under its expert
            alone = torch.zeros(E + 1, dtype=torch.long)
            alone[e + 1:] = 1
            assert torch.equal(ops.grouped_linear(x[r:r + 1], w, alone), y[r:r + 1])
        # inverse control: the same row with its K order permuted gives other bits
        p = torch.randperm(K, generator=torch.Generator().manual_seed(3))
        yp = ops.grouped_linear(x[:, p], w[:, :, p], off)
    assert not torch.equal(yp, y)
    torch.testing.assert_close(y.double(), _per_expert_f64(x, w, off), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ops.grouped_linear(x, w, off), y, atol=1e-4, rtol=1e-4)


def test_offsets_are_checked():
    x, w, off = _case([3, 3, 3, 3])
    with pytest.raises(ValueError, match="offsets must be"):
        ops.grouped_linear(x, w, off[:-1])
    with pytest.raises(ValueError, match="rise from 0"):
        ops.grouped_linear(x, w, torch.tensor([0, 5, 4, 9, 12]))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_triton_grouped_kernel_matches_float64(dtype, tol):
    tg = pytest.importorskip("v4stack.kernels.triton_grouped")
    x, w, off = _case([70, 0, 5, 1], dtype=dtype)  # an expert spanning two row tiles, an empty one
    y = tg.grouped_linear(x, w, off)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), _per_expert_f64(x, w, off), atol=tol * 8, rtol=tol)


def test_triton_grouped_gemm_rows_alone_equal_rows_in_the_batch():
    # the kernel finds each program's tile from the offsets: a row alone under its expert (a
    # one-row table) gets the bits it has in the full batch
    tgr = pytest.importorskip("v4stack.kernels.triton_grouped")
    x, w, off = _case([70, 0, 5, 1], dtype=torch.float32)
    y = tgr.grouped_linear(x, w, off)
    for r, e in ((0, 0), (69, 0), (72, 2), (75, 3)):
        alone = torch.zeros_like(off)
        alone[e + 1:] = 1
        assert torch.equal(tgr.grouped_linear(x[r:r + 1], w, alone), y[r:r + 1])
