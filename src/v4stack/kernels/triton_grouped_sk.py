"""The grouped (per-expert) GEMM with wide tiles and a stream-K tail (Triton, Hopper; fast mode).

At decode widths the grouped expert GEMMs have few output tiles per multiprocessor: flash4 at
batch 256 (9 experts, ~200 rows each) has 144 tiles of 128 x 256 on an H100's 132. Wide tiles
do the most MMA work per byte they bring in, but whole tiles leave the last round nearly empty,
and narrow tiles (the shipped 64 x 128, two programs an SM) fill the rounds at a lower MMA rate.
This kernel runs ``#SM`` programs, one an SM:

- the tiles of whole rounds (``num_tiles - num_tiles % #SM``) as whole tiles, row tile fastest
  (the programs in flight at once share an expert's weight tile through L2), as
  ``triton_grouped_tma`` does;
- the rest - fewer tiles than programs - split along K into equal runs of K steps, one run a
  program (a range crosses at most one tile end, so a program runs at most two), each run's fp32
  partial left in the program's workspace slot;
- then a second launch (``grouped_sk_sum_kernel``, a program per tail tile and row chunk) sums each
  split tile's partials in K order and stores it. The launch boundary orders the partials before
  their sums: no program waits on another, whatever the GPU runs beside it.

Which tiles are split depends on the routing, so a row's bits depend on the batch: fast mode only
(invariant mode keeps ``triton_grouped_tma``'s whole-K chains). The sum of a split tile's runs is
in a fixed order, so a call's bits are the same every time for the same inputs.
"""

import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import next_pow2


@triton.jit
def _locate(t, num_m, e, lo, hi, tiles, ends, N, BM: tl.constexpr, BN: tl.constexpr):
    """Output tile ``t`` (row tile fastest): its first row, one past its expert's last row, its
    first row of W viewed as ``[E * N, K]``, its first column."""
    m = t % num_m
    pn = t // num_m
    mine = tl.sum((ends <= m).to(tl.int32), 0)
    sel = e == mine
    first = tl.sum(tl.where(sel, ends - tiles, 0), 0)
    r0 = tl.sum(tl.where(sel, lo, 0), 0) + (m - first) * BM
    r1 = tl.sum(tl.where(sel, hi, 0), 0)
    return r0, r1, mine * N + pn * BN, pn * BN


