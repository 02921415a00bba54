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
  program, a run crossing at most one tile boundary. A run that does not reach its tile's last K
  step leaves its fp32 partial in a workspace slot and raises its flag (release); the run that
  reaches it (the tile's owner) waits for the flags of the runs before it (acquire), sums their
  partials in K order with its own and stores the tile. Each run that leaves a partial is the
  last of its program, so a program waits only on programs before it and every program is
  resident (one an SM): no cycle, no starvation. The owner lowers the flags it consumed.

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
def _start(q, total, P: tl.constexpr):
    """First K step (of the tail's) that program ``q`` runs."""
    return (q * total) // P


@triton.jit
def grouped_sk_kernel(x_desc, w_desc, Y, Off, WS, Flag, E, N, K, s_ym, EB: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, RC: tl.constexpr, P: tl.constexpr):
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
    total = (num_t - full) * k_tiles  # the tail's K steps, P equal runs
    it = _start(pid, total, P)
    it1 = _start(pid + 1, total, P)
    slot = BM * BN
    while it < it1:
        tt = it // k_tiles
        kb = it - tt * k_tiles
        ke = tl.minimum(k_tiles, kb + it1 - it)
        r0, r1, wrow, c0 = _locate(full + tt, num_m, e, lo, hi, tiles, ends, N, BM, BN)
        acc = _run(x_desc, w_desc, r0, wrow, kb, ke, BM, BN, BK)
        # every run leaves its sum in a slot (using ``acc`` in one place only keeps it out of local memory)
        ends_tile = ke == k_tiles
        tl.store(WS + (2 * pid + 1 - ends_tile.to(tl.int32)) * slot + rr[:, None] * BN + cc[None, :], acc)
        tl.debug_barrier()
        if ke < k_tiles:  # short of the tile's end: the program's last run; its partial is ready
            tl.atomic_xchg(Flag + pid, 1, sem="release", scope="gpu")
        else:  # the tile's owner: the runs before its own (kb > 0) are the last runs of programs q_lo .. pid - 1
            s = tt * k_tiles
            q_lo = ((s + 1) * P + total - 1) // total - 1  # the program whose run holds step s
            q_hi = tl.where(kb > 0, pid, q_lo)  # a tile in one run waits for nobody
            for q in range(q_lo, q_hi):
                if _start(q + 1, total, P) > _start(q, total, P):  # programs without a run leave none
                    f = tl.atomic_add(Flag + q, 0, sem="acquire", scope="gpu")
                    while f == 0:
                        f = tl.atomic_add(Flag + q, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
            oc = c0 + cc
            for rc in tl.static_range(0, BM, RC):
                ro = rc + tl.arange(0, RC)
                o = ro[:, None] * BN + cc[None, :]
                part = tl.zeros([RC, BN], tl.float32)
                for q in range(q_lo, q_hi):
                    if _start(q + 1, total, P) > _start(q, total, P):
                        part += tl.load(WS + (2 * q + 1) * slot + o, cache_modifier=".cg")
                part += tl.load(WS + (2 * pid) * slot + o, cache_modifier=".cg")
                orow = (r0 + ro).to(tl.int64)
                tl.store(Y + orow[:, None] * s_ym + oc[None, :], part.to(Y.dtype.element_ty),
                         mask=(orow < r1)[:, None] & (oc < N)[None, :])
            for q in range(q_lo, q_hi):
                if _start(q + 1, total, P) > _start(q, total, P):
                    tl.atomic_xchg(Flag + q, 0, sem="relaxed", scope="gpu")
            tl.debug_barrier()  # the slot is read by every thread before a later run rewrites it
        it += ke - kb


SK_TILE = dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, RC=16)
_work: dict = {}


def workspace(device, P: int, t: dict):
    """Per device: two fp32 tile slots a program (a run's partial, an owner's own run) and a flag a
    program (zero between calls: every raised flag is lowered by the owner that consumed it)."""
    import torch

    key = (str(device), P, t["BM"], t["BN"])
    if key not in _work:
        _work[key] = (torch.empty(2 * P * t["BM"] * t["BN"], dtype=torch.float32, device=device),
                      torch.zeros(P, dtype=torch.int32, device=device))
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
    ws, flag = workspace(x.device, P, t)
    bm, bn, bk = t["BM"], t["BN"], t["BK"]
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w.view(E * N, K), [bn, bk])
    grouped_sk_kernel[(P,)](xd, wd, y, off, ws, flag, E, N, K, y.stride(0), EB=max(16, next_pow2(E)), BM=bm, BN=bn,
                            BK=bk, RC=t["RC"], P=P, num_warps=t["num_warps"], num_stages=t["num_stages"])
    return y



def num_sms_default() -> int:
    from v4stack.kernels.triton_tma import num_sms

    return num_sms()
