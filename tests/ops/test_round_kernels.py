"""The activation rounding's kernel (``kernels/triton_round.py``: ``ops.fused.kv_round``) against
its composition (``quantized.fp8_round`` on the non-RoPE dims), bit for bit: V4's width, a row
narrower than a block, a ragged last block, all-zero and tiny rows, -0.0, ties, and amaxes just
above a power of two times 448 (whose quotient rounds down in bf16). Inverse control: another block
width gives other bits. On the CPU the kernel runs in Triton's interpreter."""

import pytest
import torch

from v4stack.ops import fused

tr = pytest.importorskip("v4stack.kernels.triton_round")
g = torch.Generator().manual_seed(11)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rows(n: int, D: int, dtype) -> torch.Tensor:
    x = torch.randn(n, D, generator=g, dtype=torch.float64) * torch.logspace(-7, 4, n, dtype=torch.float64)[:, None]
    x[0] = 0
    x[1, :: 3] = -0.0
    x[2] = 2.0 ** -20  # below the clamp's 1e-4
    x[3, 0] = 448 * 2.0 ** 3 * (1 + 2.0 ** -9)  # amax / 448 just above a power of two
    x[4] = torch.arange(D, dtype=torch.float64) % 16 * 0.5 + 8.25  # e4m3 ties at scale 2^-? ...
    x[5, :] = 17.0  # 17 / 2^k: a tie between two e4m3 values
    return x.to(dtype)


@pytest.mark.parametrize("D,rope,block", [(512, 64, 64), (32, 16, 64), (160, 16, 64), (96, 32, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_round_kernel_has_the_compositions_bits(D, rope, block, dtype):
    x = rows(40, D, dtype).to(DEV)
    want = fused.kv_round_reference(x, rope, block)
    got = tr.kv_round(x, rope, block)
    assert torch.equal(got, want)
    assert torch.equal(got[1].signbit(), want[1].signbit())  # -0.0 kept
    assert torch.equal(got[..., -rope:], x[..., -rope:])  # the RoPE dims untouched
    other = min(block, D - rope) // 2
    assert not torch.equal(tr.kv_round(x, rope, other), want)  # control: other blocks, other bits
