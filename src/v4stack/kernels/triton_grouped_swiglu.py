"""The experts' gate and up projections and their SwiGLU activation in one persistent TMA kernel (Triton).

``grouped_swiglu(x, w1, w3, off, limit, weight, out_dtype)`` is ``swiglu_act(grouped_linear(x,
w1, off), grouped_linear(x, w3, off), limit, weight, out_dtype)`` with the two GEMMs sharing one
walk over output tiles: a program's tile (row tile ``m`` of an expert, column tile ``n``) holds two
accumulators, the gate's and the up projection's, fed by one TMA box of X and one box of each
weight a K step; the epilogue rounds each accumulator to X's dtype (what ``grouped_linear``
stores), applies the clamps, the activation and the routing weight in fp32 exactly as
``triton_mhc.swiglu_act_kernel`` does, and stores the activation. The gate and up outputs are
never written, the activation's launch is gone, and the tile count of the walk doubles in work
per tile over one projection's (the last round of a persistent walk is the part that leaves
multiprocessors idle at decode widths).

The tile walk, the row tiles and the masked stores are ``triton_grouped_tma``'s, and so is the
K chain of each accumulator (MMA steps in K order from a zero start), so the activation's bits
are the composition's whichever tile runs it (checked on the GPU by ``bench/grouped_swiglu.py``
and on the CPU by the interpreter against the two launches).
"""

import triton
import triton.language as tl

from v4stack.kernels.launch import next_pow2

# (rows per expert up to, tile): bench/results/grouped_swiglu_h200.json
TILES = [
    (1 << 62, {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3, "occ": 1}),
]
MIN_ROWS_PER_EXPERT = 64  # below it the two launches (their own small-row tiles) serve


@triton.jit
def grouped_swiglu_kernel(x_desc, w1_desc, w3_desc, Y, Off, WT, E, N, K, s_ym, limit, EB: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_SMS: tl.constexpr,
                          CLAMP: tl.constexpr, HAS_W: tl.constexpr, MID_BF16: tl.constexpr):
    e = tl.arange(0, EB)
    lo = tl.load(Off + e, mask=e < E, other=0).to(tl.int32)
    hi = tl.load(Off + e + 1, mask=e < E, other=0).to(tl.int32)
    tiles = (hi - lo + BM - 1) // BM
    ends = tl.cumsum(tiles, 0)
    num_m = tl.sum(tiles, 0)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for t in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS):
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
            bg = w1_desc.load([wrow, ki * BK])
            bu = w3_desc.load([wrow, ki * BK])
            acc_g = tl.dot(a, bg.T, acc_g)
            acc_u = tl.dot(a, bu.T, acc_u)
        # the composition's gate and up values: stored in X's dtype by grouped_linear, read back widened
        if MID_BF16:
            g = acc_g.to(tl.bfloat16).to(tl.float32)
            u = acc_u.to(tl.bfloat16).to(tl.float32)
        else:
            g = acc_g.to(tl.float16).to(tl.float32)
            u = acc_u.to(tl.float16).to(tl.float32)
        if CLAMP:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        act = tl.div_rn(g, 1.0 + tl.exp(-g)) * u
        rows = (r0 + tl.arange(0, BM)).to(tl.int64)
        rmask = rows < r1
        if HAS_W:
            act = act * tl.load(WT + rows, mask=rmask, other=0.0)[:, None]
        cols = pn * BN + tl.arange(0, BN)
        tl.store(Y + rows[:, None] * s_ym + cols[None, :], act.to(Y.dtype.element_ty),
                 mask=rmask[:, None] & (cols < N)[None, :])


def tile_for(rows_per_expert: int) -> dict:
    for bound, t in TILES:
        if rows_per_expert <= bound:
            return t
    return TILES[-1][1]


def usable(x, w1, w3) -> bool:
    """TMA's terms for X and both stacks: bf16 / fp16, contiguous, 16-byte aligned, K a multiple of 8."""
    import torch

    return (x.dtype in (torch.bfloat16, torch.float16) and w1.dtype == x.dtype and w3.dtype == x.dtype
            and x.dim() == 2 and x.shape[1] % 8 == 0 and x.is_contiguous() and w1.is_contiguous()
            and w3.is_contiguous() and w1.shape == w3.shape and w1.shape[2] == x.shape[1]
            and x.data_ptr() % 16 == 0 and w1.data_ptr() % 16 == 0 and w3.data_ptr() % 16 == 0)


def grouped_swiglu(x, w1, w3, off, limit: float, weight, out_dtype, tile=None):
    """``x [T, K]`` sorted by expert (int64 ``off [E + 1]`` rising from 0 to T), ``w1`` / ``w3 [E,
    N, K]``, ``weight [T]`` fp32 or None -> the activation ``[T, N]`` in ``out_dtype``."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    from v4stack.kernels.triton_tma import num_sms

    T, K = x.shape
    E, N, _ = w1.shape
    y = torch.empty(T, N, dtype=out_dtype, device=x.device)
    if T == 0 or N == 0:
        return y
    t = tile or tile_for(-(-T // max(1, E)))
    bm, bn, bk = t["BM"], t["BN"], t["BK"]
    off = off if off.dtype == torch.int64 else off.to(torch.int64)
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    w1d = TensorDescriptor.from_tensor(w1.view(E * N, K), [bn, bk])
    w3d = TensorDescriptor.from_tensor(w3.view(E * N, K), [bn, bk])
    nsm = num_sms() * t.get("occ", 1)
    grid = (min(nsm, (min(E, T) + T // bm) * triton.cdiv(N, bn)),)
    wt = weight if weight is not None else y
    grouped_swiglu_kernel[grid](xd, w1d, w3d, y, off, wt, E, N, K, y.stride(0), float(limit),
                                EB=max(16, next_pow2(E)), BM=bm, BN=bn, BK=bk, NUM_SMS=nsm, CLAMP=limit > 0,
                                HAS_W=weight is not None, MID_BF16=x.dtype == torch.bfloat16,
                                num_warps=t["num_warps"], num_stages=t["num_stages"])
    return y
