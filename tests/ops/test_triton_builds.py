"""Every Triton kernel compiles to an sm_90a cubin on the CPU (Triton's bundled ptxas), with the
float semantics it declares: fp32 GEMMs use FMA (no TF32 MMA), and divisions / square roots
are the correctly rounded PTX instructions."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

FAST = ("sparse_attention_fused", "gemm_fp32_ieee", "gemm_bf16_small")
SLOW = ("sparse_attention_split", "sparse_attention_merge", "grouped_gemm_bf16", "hc_mix", "hc_finish",
        "indexer_scores", "fp8_gemm", "weighted_pool", "moe_combine", "rms_norm", "softmax_row",
        "log_softmax_chunks", "gemm_bf16_mid", "gemm_bf16_large")


def _ptx(names):
    # a fresh process without TRITON_INTERPRET: the kernels must be real JIT functions to compile
    code = ("import json,sys; from v4stack.kernels import builds; "
            "print(json.dumps({n: builds.build(n).asm['ptx'] for n in sys.argv[1:]}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    return json.loads(r.stdout.strip().splitlines()[-1])


def _check(ptx: dict):
    for name, src in ptx.items():
        assert ".entry" in src, name
        assert "tf32" not in src, name  # no TF32 tensor-core rounding anywhere
        assert "div.approx" not in src and "div.full" not in src and "sqrt.approx" not in src, name
    if "gemm_fp32_ieee" in ptx:
        assert "fma.rn.f32" in ptx["gemm_fp32_ieee"] and "mma" not in ptx["gemm_fp32_ieee"]
    for name, src in ptx.items():  # every bf16 GEMM tile shape on the same instruction (wgmma)
        if name.startswith("gemm_bf16"):
            assert "wgmma.mma_async" in src, name


def test_main_kernels_build_for_hopper():
    _check(_ptx(FAST))


@pytest.mark.slow
def test_all_kernels_build_for_hopper():
    _check(_ptx(SLOW))
