"""A candidate for fast mode's mHC stream write fused with the next sublayer's coefficients, timed
against what the engine runs (``triton_rows.hc_write``, then ``triton_wide.hc_pre_read_norm``: the
coefficients' partials of the new streams, then ``finish_read_norm``).

The first fused form (e1bc9de, reverted) gave each program one output stream, so it read all four
input streams once per output stream, and made the flash4 step slower. Here a program takes a block
of rows x one chunk of ``KC`` columns of the stream width and writes all four output streams of it:
the inputs are read once, each output stream's values go straight into that stream's partial
accumulator (chunk ``k D / KC + c`` of the ``[M, 4 D]`` view, so ``finish_read_norm`` reads the
partials it reads today). Measured slower on an H100 (35.0 against 19.0 us at 256 rows, the best of
five tiles; bench/results/hc_write_partials_h100_4a3d15f.json) and, chained through the model, a
slower step; the candidate stays in this bench as the record.

    python -m bench.hc_write_partials --out bench/results/hc_write_partials_h100.json

Each row: device time per call in a CUDA graph (``bench.timing.graph_time``) of the pair and of the
candidate at 256 and 64 rows of 4 x 4096 streams, whether the written streams equal ``hc_write``'s
bit for bit, and the largest difference of post / comb and of the input from the pair's.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import cdiv, launch, next_pow2
from v4stack.kernels.triton_wide import _parts

TILE = dict(BM=16, KC=256, BK=32, num_warps=4, num_stages=2)


@triton.jit
def _stream(o, x0, x1, x2, x3, Post, Comb, Y, W, rows, rmask, d, m2, k, acc, sq, D, s_xn, s_xj, s_pn, s_cn, s_cj,
            s_wn, cols, cmask):
    """Output stream ``k`` of a K step: ``post_k out + sum_j comb[j, k] x_j`` stored, its bf16 values
    into the stream's partial accumulator (the weight's three parts) and sum of squares. The rows'
    coefficients are loaded every K step (cached lines): loaded once before the loop, the twenty
    vectors spill 1.4 KB a thread at ``TILE`` in the sm_90a build, against none here."""
    pk = tl.load(Post + rows * s_pn + k, mask=rmask, other=0.0)
    c0 = tl.load(Comb + rows * s_cn + k, mask=rmask, other=0.0)
    c1 = tl.load(Comb + rows * s_cn + s_cj + k, mask=rmask, other=0.0)
    c2 = tl.load(Comb + rows * s_cn + 2 * s_cj + k, mask=rmask, other=0.0)
    c3 = tl.load(Comb + rows * s_cn + 3 * s_cj + k, mask=rmask, other=0.0)
    mixed = c0[:, None] * x0 + c1[:, None] * x1 + c2[:, None] * x2 + c3[:, None] * x3
    y = (pk[:, None] * o + mixed).to(Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * s_xn + k * s_xj + d[None, :], y, mask=m2)
    w = tl.load(W + cols[None, :] * s_wn + (k * D + d)[:, None], mask=cmask[None, :], other=0.0)
    hi, mid, lo = _parts(w)
    acc = tl.dot(y, lo, acc)
    acc = tl.dot(y, mid, acc)
    acc = tl.dot(y, hi, acc)
    yf = y.to(tl.float32)
    return acc, sq + yf * yf


@triton.jit
def write4_partials_kernel(X, O, Post, Comb, Y, W, P, PSS, M, N, D, s_xn, s_xj, s_on, s_pn, s_cn, s_cj, s_wn,
                           KC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program ``(m, c)``: rows ``[m BM, ...)`` x columns ``[c KC, (c + 1) KC)`` of each of the four
    streams (``KC`` divides ``D``): the four new streams, and ``P[k D / KC + c, rows]``, ``PSS[...]``."""
    pdl_enter()
    pm = tl.program_id(0)
    ch = tl.program_id(1)
    rows = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < M
    cols = tl.arange(0, BN)
    cmask = cols < N
    kk = tl.arange(0, BK)
    a0 = tl.zeros([BM, BN], tl.float32)
    a1 = tl.zeros([BM, BN], tl.float32)
    a2 = tl.zeros([BM, BN], tl.float32)
    a3 = tl.zeros([BM, BN], tl.float32)
    q0 = tl.zeros([BM, BK], tl.float32)
    q1 = tl.zeros([BM, BK], tl.float32)
    q2 = tl.zeros([BM, BK], tl.float32)
    q3 = tl.zeros([BM, BK], tl.float32)
    for c in range(0, KC, BK):
        d = ch * KC + c + kk
        m2 = rmask[:, None] & (d < D)[None, :]
        o = tl.load(O + rows[:, None] * s_on + d[None, :], mask=m2, other=0.0).to(tl.float32)
        xb = X + rows[:, None] * s_xn + d[None, :]
        x0 = tl.load(xb, mask=m2, other=0.0).to(tl.float32)
        x1 = tl.load(xb + s_xj, mask=m2, other=0.0).to(tl.float32)
        x2 = tl.load(xb + 2 * s_xj, mask=m2, other=0.0).to(tl.float32)
        x3 = tl.load(xb + 3 * s_xj, mask=m2, other=0.0).to(tl.float32)
        a0, q0 = _stream(o, x0, x1, x2, x3, Post, Comb, Y, W, rows, rmask, d, m2, 0, a0, q0, D, s_xn, s_xj, s_pn,
                         s_cn, s_cj, s_wn, cols, cmask)
        a1, q1 = _stream(o, x0, x1, x2, x3, Post, Comb, Y, W, rows, rmask, d, m2, 1, a1, q1, D, s_xn, s_xj, s_pn,
                         s_cn, s_cj, s_wn, cols, cmask)
        a2, q2 = _stream(o, x0, x1, x2, x3, Post, Comb, Y, W, rows, rmask, d, m2, 2, a2, q2, D, s_xn, s_xj, s_pn,
                         s_cn, s_cj, s_wn, cols, cmask)
        a3, q3 = _stream(o, x0, x1, x2, x3, Post, Comb, Y, W, rows, rmask, d, m2, 3, a3, q3, D, s_xn, s_xj, s_pn,
                         s_cn, s_cj, s_wn, cols, cmask)
    per = D // KC
    pm2 = rmask[:, None] & cmask[None, :]
    tl.store(P + ((0 * per + ch) * M + rows)[:, None] * N + cols[None, :], a0, mask=pm2)
    tl.store(P + ((1 * per + ch) * M + rows)[:, None] * N + cols[None, :], a1, mask=pm2)
    tl.store(P + ((2 * per + ch) * M + rows)[:, None] * N + cols[None, :], a2, mask=pm2)
    tl.store(P + ((3 * per + ch) * M + rows)[:, None] * N + cols[None, :], a3, mask=pm2)
    tl.store(PSS + (0 * per + ch) * M + rows, tl.sum(q0, 1), mask=rmask)
    tl.store(PSS + (1 * per + ch) * M + rows, tl.sum(q1, 1), mask=rmask)
    tl.store(PSS + (2 * per + ch) * M + rows, tl.sum(q2, 1), mask=rmask)
    tl.store(PSS + (3 * per + ch) * M + rows, tl.sum(q3, 1), mask=rmask)


