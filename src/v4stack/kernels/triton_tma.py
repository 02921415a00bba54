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

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import cdiv, pdl_kwargs
from v4stack.kernels.triton_slices import fold


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
    pdl_enter()
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


@triton.jit
def _tma_slice(a_desc, b_desc, pm, pn, k0, kend, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(k0, kend, BK):
        a = a_desc.load([pm * BM, k])
        b = b_desc.load([pn * BN, k])
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def tma_grid_kernel(a_desc, b_desc, Y, P, CNT, M, N, K, s_ym, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    KPS: tl.constexpr, UNR: tl.constexpr):
    """The grid form on TMA loads: program (m, n, s) computes slice s of its tile (KPS steps of BK
    from zero, as ``linear_tma_kernel``'s slice) into ``P[s]`` as fp32; the tile's last program
    to arrive adds the S partials in slice order (``triton_slices.fold``) and stores Y."""
    pdl_enter()
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    s = tl.program_id(2)
    S = tl.num_programs(2)
    k0 = s * (KPS * BK)
    acc = _tma_slice(a_desc, b_desc, pm, pn, k0, tl.minimum(k0 + KPS * BK, K), BM, BN, BK)
    rows = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    cols = pn * BN + tl.arange(0, BN)
    rmask = rows < M
    omask = rmask[:, None] & (cols < N)[None, :]
    tl.store(P + (s * M + rows)[:, None] * N + cols[None, :], acc, mask=omask)
    tl.debug_barrier()  # every thread's partial is written before the arrival is released
    tile = CNT + pm * tl.num_programs(1) + pn
    if tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == S - 1:
        tl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")
        total, _ = fold(P, P, rows, rmask, cols, omask, M, N, S, BM, BN, False, UNR, ".cg")
        tl.store(Y + rows[:, None] * s_ym + cols[None, :], total.to(Y.dtype.element_ty), mask=omask)


_sms = None


def num_sms() -> int:
    global _sms
    if _sms is None:
        import torch

        _sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4
    return _sms


def linear_tma(a, w, y, BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=3, WS=False, SPLIT=2048,
               FLAT=False, GRID=False, UNR=2):
    """``y[M, N] = a[M, K] @ w[N, K].T`` (row-major, 16-byte aligned rows), K in ``SPLIT`` slices
    (``BK`` divides ``SPLIT``). GRID: one program per (tile, slice), ``tma_grid_kernel`` (K of more
    than one slice, tiles within the counters), else the persistent kernel."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from v4stack.kernels import triton_slices as ts

    M, K = a.shape
    N = w.shape[0]
    ad = TensorDescriptor.from_tensor(a, [BM, BK])
    bd = TensorDescriptor.from_tensor(w, [BN, BK])
    gm, gn, S = cdiv(M, BM), cdiv(N, BN), cdiv(K, SPLIT)
    if GRID and S > 1 and gm * gn <= ts.COUNTERS:
        p, cnt = ts.workspace(a.device, S * M * N), ts.counters(a.device)
        tma_grid_kernel[(gm, gn, S)](ad, bd, y, p, cnt, M, N, K, y.stride(0), BM=BM, BN=BN, BK=BK, KPS=SPLIT // BK,
                                     UNR=UNR, num_warps=num_warps, num_stages=num_stages,
                                     **pdl_kwargs(tma_grid_kernel))
        return y
    cd = TensorDescriptor.from_tensor(y, [BM, BN])
    nsm = num_sms()
    grid = (min(nsm, cdiv(M, BM) * cdiv(N, BN)),)
    linear_tma_kernel[grid](ad, bd, cd, M, N, K, BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M, NUM_SMS=nsm, WS=WS,
                            KPS=SPLIT // BK, FLAT=FLAT, num_warps=num_warps, num_stages=num_stages,
                            **pdl_kwargs(linear_tma_kernel))
    return y
