"""The dispatch table: resolution order, contract fall-through, and per-site counters."""

import pytest
import torch

from v4stack import ops
from v4stack.ops import dispatch


def test_counters_name_the_implementation_and_the_call_site():
    ops.reset_counters()
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    ops.linear(x, w)
    with ops.mode("invariant"):
        ops.linear(x, w)
        with ops.call_site("attn"), ops.call_site("wq"):
            ops.linear(x, w)
            ops.softmax(x)
    c = ops.counters()
    assert c["linear"] == {"torch": 1, "torch_invariant": 1}
    assert c["attn.wq:linear"] == {"torch_invariant": 1}
    assert c["attn.wq:softmax"] == {"torch_invariant": 1}
    ops.reset_counters()
    assert ops.counters() == {}


def test_most_specific_key_first_and_contract_falls_through():
    op = "tests_dispatch_op"
    dispatch.register(op, "generic", lambda x: "generic")
    dispatch.register(op, "fast_any", lambda x: "fast_any", mode="fast")
    dispatch.register(op, "cpu_f32_picky", lambda x: "picky", mode="fast", fmt="float32", device="cpu",
                      accepts=lambda x: x.shape[0] % 2 == 0)
    even, odd = torch.zeros(4), torch.zeros(3)
    assert dispatch.call(op, "fast", "float32", "cpu", even) == "picky"
    assert dispatch.call(op, "fast", "float32", "cpu", odd) == "fast_any"  # contract refused: next entry
    assert dispatch.call(op, "invariant", "float32", "cpu", odd) == "generic"
    assert dispatch.call(op, "fast", "bfloat16", "cuda", odd) == "fast_any"
    assert dispatch.table()[f"{op}/fast/float32/cpu"] == ["cpu_f32_picky"]
    with pytest.raises(dispatch.NoImplementation, match="tests_dispatch_op2"):
        dispatch.call(op + "2", "fast", "float32", "cpu", odd)


def test_every_model_op_has_a_reference_in_both_modes_on_any_device():
    for op in ("linear", "softmax", "log_softmax", "hc_mix", "indexer_scores", "weighted_pool", "moe_combine",
               "topk", "sparse_attention", "grouped_linear", "rms_norm", "attention_with_sink"):
        for m in ops.MODES:
            assert ops.table()[f"{op}/{m}/*/*"], (op, m)


def test_block_scaled_weights_dispatch_on_their_format():
    from v4stack.ops import quantized

    w = torch.randn(40, 256)
    qw = ops.QuantizedWeight("fp8", *quantized.quantize_fp8(w))
    x = torch.randn(3, 256)
    ops.reset_counters()
    with ops.mode("invariant"):
        y = ops.linear(x, qw)
        assert torch.equal(y, ops.linear(x, qw.dequantize()))
    assert ops.counters()["linear"] == {"dequantize_cached": 1, "torch_invariant": 2}
    assert ops.table()["linear/*/fp8/cuda"] == ["triton_fp8_block_gemm"]


def test_a_call_autograd_must_differentiate_skips_the_forward_only_kernels():
    # the project's GPU kernels have no backward: with a gradient to compute, the CUDA key resolves
    # to the torch implementation (resolution only: the contracts accept CPU tensors)
    pytest.importorskip("triton")
    x = torch.randn(2048, 64)
    assert dispatch.resolve("softmax", "invariant", "float32", "cuda", x).name == "triton_softmax"
    g = x.clone().requires_grad_(True)
    assert not dispatch.resolve("softmax", "invariant", "float32", "cuda", g).name.startswith("triton")
    with torch.no_grad():  # no graph is built: the kernel serves again
        assert dispatch.resolve("softmax", "invariant", "float32", "cuda", g).name == "triton_softmax"