def write_pre_read_norm(x, out, post, comb, fn, scale, base, iters: int, eps: float, norm_eps: float, weight,
                        rms_eps: float, tile: dict | None = None):
    """The candidate: ``x [M, 4, D]`` bf16, ``out [M, D]``, fp32 ``post [M, 4]`` / ``comb [M, 4, 4]``,
    ``fn [N, 4 D]`` fp32 -> (new streams, the next sublayer's input, post, comb)."""
    from v4stack.kernels.triton_mhc import _outputs, finish_read_norm

    t = tile or TILE
    M, n, D = x.shape
    N, K = fn.shape
    assert n == 4 and K == n * D and D % t["KC"] == 0
    xc, oc, pc, cc = x.contiguous(), out.contiguous(), post.contiguous(), comb.contiguous()
    y = torch.empty_like(xc)
    outs = _outputs(M, n, x.device)
    h = torch.empty(M, D, dtype=x.dtype, device=x.device)
    S = K // t["KC"]
    p = torch.empty(S * M * N, dtype=torch.float32, device=x.device)
    pss = torch.empty(S * M, dtype=torch.float32, device=x.device)
    launch(write4_partials_kernel, (cdiv(M, t["BM"]), D // t["KC"]), xc, oc, pc, cc, y, fn, p, pss, M, N, D,
           xc.stride(0), xc.stride(1), oc.stride(0), pc.stride(0), cc.stride(0), cc.stride(1), fn.stride(0),
           KC=t["KC"], BM=t["BM"], BN=max(16, next_pow2(N)), BK=t["BK"], num_warps=t["num_warps"],
           num_stages=t["num_stages"])
    mix = torch.empty(M, N, dtype=torch.float32, device=x.device)
    finish_read_norm(p, pss, S, K, mix, scale, base, outs, iters, eps, norm_eps, y, weight, rms_eps, h)
    return y, h, outs[1], outs[2]


def pair(x, out, post, comb, fn, scale, base, iters, eps, norm_eps, weight, rms_eps, tile=None):
    """What the engine runs: ``hc_write``, then ``hc_pre_read_norm``'s wide form of the new streams."""
    from v4stack.kernels import triton_rows, triton_wide

    y = triton_rows.hc_write(x, out, post, comb)
    return (y, *triton_wide.hc_pre_read_norm(y, fn, scale, base, 4, iters, eps, norm_eps, weight, rms_eps, tile))


def case(M: int, D: int, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, 4, D, device=device, generator=g).bfloat16()
    out = torch.randn(M, D, device=device, generator=g).bfloat16()
    post = torch.rand(M, 4, device=device, generator=g) * 2
    comb = torch.rand(M, 4, 4, device=device, generator=g)
    fn = torch.randn(24, 4 * D, device=device, generator=g) * 0.01
    scale = torch.rand(3, device=device, generator=g) + 0.5
    base = torch.randn(24, device=device, generator=g)
    nw = (torch.rand(D, device=device, generator=g) + 0.5).bfloat16()
    return x, out, post, comb, fn, scale, base, 20, 1e-6, 1e-6, nw, 1e-6


def compare(a, b) -> dict:
    return {"streams_bit_equal": bool(torch.equal(a[0], b[0])),
            "input_max_diff": float((a[1].float() - b[1].float()).abs().max()),
            "post_max_diff": float((a[2] - b[2]).abs().max()), "comb_max_diff": float((a[3] - b[3]).abs().max())}


def main(argv=None) -> None:
    from bench.runner import write_result
    from bench.timing import graph_time

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/hc_write_partials_h100.json")
    a = ap.parse_args(argv)
    rows = []
    tiles = [TILE, dict(TILE, BM=32), dict(TILE, BM=32, num_warps=8), dict(TILE, BK=64, num_warps=8),
             dict(TILE, KC=128)]
    for M in (256, 64):
        args = case(M, 4096, "cuda")
        ref = pair(*args)
        r = {"rows": M, "form": "hc_write + hc_pre_read_norm", "us": graph_time(lambda: pair(*args)) * 1e6}
        print(r, flush=True)
        rows.append(r)
        for t in tiles:
            r = {"rows": M, "form": "write4_partials + finish_read_norm", "tile": t}
            try:
                got = write_pre_read_norm(*args, tile=t)
                torch.cuda.synchronize()
                r.update(compare(got, ref))
                r["us"] = graph_time(lambda t=t: write_pre_read_norm(*args, tile=t)) * 1e6
            except Exception as e:  # noqa: BLE001  (a tile this GPU cannot build: recorded)
                r["error"] = repr(e)[:300]
            print(r, flush=True)
            rows.append(r)
    write_result(a.out, {"bench": "hc_write_partials", "device_name": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
