"""Triton kernels of the device-side expert path (MegaMoE's pipeline and the baseline's experts).

- ``move_rows``: copies rows between a source's pair list and the expert-major rows of a wave,
  reading the bounds from device memory (no host round trip). ``pull`` reads token rows out of a
  source's symmetric buffer (a peer's memory, over NVLink) into the ring, with the routing weight
  and, for FP8 dispatch, the per-128 scale (rows arrive dequantized to bf16); ``push`` writes
  output rows into the source's combine buffer at their pair ids.
- ``swiglu_gemm``: Linear-1 of a wave as one grouped GEMM (gate and up of the same tile side by
  side), with V4's clamps, SiLU and the routing weight fused in the epilogue.
- ``down_gemm``: Linear-2 of a wave as one grouped GEMM.

The grouped GEMMs read a tile map built on the device (``tile_map``): tile ``t`` covers rows
``[r0[t], r1[t])`` of local expert ``e[t]``; a launch covers the tiles ``[ts[0], ts[ne])`` of a
wave and its grid is an upper bound, surplus programs exit at once. Tiles are fixed (BM x BN x BK
from the shapes alone, no split-K), so a row's result depends on that row and its expert only:
MegaMoE and the baseline get the same bits whatever the waves, the ring or the batch.
"""

from __future__ import annotations

import os

import torch

