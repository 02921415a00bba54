"""The FP4 expert GEMM (kernels/triton_fp4.py) equals dequantise-then-GEMM: run by Triton's
interpreter on the CPU against a float64 reference, grouped (uneven and empty experts) and as
``ops.linear``'s single-group form; a wrong nibble order is caught (control)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from v4stack.kernels import triton_fp4 as K  # noqa: E402
from v4stack.ops.quantized import QuantizedWeight, dequantize_fp4, quantize_fp4  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _experts(E, N, Kd, g):
    packed, scale = zip(*(quantize_fp4(torch.randn(N, Kd, generator=g) * 0.3) for _ in range(E)))
    return torch.stack(packed), torch.stack(scale)


def _ref(x, packed, scale, offsets):
    y = torch.empty(x.shape[0], packed.shape[1], dtype=torch.float64)
    for e in range(packed.shape[0]):
        a, b = int(offsets[e]), int(offsets[e + 1])
        y[a:b] = x[a:b].double() @ dequantize_fp4(packed[e], scale[e]).double().T
    return y


@pytest.mark.parametrize("Kd", [64, 32])
def test_grouped_fp4_equals_dequantised_gemm(Kd):
    g = torch.Generator().manual_seed(0)
    packed, scale = _experts(4, 48, Kd, g)
    offsets = torch.tensor([0, 5, 5, 22, 23])  # expert 1 empty, uneven rows
    x = torch.randn(23, Kd, generator=g).to(torch.bfloat16)
    y = K.grouped_fp4_linear(x.to(DEV), packed.to(DEV), scale.to(DEV), offsets.to(DEV)).cpu()
    ref = _ref(x, packed, scale, offsets)
    # the products are exact (bf16 x exact-in-bf16 weights); fp32 sums, then one bf16 rounding
    # (one bf16 step, 2^-7: Triton's interpreter truncates where the GPU rounds to nearest)
    assert torch.allclose(y.double(), ref, rtol=2 ** -7, atol=1e-5 * ref.abs().max().item())
    swapped = (packed.view(torch.uint8) >> 4 | packed.view(torch.uint8) << 4).view(torch.int8)
    bad = _ref(x, swapped, scale, offsets)  # control: the other nibble order is a different matrix
    assert not torch.allclose(y.double(), bad, rtol=2 ** -7, atol=1e-5 * ref.abs().max().item())


def test_fp4_linear_as_ops_linear_form():
    g = torch.Generator().manual_seed(1)
    data, scale = quantize_fp4(torch.randn(40, 96, generator=g))
    qw = QuantizedWeight("fp4", data.to(DEV), scale.to(DEV))
    x = torch.randn(2, 3, 96, generator=g).to(torch.bfloat16)
    y = K.fp4_linear(x.to(DEV), qw).cpu()
    ref = x.double() @ dequantize_fp4(data, scale).double().T
    assert y.shape == (2, 3, 40)
    assert torch.allclose(y.double(), ref, rtol=2 ** -7, atol=1e-5 * ref.abs().max().item())
    assert not K.accepts(torch.randn(3, 80).to(torch.bfloat16), data, scale)  # K not the weight's
