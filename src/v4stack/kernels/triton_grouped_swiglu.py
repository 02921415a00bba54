"""The experts' gate and up projections and their SwiGLU activation as one persistent grouped
GEMM on Hopper's TMA (Triton): ``fused.grouped_swiglu``.

The tile walk is ``triton_grouped_tma``'s (row tiles expert after expert, found from a prefix
sum of the offsets; ``m`` fastest, so the programs in flight share an expert's weight tiles
through L2). A tile reads its rows of ``x`` once for both projections and keeps two
accumulators, ``x @ w1[e].T`` and ``x @ w3[e].T``, each the MMA steps in K order from a zero
start - the K chain of ``grouped_tma_kernel`` and of the table kernel's tiles, so each is the
unfused GEMM's value. The epilogue rounds both to the GEMM's output dtype first (the values
the unfused GEMMs store) and then applies ``swiglu_act_kernel``'s arithmetic: clamps, ``g / (1
+ e^-g) * u`` in fp32, times the row's routing weight. The result is the unfused three kernels'
bits (checked on the GPU), without writing and reading the two ``[T, N]`` projections and with
one launch instead of three.
"""

import triton
import triton.language as tl

from v4stack.kernels.launch import next_pow2


@triton.jit
def grouped_swiglu_kernel(x_desc, w1_desc, w3_desc, Y, Off, WT, E, N, K, s_ym, limit, EB: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_SMS: tl.constexpr,
                          CLAMP: tl.constexpr, HAS_W: tl.constexpr, FLAT: tl.constexpr):
    e = tl.arange(0, EB)
    lo = tl.load(Off + e, mask=e < E, other=0).to(tl.int32)
    hi = tl.load(Off + e + 1, mask=e < E, other=0).to(tl.int32)
    tiles = (hi - lo + BM - 1) // BM
    ends = tl.cumsum(tiles, 0)
    num_m = tl.sum(tiles, 0)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for t in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=FLAT):
        m = t % num_m
        pn = t // num_m
        mine = tl.sum((ends <= m).to(tl.int32), 0)
        sel = e == mine
        first = tl.sum(tl.where(sel, ends - tiles, 0), 0)
        r0 = tl.sum(tl.where(sel, lo, 0), 0) + (m - first) * BM
        r1 = tl.sum(tl.where(sel, hi, 0), 0)
        wrow = mine * N + pn * BN
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([r0, ki * BK])
            acc_g = tl.dot(a, w1_desc.load([wrow, ki * BK]).T, acc_g)
            acc_u = tl.dot(a, w3_desc.load([wrow, ki * BK]).T, acc_u)
        rows = (r0 + tl.arange(0, BM)).to(tl.int64)
        cols = pn * BN + tl.arange(0, BN)
        rmask = rows < r1
        # the unfused GEMMs' stored values, then swiglu_act_kernel's arithmetic
        g = acc_g.to(Y.dtype.element_ty).to(tl.float32)  # the output dtype is x's (``usable``)
        u = acc_u.to(Y.dtype.element_ty).to(tl.float32)
        if CLAMP:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        act = tl.div_rn(g, 1.0 + tl.exp(-g)) * u
        if HAS_W:
            act = act * tl.load(WT + rows, mask=rmask, other=0.0)[:, None]
        tl.store(Y + rows[:, None] * s_ym + cols[None, :], act.to(Y.dtype.element_ty),
                 mask=rmask[:, None] & (cols < N)[None, :])


# the tile of every call unless one is given (bench/grouped_swiglu.py sweeps the candidates). Two
# [BM, BN] fp32 accumulators: at 64 x 128 four warps spill (ptxas: 916 bytes a thread), eight do not.
# Measured on the H200 at the flash4 engine's calls (bench/results/grouped_swiglu_h200.json): at
# 1792 rows (199 a expert) 64 x 64 two a SM took 131 us against 138 us for the three kernels;
# at 448 rows (50 a expert) 93 against 91, at 112 rows 99 against 82. So the dispatch takes it
# from FUSED_FROM_ROWS rows a expert only.
TILE = dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=4, occ=2, FLAT=False)
FUSED_FROM_ROWS = 128
CANDIDATES = (TILE, dict(TILE, occ=1), dict(TILE, BN=128, num_warps=8, num_stages=3, occ=1),
              dict(TILE, BN=128, num_warps=8, occ=1), dict(TILE, BN=128, num_warps=8, num_stages=2, occ=2),
              dict(TILE, BM=128, num_warps=8, occ=1), dict(TILE, BN=128, num_stages=3, occ=1))


def usable(x, w1, w3, out_dtype) -> bool:
    """TMA's terms (``triton_grouped_tma.usable``) for ``x`` and both weights, of one shape, and the
    activation written in ``x``'s dtype (the dtype the unfused GEMMs round to)."""
    from v4stack.kernels import triton_grouped_tma as tma

    return out_dtype == x.dtype and w1.shape == w3.shape and w1.dtype == w3.dtype == x.dtype and tma.usable(x, w1) \
        and w3.data_ptr() % 16 == 0 and w1.is_contiguous() and w3.is_contiguous()


def grouped_swiglu(x, w1, w3, offsets, limit: float, weight, out_dtype, tile: dict | None = None):
    """``swiglu_act(x @ w1[e].T, x @ w3[e].T, limit, weight, out_dtype)`` per expert's rows (``x
    [T, K]`` sorted by expert, ``w1`` / ``w3`` ``[E, N, K]``, ``offsets [E + 1]``, ``weight [T]``
    fp32 or None) in one launch."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    from v4stack.kernels.triton_tma import num_sms

    T, K = x.shape
    E, N, _ = w1.shape
    y = torch.empty(T, N, dtype=out_dtype, device=x.device)
    if T == 0:
        return y
    t = tile or TILE
    bm, bn, bk = t["BM"], t["BN"], t["BK"]
    off = offsets if offsets.dtype == torch.int64 else offsets.to(torch.int64)
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    w1d = TensorDescriptor.from_tensor(w1.view(E * N, K), [bn, bk])
    w3d = TensorDescriptor.from_tensor(w3.view(E * N, K), [bn, bk])
    nsm = num_sms() * t.get("occ", 1)
    grid = (min(nsm, (min(E, T) + T // bm) * triton.cdiv(N, bn)),)
    grouped_swiglu_kernel[grid](xd, w1d, w3d, y, off, weight if weight is not None else y, E, N, K, y.stride(0),
                                float(limit), EB=max(16, next_pow2(E)), BM=bm, BN=bn, BK=bk, NUM_SMS=nsm,
                                CLAMP=limit > 0, HAS_W=weight is not None, FLAT=t.get("FLAT", False),
                                num_warps=t["num_warps"], num_stages=t["num_stages"])
    return y