TUNED = os.environ.get("TRITON_INTERPRET", "0") != "1"

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - GPU machines have Triton; CPU runs use the torch path
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _move_rows(src, dst, pairs, dest, span, base, srcw, dstw, scales, k, ns, h: tl.constexpr,
                   PULL: tl.constexpr, WITH_W: tl.constexpr, FP8: tl.constexpr,
                   BR: tl.constexpr, BH: tl.constexpr):
        pid = tl.program_id(0)
        lo = tl.load(span)
        hi = tl.load(span + 1)
        if lo + pid * BR < hi:
            r = lo + pid * BR + tl.arange(0, BR)
            m = r < hi
            p = tl.load(pairs + r, mask=m, other=0).to(tl.int64)
            d = (tl.load(dest + r, mask=m, other=0) - tl.load(base)).to(tl.int64)
            if PULL:
                s_row = p // k
                d_row = d
            else:
                s_row = d
                d_row = p
            for c0 in range(0, h, BH):
                cols = c0 + tl.arange(0, BH)
                cm = m[:, None] & (cols < h)[None, :]
                v = tl.load(src + s_row[:, None] * h + cols[None, :], mask=cm)
                if FP8:
                    sc = tl.load(scales + s_row * ns + c0 // 128, mask=m, other=1.0)
                    v = (v.to(tl.float32) * sc[:, None]).to(tl.bfloat16)  # rows arrive as bf16
                tl.store(dst + d_row[:, None] * h + cols[None, :], v.to(dst.dtype.element_ty), mask=cm)
            if WITH_W:
                wv = tl.load(srcw + p, mask=m, other=0.0)
                tl.store(dstw + d, wv, mask=m)

    def _configs(shapes):
        return [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=st) for bn, bk, w, st in shapes]

    def _prune(configs, named_args, **kw):
        n, k = named_args["N"], named_args["K"]
        ok = [c for c in configs if n % c.kwargs["BN"] == 0 and k % c.kwargs["BK"] == 0]
        if ok:
            return ok
        bn, bk = min(128, n), min(64, k)  # small shapes (tests): one config that fits
        return [triton.Config({"BN": bn, "BK": bk}, num_warps=4, num_stages=2)]

    # The tile config is tuned once per (N, K) and kept for the process: it never depends on M,
    # so every call in a process (MegaMoE's waves, the baseline's single launch) gets the same bits.
    def _tuned(shapes):
        if not TUNED:  # the interpreter (CPU checks) cannot time configs: the launcher passes one
            return lambda f: f
        return triton.autotune(configs=_configs(shapes), key=["N", "K"], prune_configs_by={"early_config_prune": _prune})

    @triton.jit
    def _tile(t, t_e, t_r0, t_r1, base, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """Tile ``t`` of a wave: (expert, its rows in the wave's buffers, their mask, this program's
        columns, the K offsets of one step)."""
        e = tl.load(t_e + t).to(tl.int64)
        b = tl.load(base)
        rows = (tl.load(t_r0 + t) - b) + tl.arange(0, BM)
        rm = rows < tl.load(t_r1 + t) - b
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        return e, rows.to(tl.int64), rm, cols, tl.arange(0, BK)

    @_tuned([(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4)])
    @triton.jit
    def _swiglu_gemm(x, wr, w1, w3, act, t_e, t_r0, t_r1, ts, ne, base, limit, N: tl.constexpr, K: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        t = tl.load(ts) + tl.program_id(0)
        if t < tl.load(ts + ne):
            e, rows, rm, cols, kk = _tile(t, t_e, t_r0, t_r1, base, BM, BN, BK)
            a_ptr = x + rows[:, None] * K + kk[None, :]
            g_ptr = w1 + e * N * K + cols[None, :] * K + kk[:, None]
            u_ptr = w3 + e * N * K + cols[None, :] * K + kk[:, None]
            accg = tl.zeros((BM, BN), dtype=tl.float32)
            accu = tl.zeros((BM, BN), dtype=tl.float32)
            for _ in range(0, K, BK):
                a = tl.load(a_ptr, mask=rm[:, None], other=0.0)
                accg = tl.dot(a, tl.load(g_ptr), accg)
                accu = tl.dot(a, tl.load(u_ptr), accu)
                a_ptr += BK
                g_ptr += BK
                u_ptr += BK
            if limit > 0:
                accg = tl.minimum(accg, limit)
                accu = tl.minimum(tl.maximum(accu, -limit), limit)
            wv = tl.load(wr + rows, mask=rm, other=0.0)
            out = accg / (1.0 + tl.exp(-accg)) * accu * wv[:, None]
            tl.store(act + rows[:, None] * N + cols[None, :], out.to(act.dtype.element_ty), mask=rm[:, None])

    @_tuned([(128, 64, 8, 3), (128, 64, 8, 4), (256, 64, 8, 3)])
    @triton.jit
    def _down_gemm(a, w2, y, t_e, t_r0, t_r1, ts, ne, base, N: tl.constexpr, K: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        t = tl.load(ts) + tl.program_id(0)
        if t < tl.load(ts + ne):
            e, rows, rm, cols, kk = _tile(t, t_e, t_r0, t_r1, base, BM, BN, BK)
            a_ptr = a + rows[:, None] * K + kk[None, :]
            b_ptr = w2 + e * N * K + cols[None, :] * K + kk[:, None]
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for _ in range(0, K, BK):
                acc = tl.dot(tl.load(a_ptr, mask=rm[:, None], other=0.0), tl.load(b_ptr), acc)
                a_ptr += BK
                b_ptr += BK
            tl.store(y + rows[:, None] * N + cols[None, :], acc.to(y.dtype.element_ty), mask=rm[:, None])


BM = 128   # rows per tile (also the planner's block_m)
BR = 16    # rows per copy program


def _check(n: int, k: int) -> dict:
    if n % 16 or k % 16:
        raise ValueError(f"expert GEMM shapes must be multiples of 16, got N={n}, K={k}")
    return {} if TUNED else {"BN": min(128, n), "BK": min(64, k)}


def move_rows(src, dst, pairs, dest, span, base, *, k: int, bound_rows: int, pull: bool,
              srcw=None, dstw=None, scales=None) -> None:
    h = dst.shape[-1]
    fp8 = scales is not None
    dummy = pairs
    grid = (max(1, triton.cdiv(bound_rows, BR)),)
    _move_rows[grid](src, dst, pairs, dest, span, base, srcw if srcw is not None else dummy,
                     dstw if dstw is not None else dummy, scales if fp8 else dummy, k,
                     scales.shape[-1] if fp8 else 1, h, PULL=pull, WITH_W=srcw is not None, FP8=fp8,
                     BR=BR, BH=128 if fp8 else min(512, triton.next_power_of_2(h)))


def swiglu_gemm(x, wr, w1, w3, act, tiles, ts, ne: int, base, limit: float, bound_tiles: int) -> None:
    n, k = w1.shape[1], w1.shape[2]
    cfg = _check(n, k)
    t_e, t_r0, t_r1 = tiles
    _swiglu_gemm[lambda m: (max(1, bound_tiles), n // m["BN"])](
        x, wr, w1, w3, act, t_e, t_r0, t_r1, ts, ne, base, float(limit), n, k, BM=BM, **cfg)


def down_gemm(a, w2, y, tiles, ts, ne: int, base, bound_tiles: int) -> None:
    n, k = w2.shape[1], w2.shape[2]
    cfg = _check(n, k)
    t_e, t_r0, t_r1 = tiles
    _down_gemm[lambda m: (max(1, bound_tiles), n // m["BN"])](a, w2, y, t_e, t_r0, t_r1, ts, ne, base, n, k,
                                                             BM=BM, **cfg)


def tile_map(per_expert: torch.Tensor, max_tiles: int):
    """Device-side tile map of expert-major rows (``per_expert`` rows per local expert, int64):
    -> ((expert, row0, row1) per tile, int32 ``[max_tiles]`` each; tile starts ``[n + 1]``;
    expert row offsets ``[n + 1]``). No host synchronisation."""
    n = per_expert.shape[0]
    dev = per_expert.device
    exp_off = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    exp_off[1:] = torch.cumsum(per_expert, 0)
    tstart = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    tstart[1:] = torch.cumsum((per_expert + BM - 1) // BM, 0)
    t = torch.arange(max_tiles, device=dev)
    e = torch.searchsorted(tstart[1:].contiguous(), t, right=True).clamp_(max=n - 1)
    r0 = exp_off[e] + (t - tstart[e]) * BM
    r1 = exp_off[e] + per_expert[e]
    i32 = torch.int32
    return (e.to(i32), r0.to(i32), r1.to(i32)), tstart.to(i32), exp_off.to(i32)
