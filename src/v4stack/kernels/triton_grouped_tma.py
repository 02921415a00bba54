"""The grouped (per-expert) GEMM on Hopper's tensor-memory accelerator, persistent (Triton).

Rows sorted by expert (``offsets [E + 1]`` on the device), ``w [E, N, K]``. The row tiles are
``triton_grouped``'s (expert ``e`` owns ``ceil(n_e / BM)`` tiles of BM rows from its first row,
tile ids running expert after expert, found in the kernel from a prefix sum of the offsets); an
output tile is (row tile ``m``, column tile ``n``), and ``min(#SM, bound)`` programs walk them
with ``m`` fastest, so the programs in flight at once share an expert's weight tile through L2.

X and W are read through TMA descriptors: X ``[T, K]`` in BM x BK boxes from the tile's first
row (rows past the expert's end belong to the next expert or, past ``T``, read as zeros; their
results are never stored), W as ``[E * N, K]`` in BN x BK boxes from row ``e * N + n * BN``
(columns past ``N`` are never stored). The output is stored with a row mask ``< the expert's
end``, since a tile may end inside the next expert's rows.

The K chain of an output element is ``triton_gemm._mm_tile``'s: the MMA steps in K order from a
zero start, K past the end read as zeros - only which program computes a tile, and when,
differs, so a row's bits are those of the table kernel's tiles (checked on the GPU, bench
``gemm_tiles.py --only grouped``).

It is launched the usual way, not programmatically (``kernels/gdc.py``): on an H100 a flash4 batch-256
step took ~0.1 ms longer with this kernel launched programmatically, and ~0.02 ms with every other
kernel so and this one not (``bench/results/serve_pdlset_*_h100_50e39e9_*.json``,
``serve_pdlx_*_h100_50e39e9_*.json``).
"""

import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import cdiv, next_pow2


@triton.jit
def grouped_tma_kernel(x_desc, w_desc, Y, Off, E, N, K, s_ym, EB: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, NUM_SMS: tl.constexpr,
                       FLAT: tl.constexpr):
    pdl_enter()
    e = tl.arange(0, EB)
    lo = tl.load(Off + e, mask=e < E, other=0).to(tl.int32)
    hi = tl.load(Off + e + 1, mask=e < E, other=0).to(tl.int32)
    tiles = (hi - lo + BM - 1) // BM
    ends = tl.cumsum(tiles, 0)  # row tile id one past each expert's last
    num_m = tl.sum(tiles, 0)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for t in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=FLAT):
        m = t % num_m
        pn = t // num_m
        mine = tl.sum((ends <= m).to(tl.int32), 0)  # experts wholly before row tile m: m's expert
        sel = e == mine
        first = tl.sum(tl.where(sel, ends - tiles, 0), 0)
        r0 = tl.sum(tl.where(sel, lo, 0), 0) + (m - first) * BM
        r1 = tl.sum(tl.where(sel, hi, 0), 0)
        wrow = mine * N + pn * BN
        acc = tl.zeros([BM, BN], tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([r0, ki * BK])
            b = w_desc.load([wrow, ki * BK])
            acc = tl.dot(a, b.T, acc)
        rows = (r0 + tl.arange(0, BM)).to(tl.int64)
        cols = pn * BN + tl.arange(0, BN)
        tl.store(Y + rows[:, None] * s_ym + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=(rows < r1)[:, None] & (cols < N)[None, :])


def usable(x, w) -> bool:
    """TMA's terms: 16-byte aligned bases and row strides (bf16 / fp16, K a multiple of 8)."""
    import torch

    return (x.dtype in (torch.bfloat16, torch.float16) and x.shape[1] % 8 == 0 and x.data_ptr() % 16 == 0
            and w.data_ptr() % 16 == 0 and x.stride(1) == 1 and x.stride(0) == x.shape[1])


def grouped_linear_tma(x, w, off, y, t):
    """``y[rows of e] = x[rows of e] @ w[e].T`` for contiguous ``x [T, K]``, ``w [E, N, K]``, int64
    ``off [E + 1]`` (rising from 0 to T) and ``y [T, N]``; ``t`` the tile (BM, BN, BK, warps,
    stages, FLAT, occ)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from v4stack.kernels.triton_tma import num_sms

    T, K = x.shape
    E, N, _ = w.shape
    bm, bn, bk = t["BM"], t["BN"], t["BK"]
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w.view(E * N, K), [bn, bk])
    nsm = num_sms() * t.get("occ", 1)
    grid = (min(nsm, (min(E, T) + T // bm) * cdiv(N, bn)),)
    grouped_tma_kernel[grid](xd, wd, y, off, E, N, K, y.stride(0), EB=max(16, next_pow2(E)), BM=bm, BN=bn, BK=bk,
                             NUM_SMS=nsm, FLAT=t.get("FLAT", False), num_warps=t["num_warps"],
                             num_stages=t["num_stages"])
    return y


# ---- group_linear: every group's rows in place ----------------------------------------------------


@triton.jit
def group_tma_kernel(x_desc, w_desc, Y, T, N, K, G, s_ym, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     NUM_SMS: tl.constexpr):
    """``Y[:, g N + n] = x[:, g K : (g + 1) K] @ w[g].T``: X read as ``[T, G K]`` in BM x BK boxes
    from column ``g K`` (``K`` a multiple of BK, so a box never reaches the next group's columns),
    W as ``[G N, K]``. Tiles (row tile fastest, then column tile, then group) walked persistently."""
    pdl_enter()
    num_m = tl.cdiv(T, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = K // BK
    for t in tl.range(tl.program_id(0), num_m * num_n * G, NUM_SMS):
        m = t % num_m
        rest = t // num_m
        pn = rest % num_n
        g = rest // num_n
        acc = tl.zeros([BM, BN], tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([m * BM, g * K + ki * BK])
            b = w_desc.load([g * N + pn * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        rows = (m * BM + tl.arange(0, BM)).to(tl.int64)
        cols = pn * BN + tl.arange(0, BN)
        tl.store(Y + rows[:, None] * s_ym + g * N + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=(rows < T)[:, None] & (cols < N)[None, :])


def group_usable(x, w, bk: int) -> bool:
    """``x [T, G, K]`` contiguous bf16 / fp16 with ``K`` a multiple of ``bk``, ``w [G, N, K]`` contiguous."""
    return (x.is_contiguous() and w.is_contiguous() and usable(x.view(x.shape[0], -1), w)
            and x.shape[2] % bk == 0 and w.dtype == x.dtype)


def group_linear_tma(x, w, t):
    """``group_linear`` (``x [T, G, K]``, ``w [G, N, K]`` -> ``[T, G N]``) reading each group's rows
    where they lie: the same K chain per output element as ``grouped_linear_tma`` on the groups'
    rows gathered (any tile), without the gather and the output's transpose."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    from v4stack.kernels.triton_tma import num_sms

    T, G, K = x.shape
    N = w.shape[1]
    y = torch.empty(T, G * N, dtype=x.dtype, device=x.device)
    bm, bn, bk = t["BM"], t["BN"], t["BK"]
    xd = TensorDescriptor.from_tensor(x.view(T, G * K), [bm, bk])
    wd = TensorDescriptor.from_tensor(w.view(G * N, K), [bn, bk])
    nsm = num_sms() * t.get("occ", 1)
    grid = (min(nsm, cdiv(T, bm) * cdiv(N, bn) * G),)
    group_tma_kernel[grid](xd, wd, y, T, N, K, G, y.stride(0), BM=bm, BN=bn, BK=bk, NUM_SMS=nsm,
                           num_warps=t["num_warps"], num_stages=t["num_stages"])
    return y
