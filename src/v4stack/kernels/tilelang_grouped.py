"""The grouped (per-expert) GEMM in TileLang: bulk-copied tiles in a warp-specialised pipeline.

Rows sorted by expert (``off [E + 1]`` on the device), ``w [E, N, K]``: ``y[rows of e] = x[rows of
e] @ w[e].T``. Row tiles are ``triton_grouped``'s (expert ``e`` owns ``ceil(n_e / BM)`` tiles of
BM rows from its first row, tile ids expert after expert); block ``(n, j)`` finds its tile's expert
and rows from ``off`` (a walk over the experts); the grid is the bound ``ceil(T / BM) + E`` (so a
captured graph holds for any routing) and a block past the last tile computes a tile of zero rows
past ``T`` and stores nothing (a branch around the pipeline is not something the compiler's
warp-specialised form takes). X and
W tiles arrive by the tensor-memory accelerator, ``stages`` deep, the products on wgmma; rows past
the expert's end are computed (they belong to the next expert) and never stored. Fast mode only
where measured faster than the Triton kernels (``bench/grouped_tilelang.py``).

A row's K chain is the Triton kernels' (wgmma 16-wide steps in K order from zero, fp32), checked
on the GPU against them bit for bit before a shape is served. This module imports ``tilelang``
lazily.
"""

# no ``from __future__ import annotations``: TileLang reads the kernel's annotations as objects

import functools

TILE = dict(BM=64, BN=256, BK=64, stages=4, threads=128)


def program(N: int, K: int, dtype: str = "bfloat16", **tile):
    import tilelang.language as T

    t = {**TILE, **tile}
    BM, BN, BK = t["BM"], t["BN"], t["BK"]
    NT, E1, MT = T.dynamic("t"), T.dynamic("e1"), T.dynamic("mt")

    @T.prim_func
    def grouped(X: T.Tensor((NT, K), dtype), W: T.Tensor((E1 - 1, N, K), dtype), Off: T.Tensor((E1,), "int64"),
                Y: T.Tensor((NT, N), dtype), Grid: T.Tensor((MT,), "int32")):
        with T.Kernel(T.ceildiv(N, BN), MT, threads=t["threads"]) as (bx, by):
            Xs = T.alloc_shared((BM, BK), dtype)
            Ws = T.alloc_shared((BN, BK), dtype)
            acc = T.alloc_fragment((BM, BN), "float32")
            ex = T.alloc_local((1,), "int32")
            r0 = T.alloc_local((1,), "int32")
            r1 = T.alloc_local((1,), "int32")
            seen = T.alloc_local((1,), "int32")
            ex[0] = E1 - 2  # past the last tile: the last expert's weights at rows from T (read as zeros), none stored
            r0[0] = T.Cast("int32", Off[E1 - 1])
            r1[0] = T.Cast("int32", Off[E1 - 1])
            seen[0] = 0
            for i in T.serial(E1 - 1):
                lo = T.Cast("int32", Off[i])
                hi = T.Cast("int32", Off[i + 1])
                nt = (hi - lo + BM - 1) // BM
                if by >= seen[0] and by < seen[0] + nt:
                    ex[0] = i
                    r0[0] = lo + (by - seen[0]) * BM
                    r1[0] = hi
                seen[0] = seen[0] + nt
            T.clear(acc)
            for k in T.Pipelined(T.ceildiv(K, BK), num_stages=t["stages"]):
                T.copy(X[r0[0], k * BK], Xs)
                T.copy(W[ex[0], bx * BN, k * BK], Ws)
                T.gemm(Xs, Ws, acc, transpose_B=True)
            for i, j in T.Parallel(BM, BN):
                if r0[0] + i < r1[0] and bx * BN + j < N:
                    Y[r0[0] + i, bx * BN + j] = acc[i, j]

    return grouped


@functools.lru_cache(maxsize=None)
def _compiled(N: int, K: int, dtype: str, tile: tuple):
    import tilelang
    import torch
    from tilelang import tvm
    from tilelang.transform import PassConfigKey

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    return tilelang.compile(program(N, K, dtype, **dict(tile)), target=target,
                            pass_configs={PassConfigKey.TL_ENABLE_FAST_MATH: False})


def grouped_linear(x, w, off, y=None, tile: dict | None = None):
    """``y [T, N]`` for contiguous bf16 ``x [T, K]``, ``w [E, N, K]`` and int64 ``off [E + 1]``."""
    import torch

    T_, K = x.shape
    E, N, _ = w.shape
    t = {**TILE, **(tile or {})}
    y = torch.empty(T_, N, dtype=x.dtype, device=x.device) if y is None else y
    grid = torch.empty(-(-T_ // t["BM"]) + E, dtype=torch.int32, device=x.device)  # its length is the grid
    fn = _compiled(N, K, str(x.dtype).replace("torch.", ""), tuple(sorted(t.items())))
    fn(x, w, off, y, grid)
    return y
