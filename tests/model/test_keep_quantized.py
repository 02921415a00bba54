"""Quantised weights stay quantised in memory where ``ops.linear`` reads the stored format:
``keep_quantized`` drops exactly the dense copies such an implementation makes unnecessary, the
resident bytes fall by their size, and the logits do not change. With the default CPU table
(dequantise-and-cache) nothing is dropped (control)."""

import pytest
import torch

from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.model.quant import keep_quantized, quantize_weight, resident_bytes
from v4stack.model.weights import load_state
from v4stack.ops import dispatch
from v4stack.ops.mode import mode
from v4stack.ops.quantized import FormatError, QuantizedWeight, quantize_fp8


def _quantised_model():
    src = V4Model(preset("tiny"), seed=0)
    tensors = {}
    for name, w in src.state_dict().items():
        qw = quantize_weight(name, w) if w.dim() == 2 else None
        if qw is None:
            tensors[name] = w
        else:
            tensors[name], tensors[name[: -len(".weight")] + ".scale"] = qw.data, qw.scale
    model = V4Model(preset("tiny"), seed=None).cast(torch.bfloat16)
    assert load_state(model, tensors) > 0
    return model.eval()


@pytest.fixture
def reads_stored_format():
    """An ``ops.linear`` for fp8 on the CPU that dequantises on every call (no cached copy)."""
    from v4stack.ops import _gemm

    def per_call(x, qw):
        return _gemm("linear", x, x, None, x, qw.dequantize().to(x.dtype))

    impl = dispatch.register("linear", "dequantize_per_call", per_call, fmt="fp8", device="cpu", first=True)
    yield
    with dispatch._lock:
        for lst in dispatch._table.values():
            if impl in lst:
                lst.remove(impl)
        dispatch._resolved.clear()


def _logits(model):
    with torch.no_grad(), mode("fast"):
        return model(torch.arange(40, 60).view(1, -1))


def test_without_a_direct_implementation_nothing_is_dropped():
    model = _quantised_model()
    got = keep_quantized(model)
    assert got["dropped"] == [] and got["bytes_after"] == got["bytes_before"]


def test_dense_copies_go_where_the_stored_format_is_read(reads_stored_format):
    model = _quantised_model()
    ref = _logits(model)
    dense = {n: m.weight.numel() * m.weight.element_size() for n, m in model.named_modules()
             if getattr(m, "qweight", None) is not None}
    got = keep_quantized(model)
    assert "layers.0.attn.wq_a" in got["dropped"] and "mtp.0.e_proj" in got["dropped"]
    assert not any("experts" in n or n.endswith("wo_a") for n in got["dropped"])  # tiny wo_a groups: 16 rows
    assert got["bytes_before"] - got["bytes_after"] == sum(dense[n] for n in got["dropped"])
    assert resident_bytes(model) == got["bytes_after"]
    assert torch.equal(_logits(model), ref)


def test_wo_a_groups_are_row_slices_of_the_stored_weight():
    w = torch.randn(512, 256)
    qw = QuantizedWeight("fp8", *quantize_fp8(w))
    parts = [qw.rows(i * 256, (i + 1) * 256) for i in range(2)]
    assert torch.equal(torch.cat([p.dequantize() for p in parts]), qw.dequantize())
    with pytest.raises(FormatError, match="scale blocks"):
        qw.rows(0, 100)
