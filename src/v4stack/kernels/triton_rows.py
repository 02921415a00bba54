"""Row-local invariant kernels (Triton): softmax / log_softmax, weighted_pool, moe_combine.

One program owns one row (or one row's column block); every reduction inside it is over that
row only, in a fixed order set by the row width and the block size (a ``BLOCK``-wide vector
accumulated slice by slice, then one tree over the vector). Nothing depends on how many rows
the call has.
"""

import triton
import triton.language as tl

from v4stack.kernels.launch import launch

ROW_BLOCK = 4096  # widest row handled in one slice; wider rows loop over slices of this size


@triton.jit
def softmax_kernel(X, Y, N, s_x, s_y, LOG: tl.constexpr, BLOCK: tl.constexpr, ONE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    if ONE:
        x = tl.load(X + r * s_x + o, mask=o < N, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        e = tl.exp(x - m)
        s = tl.sum(e, 0)
        if LOG:
            y = (x - m) - tl.log(s)
        else:
            y = tl.div_rn(e, s)
        tl.store(Y + r * s_y + o, y.to(Y.dtype.element_ty), mask=o < N)
    else:
        mv = tl.full([BLOCK], float("-inf"), tl.float32)
        for c in range(0, N, BLOCK):
            x = tl.load(X + r * s_x + c + o, mask=c + o < N, other=float("-inf")).to(tl.float32)
            mv = tl.maximum(mv, x)
        m = tl.max(mv, 0)
        sv = tl.zeros([BLOCK], tl.float32)
        for c in range(0, N, BLOCK):
            x = tl.load(X + r * s_x + c + o, mask=c + o < N, other=float("-inf")).to(tl.float32)
            sv += tl.exp(x - m)
        s = tl.sum(sv, 0)
        for c in range(0, N, BLOCK):
            x = tl.load(X + r * s_x + c + o, mask=c + o < N, other=float("-inf")).to(tl.float32)
            if LOG:
                y = (x - m) - tl.log(s)
            else:
                y = tl.div_rn(tl.exp(x - m), s)
            tl.store(Y + r * s_y + c + o, y.to(Y.dtype.element_ty), mask=c + o < N)


def softmax(x, dim=-1, log=False):
    import torch

    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] and N:
        block = min(ROW_BLOCK, triton.next_power_of_2(N))
        launch(softmax_kernel, (x2.shape[0],), x2, y, N, x2.stride(0), y.stride(0), LOG=log, BLOCK=block, ONE=N <= block,
                                       num_warps=8 if block >= 2048 else 4)
    return y.view(x.shape)


def log_softmax(x, dim=-1):
    return softmax(x, dim, log=True)


@triton.jit
def pool_kernel(KV, S, Y, P, C, s_kr, s_kp, s_sr, s_sp, s_yr, BP: tl.constexpr, BC: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    p = tl.arange(0, BP)
    m2 = (p < P)[:, None] & (c < C)[None, :]
    s = tl.load(S + r * s_sr + p[:, None] * s_sp + c[None, :], mask=m2, other=float("-inf")).to(tl.float32)
    kv = tl.load(KV + r * s_kr + p[:, None] * s_kp + c[None, :], mask=m2, other=0.0).to(tl.float32)
    m = tl.max(s, 0)
    e = tl.exp(s - m[None, :])
    w = tl.div_rn(e, tl.sum(e, 0)[None, :])
    y = tl.sum(w * kv, 0)
    tl.store(Y + r * s_yr + c, y.to(Y.dtype.element_ty), mask=c < C)


def weighted_pool(kv, score, dim):
    """``sum_j softmax_j(score) * kv_j`` over dim 1 of ``[R, P, C]`` tensors (leading dims flattened)."""
    import torch

    P, C = kv.shape[-2], kv.shape[-1]
    kv3, s3 = kv.reshape(-1, P, C).contiguous(), score.reshape(-1, P, C).contiguous()
    out_dtype = torch.promote_types(kv.dtype, score.dtype)
    y = torch.empty(kv3.shape[0], C, dtype=out_dtype, device=kv.device)
    if kv3.shape[0] and C:
        bc = min(256, triton.next_power_of_2(C))
        launch(pool_kernel, (kv3.shape[0], triton.cdiv(C, bc)), kv3, s3, y, P, C, kv3.stride(0), kv3.stride(1), s3.stride(0),
                                                         s3.stride(1), y.stride(0), BP=triton.next_power_of_2(P),
                                                         BC=bc)
    return y.view(*kv.shape[:-2], C)


@triton.jit
def combine_kernel(Yin, Idx, Out, k, D, s_yn, s_yk, s_in, s_on, BK: tl.constexpr, BD: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    j = tl.arange(0, BK)
    ids = tl.load(Idx + n * s_in + j, mask=j < k, other=0)
    # rank of slot j in (expert id, slot) order: how many slots sort before it
    before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (j[None, :] < j[:, None]))
    rank = tl.sum((before & (j < k)[None, :]).to(tl.int32), 1)
    acc = tl.zeros([BD], tl.float32)
    for r in range(0, k):
        slot = tl.sum(tl.where((rank == r) & (j < k), j, 0), 0)
        acc += tl.load(Yin + n * s_yn + slot * s_yk + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(Out + n * s_on + d, acc, mask=d < D)


def moe_combine(y, idx):
    """Per token, ``y [N, k, d]`` summed left to right in ascending expert id (ties in slot order), fp32."""
    import torch

    N, k, D = y.shape
    yc, ic = y.contiguous(), idx.contiguous()
    out = torch.empty(N, D, dtype=torch.float32, device=y.device)
    if N and D:
        bd = min(1024, triton.next_power_of_2(D))
        launch(combine_kernel, (N, triton.cdiv(D, bd)), yc, ic, out, k, D, yc.stride(0), yc.stride(1), ic.stride(0),
                                                out.stride(0), BK=max(2, triton.next_power_of_2(k)), BD=bd)
    return out


@triton.jit
def rms_norm_kernel(X, W, Y, N, Nf, s_x, s_y, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for c in range(0, N, BLOCK):
        x = tl.load(X + r * s_x + c + o, mask=c + o < N, other=0.0).to(tl.float32)
        acc += x * x
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(acc, 0), Nf) + eps))
    for c in range(0, N, BLOCK):
        x = tl.load(X + r * s_x + c + o, mask=c + o < N, other=0.0).to(tl.float32)
        y = x * inv
        if HAS_W:
            y = y * tl.load(W + c + o, mask=c + o < N, other=0.0).to(tl.float32)
        tl.store(Y + r * s_y + c + o, y.to(Y.dtype.element_ty), mask=c + o < N)


def rms_norm(x, weight, eps):
    """RMSNorm of each row: fp32 sum of squares in a fixed order, ``1 / sqrt`` correctly rounded."""
    import torch

    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] and N:
        w = weight.contiguous() if weight is not None else x2
        launch(rms_norm_kernel, (x2.shape[0],), x2, w, y, N, float(N), x2.stride(0), y.stride(0), float(eps),
               HAS_W=weight is not None, BLOCK=min(ROW_BLOCK, triton.next_power_of_2(N)))
    return y.view(x.shape)
