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
    # on the scale 2^-4 (amax 15.75): 8.5 -> 136, halfway between e4m3's 128 and 144, 9.5 -> 152, ...: ties
    x[4] = torch.arange(D, dtype=torch.float64) % 16 * 0.5 + 8.25
    x[5, :] = 17.0  # on the scale 2^-4: 272, halfway between 256 and 288
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


@pytest.mark.parametrize("D,block", [(128, 32), (16, 32), (96, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp4_round_kernel_has_the_compositions_bits(D, block, dtype):
    x = rows(40, D, dtype)
    x[6, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 2.0 ** -3  # every e2m1 tie ...
    x[6, 8] = 6.0 * 2.0 ** -3 * 2  # ... on the block's scale (amax 1.5: 2^-2 after / 6 rounds up)
    x[7, :4] = torch.tensor([-0.2, 0.2, -7.0, 7.0])  # to -0.0 / 0.0 and past the saturation
    x = x.to(DEV)
    want = fused.fp4_round_reference(x, block)
    got = tr.fp4_round(x, block)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    assert not torch.equal(tr.fp4_round(x, min(block, D) // 2), want)  # control: other blocks, other bits
