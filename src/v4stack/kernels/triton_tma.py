"""The bf16 / fp16 GEMM for many rows on Hopper's tensor-memory accelerator (Triton).

``Y = X @ W.T`` with X, W and Y read and written through TMA descriptors, one persistent program
per SM walking output tiles (grouped along M for L2 reuse). Each output tile's K-sum is the same
fixed chain as ``triton_slices.slices_kernel``'s: K in slices of ``SPLIT`` (``tiles.HALF_SPLIT``),
each the 16-wide ``wgmma`` steps in K order into fp32 registers from a zero start, the slices
added in order into a second accumulator (``((0 + P0) + P1) + ...``), with K past the end read
as zeros (TMA pads, the other kernel masks). Only which program computes a tile, and when,
differs - never an element's chain - so a row's bits are those of the small-M tiles (checked on
the GPU, ``bench/gemm_tiles.py``).
"""

import triton
import triton.language as tl

from v4stack.kernels.launch import cdiv


@triton.jit
def _tile_of(t, num_m, num_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * num_n
    g = t // per_group
    first_m = g * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pm = first_m + (t % per_group) % size_m
    pn = (t % per_group) // size_m
    return pm, pn


@triton.jit
def linear_tma_kernel(a_desc, b_desc, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, WS: tl.constexpr, KPS: tl.constexpr,
                      FLAT: tl.constexpr):
    """KPS: K steps of BK per slice (``SPLIT // BK``)."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for t in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=FLAT, warp_specialize=WS):
        pm, pn = _tile_of(t, num_m, num_n, GROUP_M)
        total = tl.zeros([BM, BN], tl.float32)
        for s0 in range(0, k_tiles, KPS):  # the slices, each from zero, added in order
            acc = tl.zeros([BM, BN], tl.float32)
            for ki in range(s0, tl.minimum(s0 + KPS, k_tiles)):
                a = a_desc.load([pm * BM, ki * BK])
                b = b_desc.load([pn * BN, ki * BK])
                acc = tl.dot(a, b.T, acc)
            total += acc
        c_desc.store([pm * BM, pn * BN], total.to(c_desc.dtype))


_sms = None


def num_sms() -> int:
    global _sms
    if _sms is None:
        import torch

        _sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4
    return _sms


def linear_tma(a, w, y, BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=3, WS=False, SPLIT=2048,
               FLAT=False):
    """``y[M, N] = a[M, K] @ w[N, K].T`` (row-major, 16-byte aligned rows), K in ``SPLIT`` slices
    (``BK`` divides ``SPLIT``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = a.shape
    N = w.shape[0]
    ad = TensorDescriptor.from_tensor(a, [BM, BK])
    bd = TensorDescriptor.from_tensor(w, [BN, BK])
    cd = TensorDescriptor.from_tensor(y, [BM, BN])
    nsm = num_sms()
    grid = (min(nsm, cdiv(M, BM) * cdiv(N, BN)),)
    linear_tma_kernel[grid](ad, bd, cd, M, N, K, BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M, NUM_SMS=nsm, WS=WS,
                            KPS=SPLIT // BK, FLAT=FLAT, num_warps=num_warps, num_stages=num_stages)
    return y
