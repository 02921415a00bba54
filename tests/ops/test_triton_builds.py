"""Every Triton kernel compiles to an sm_90a cubin on the CPU (Triton's bundled ptxas), with the
float semantics it declares (``triton_slices.FLOAT_SEMANTICS``): the fp32 GEMM and hc_mix are
3xTF32 on ``wgmma`` (TF32 MMAs fed with operands split in the kernel), no other kernel uses TF32,
and divisions / square roots are the correctly rounded PTX instructions."""

import pytest

pytest.importorskip("triton")

from tests.ops.hopper import check, ptx  # noqa: E402

FAST = ("sparse_attention_fused", "gemm_fp32_tf32x3", "gemm_bf16_small")
SLOW = ("sparse_attention_split", "sparse_attention_online", "sparse_attention_online_qn", "sparse_attention_merge", "grouped_gemm_bf16", "grouped_gemm_bf16_tma", "hc_mix", "hc_mix_bf16_streams",
        "indexer_scores", "fp8_gemm", "weighted_pool", "moe_combine", "rms_norm", "softmax_row",
        "log_softmax_chunks", "gemm_bf16_mid", "gemm_bf16_large")


def test_main_kernels_build_for_hopper():
    check(ptx(FAST))


@pytest.mark.slow
def test_all_kernels_build_for_hopper():
    check(ptx(SLOW))
