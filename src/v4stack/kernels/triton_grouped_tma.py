"""The grouped (per-expert) GEMM on Hopper's tensor-memory accelerator, persistent (Triton).

Rows sorted by expert (``offsets [E + 1]`` on the device), ``w [E, N, K]``. The row tiles are
``triton_grouped``'s (expert ``e`` owns ``ceil(n_e / BM)`` tiles of BM rows from its first row,
tile ids running expert after expert, found in the kernel from a prefix sum of the offsets); an
output tile is (row tile ``m``, column tile ``n``), ids with ``m`` fastest.

The unit of work is one K chunk of one output tile (``triton_grouped.chunk``: K in at most two
chunks, the element's two MMA chains summed once). Units run chunk-major - every tile's first
chunk, then every tile's second - and each of ``min(#SM, bound)`` programs takes an equal run of
consecutive units, so a call's MMA work is spread evenly over the SMs however the tiles fall
(whole tiles leave most SMs idle for a second wave at decode: 144 tiles on 132 SMs). A first
chunk's sum goes to an fp32 workspace and raises its tile's flag; the program holding the second
chunk waits for the flag, adds the two and stores the tile (and lowers the flag for the next
call). A second chunk's first chunk is an earlier unit, so its owner is an earlier program (or
itself, earlier), and first chunks wait for nothing: the wait always ends, on the GPU (programs
start in order) and in the interpreter (one program after another).

X and W are read through TMA descriptors: X ``[T, K]`` in BM x BK boxes from the tile's first
row (rows past the expert's end belong to the next expert or, past ``T``, read as zeros; their
results are never stored), W as ``[E * N, K]`` in BN x BK boxes from row ``e * N + n * BN``
(columns past ``N`` are never stored). The output is stored with a row mask ``< the expert's
end``, since a tile may end inside the next expert's rows.

Each chain is ``triton_gemm._mm_tile``'s over its chunk (the MMA steps in K order from a zero
start, K past the end read as zeros), the chunks added as ``triton_grouped``'s table kernel adds
them - only which program computes a unit, and when, differs, so a row's bits are those of the
table kernel's tiles (checked on the GPU, bench ``grouped_tiles.py``).
"""

import triton
import triton.language as tl

from v4stack.kernels.launch import cdiv, next_pow2


@triton.jit
def grouped_tma_kernel(x_desc, w_desc, Y, Off, WS, FLAG, E, N, K, CH, s_ym, EB: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr):
    e = tl.arange(0, EB)
    lo = tl.load(Off + e, mask=e < E, other=0).to(tl.int32)
    hi = tl.load(Off + e + 1, mask=e < E, other=0).to(tl.int32)
    tiles = (hi - lo + BM - 1) // BM
    ends = tl.cumsum(tiles, 0)  # row tile id one past each expert's last
    num_m = tl.sum(tiles, 0)
    n_t = num_m * tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    kc = tl.cdiv(CH, BK)  # the first chunk's K steps (CH <= K)
    two = k_tiles > kc
    units = n_t * tl.where(two, 2, 1)
    p = tl.program_id(0)
    P = tl.num_programs(0)
    ib = tl.arange(0, BM)
    jb = tl.arange(0, BN)
    wsoff = ib[:, None] * BN + jb[None, :]
    for u in range(p * units // P, (p + 1) * units // P):
        c = u // n_t
        t = u - c * n_t
        m = t % num_m
        pn = t // num_m
        mine = tl.sum((ends <= m).to(tl.int32), 0)  # experts wholly before row tile m: m's expert
        sel = e == mine
        first = tl.sum(tl.where(sel, ends - tiles, 0), 0)
        r0 = tl.sum(tl.where(sel, lo, 0), 0) + (m - first) * BM
        r1 = tl.sum(tl.where(sel, hi, 0), 0)
        wrow = mine * N + pn * BN
        acc = tl.zeros([BM, BN], tl.float32)
        for ki in range(c * kc, tl.where(c == 0, kc, k_tiles)):
            a = x_desc.load([r0, ki * BK])
            b = w_desc.load([wrow, ki * BK])
            acc = tl.dot(a, b.T, acc)
        ws = WS + t.to(tl.int64) * (BM * BN) + wsoff
        if two & (c == 0):
            tl.store(ws, acc)
            tl.debug_barrier()  # the whole tile's partial is written before the flag says so
            tl.atomic_xchg(FLAG + t, 1, sem="release", scope="gpu")
        else:
            if two:
                f = tl.atomic_add(FLAG + t, 0, sem="acquire", scope="gpu")
                while f == 0:
                    f = tl.atomic_add(FLAG + t, 0, sem="acquire", scope="gpu")
                acc = tl.load(ws, cache_modifier=".cg") + acc
                tl.atomic_xchg(FLAG + t, 0, sem="relaxed", scope="gpu")
            rows = (r0 + ib).to(tl.int64)
            cols = pn * BN + jb
            tl.store(Y + rows[:, None] * s_ym + cols[None, :], acc.to(Y.dtype.element_ty),
                     mask=(rows < r1)[:, None] & (cols < N)[None, :])


def usable(x, w) -> bool:
    """TMA's terms: 16-byte aligned bases and row strides (bf16 / fp16, K a multiple of 8)."""
    import torch

    return (x.dtype in (torch.bfloat16, torch.float16) and x.shape[1] % 8 == 0 and x.data_ptr() % 16 == 0
            and w.data_ptr() % 16 == 0 and x.stride(1) == 1 and x.stride(0) == x.shape[1])


_FLAGS: dict = {}  # device -> int32 flags, all zero between calls (each call lowers what it raised)


def flags(device, n: int):
    """At least ``n`` zero flags on ``device``, kept for the process: a captured graph holds the
    buffer it was captured with, so a larger one is added, never swapped in for the old."""
    import torch

    have = _FLAGS.get(str(device))
    if have is None or have[-1].numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _FLAGS.setdefault(str(device), []).append(buf)
        return buf
    return have[-1]


def grouped_linear_tma(x, w, off, y, t, ch: int):
    """``y[rows of e] = x[rows of e] @ w[e].T`` for contiguous ``x [T, K]``, ``w [E, N, K]``, int64
    ``off [E + 1]`` (rising from 0 to T) and ``y [T, N]``; ``t`` the tile (BM, BN, BK, warps,
    stages, occ; a ``FLAT`` key, the whole-tile kernel's, no longer
    applies); ``ch`` the first K chunk's length (``triton_grouped.chunk``)."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    from v4stack.kernels.triton_tma import num_sms

    T, K = x.shape
    E, N, _ = w.shape
    bm, bn, bk = t["BM"], t["BN"], t["BK"]
    if K > ch and ch % bk:
        raise ValueError(f"grouped_linear_tma: the K chunk {ch} is not a multiple of BK={bk}")
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w.view(E * N, K), [bn, bk])
    bound = (min(E, T) + T // bm) * cdiv(N, bn)  # output tiles at most (specs_more.grouped_table)
    two = K > ch
    ws = torch.empty(bound * bm * bn if two else 1, dtype=torch.float32, device=x.device)
    grid = (min(num_sms() * t.get("occ", 1), bound * (2 if two else 1)),)
    grouped_tma_kernel[grid](xd, wd, y, off, ws, flags(x.device, bound), E, N, K, ch, y.stride(0),
                             EB=max(16, next_pow2(E)), BM=bm, BN=bn, BK=bk, num_warps=t["num_warps"],
                             num_stages=t["num_stages"])
    return y