@triton.jit
def _run(x_desc, w_desc, r0, wrow, k0, k1, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """K steps ``k0 .. k1 - 1`` of a tile from a zero start."""
    acc = tl.zeros([BM, BN], tl.float32)
    for ki in range(k0, k1):
        a = x_desc.load([r0, ki * BK])
        b = w_desc.load([wrow, ki * BK])
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _start(q, total, PT):
    """First K step (of the tail's) that program ``q`` runs."""
    return (q * total) // PT


@triton.jit
def _holder(step, total, PT):
    """The program whose run holds tail step ``step``."""
    return ((step + 1) * PT + total - 1) // total - 1


@triton.jit
def grouped_sk_kernel(x_desc, w_desc, Y, Off, WS, E, N, K, s_ym, EB: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, P: tl.constexpr):
    pdl_enter()
    e = tl.arange(0, EB)
    lo = tl.load(Off + e, mask=e < E, other=0).to(tl.int32)
    hi = tl.load(Off + e + 1, mask=e < E, other=0).to(tl.int32)
    tiles = (hi - lo + BM - 1) // BM
    ends = tl.cumsum(tiles, 0)
    num_m = tl.sum(tiles, 0)
    num_t = num_m * tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    pid = tl.program_id(0)
    full = num_t - num_t % P
    rr = tl.arange(0, BM)
    cc = tl.arange(0, BN)
    for t in tl.range(pid, full, P):  # whole rounds: whole tiles
        r0, r1, wrow, c0 = _locate(t, num_m, e, lo, hi, tiles, ends, N, BM, BN)
        acc = _run(x_desc, w_desc, r0, wrow, 0, k_tiles, BM, BN, BK)
        rows = (r0 + rr).to(tl.int64)
        cols = c0 + cc
        tl.store(Y + rows[:, None] * s_ym + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=(rows < r1)[:, None] & (cols < N)[None, :])
    total = (num_t - full) * k_tiles  # the tail's K steps: PT equal runs of at least one step
    PT = tl.minimum(total, P)
    if pid < PT:
        s0 = _start(pid, total, PT)
        s1 = _start(pid + 1, total, PT)
        t0 = s0 // k_tiles
        n_runs = 1 + (s1 > (t0 + 1) * k_tiles).to(tl.int32)  # a range crosses at most one tile end
        for r in range(n_runs):  # run r's partial in slot 2 pid + r
            tt = t0 + r
            kb = tl.maximum(s0 - tt * k_tiles, 0)
            ke = tl.minimum(k_tiles, s1 - tt * k_tiles)
            r0, r1, wrow, c0 = _locate(full + tt, num_m, e, lo, hi, tiles, ends, N, BM, BN)
            acc = _run(x_desc, w_desc, r0, wrow, kb, ke, BM, BN, BK)
            tl.store(WS + (2 * pid + r) * BM * BN + rr[:, None] * BN + cc[None, :], acc)


@triton.jit
def grouped_sk_sum_kernel(Y, Off, WS, E, N, K, s_ym, EB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, RC: tl.constexpr, P: tl.constexpr):
    """Program ``(tt, c)``: rows ``c RC ..`` of tail tile ``tt``, the sum of its runs' partials in K
    order (run of program q: slot ``2 q``, or ``2 q + 1`` where q's range began in the tile before)."""
    pdl_enter()
    tt = tl.program_id(0)
    e = tl.arange(0, EB)
    lo = tl.load(Off + e, mask=e < E, other=0).to(tl.int32)
    hi = tl.load(Off + e + 1, mask=e < E, other=0).to(tl.int32)
    tiles = (hi - lo + BM - 1) // BM
    ends = tl.cumsum(tiles, 0)
    num_m = tl.sum(tiles, 0)
    num_t = num_m * tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    full = num_t - num_t % P
    if tt < num_t - full:
        total = (num_t - full) * k_tiles
        PT = tl.minimum(total, P)
        q_lo = _holder(tt * k_tiles, total, PT)
        q_hi = _holder((tt + 1) * k_tiles - 1, total, PT)
        r0, r1, wrow, c0 = _locate(full + tt, num_m, e, lo, hi, tiles, ends, N, BM, BN)
        ro = tl.program_id(1) * RC + tl.arange(0, RC)
        cc = tl.arange(0, BN)
        o = ro[:, None] * BN + cc[None, :]
        part = tl.zeros([RC, BN], tl.float32)
        for q in range(q_lo, q_hi + 1):
            sq = 2 * q + (_start(q, total, PT) < tt * k_tiles).to(tl.int32)
            part += tl.load(WS + sq * BM * BN + o)
        rows = (r0 + ro).to(tl.int64)
        cols = c0 + cc
        tl.store(Y + rows[:, None] * s_ym + cols[None, :], part.to(Y.dtype.element_ty),
                 mask=(rows < r1)[:, None] & (cols < N)[None, :])


SK_TILE = dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, RC=16)
_work: dict = {}


def workspace(device, P: int, t: dict):
    """Per device: two fp32 tile slots a program (its runs' partials; a program's range of the tail
    crosses at most one tile end)."""
    import torch

    key = (str(device), P, t["BM"], t["BN"])
    if key not in _work:
        _work[key] = torch.empty(2 * P * t["BM"] * t["BN"], dtype=torch.float32, device=device)
    return _work[key]


def ready(device, P: int | None = None, t: dict = SK_TILE) -> bool:
    """Whether the workspace exists (it is not made while a graph is being captured)."""
    from v4stack.kernels.triton_tma import num_sms

    return (str(device), P or num_sms(), t["BM"], t["BN"]) in _work


def grouped_linear_sk(x, w, off, y, t: dict = SK_TILE, P: int | None = None):
    """``y[rows of e] = x[rows of e] @ w[e].T`` (``triton_grouped_tma.grouped_linear_tma``'s terms)
    with whole rounds of wide tiles and the rest split along K over all programs. ``P``: the
    programs (default one an SM; all must be resident at once)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from v4stack.kernels.triton_tma import num_sms

    T, K = x.shape
    E, N, _ = w.shape
    P = P or num_sms()
    ws = workspace(x.device, P, t)
    bm, bn, bk = t["BM"], t["BN"], t["BK"]
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w.view(E * N, K), [bn, bk])
    eb = max(16, next_pow2(E))
    grouped_sk_kernel[(P,)](xd, wd, y, off, ws, E, N, K, y.stride(0), EB=eb, BM=bm, BN=bn, BK=bk, P=P,
                            num_warps=t["num_warps"], num_stages=t["num_stages"])
    grouped_sk_sum_kernel[(P, bm // t["RC"])](y, off, ws, E, N, K, y.stride(0), EB=eb, BM=bm, BN=bn, BK=bk,
                                               RC=t["RC"], P=P, num_warps=4)
    return y



def num_sms_default() -> int:
    from v4stack.kernels.triton_tma import num_sms

    return num_sms()
