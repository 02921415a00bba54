"""Greedy draws of a whole decode step in two kernels (Triton): ``ops.fused.greedy_draw``.

The first kernel runs one program per (row, chunk of ``CHUNK`` columns), so a row's logits are
read by many programs side by side (one program per row was latency-bound: ~90 us at batch 64
on the H200). Each streams its columns once (any float dtype, read as fp32) in blocks of
``BLOCK``: each lane keeps its running maximum, the sum of ``exp(x - max)`` rescaled as the
maximum rises (one exponential a column: ``exp(x - max)`` added, or on a new maximum the sum
scaled by ``exp(max - x)`` plus one), and the first column where its maximum was seen; the lanes are combined into the
chunk's ``(max, sum, first column)``. The shipped launch takes the block form instead
(``greedy_blocks_kernel``: one block of ``BLOCK`` columns at a time reduced to its maximum, its
first column and ``sum exp(x - max)``, folded into three scalars), which holds no per-lane state
and measured faster. The second kernel combines a row's chunks the same way:
``M = max``, ``S = sum(s_c exp(m_c - M))``, the token is the smallest column holding ``M``
(``torch.argmax``'s first maximum), and its log-probability is ``x[tok] - M - log S = -log S``.
The order depends on the vocabulary width alone, so a row's bits never depend on the batch. The kernel writes the ids ``[B]`` (int64, the next step's inputs) and the ``[B, 3]``
float64 rows the sampler reads back: id, log-probability, and the policy log-probability (the
same at temperature 1, clamped at 0).
"""

import os

import torch
import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import launch

BLOCK = 1024  # columns per lane step (the lane form)
CHUNK = 4096  # columns per program of the first kernel (a row's chunks run side by side)


@triton.jit
def _lanes(X, r, c0, c1, s_x, BLOCK: tl.constexpr):
    """Per lane over columns ``[c0, c1)``: running maximum, rescaled ``sum exp(x - max)``, and the
    first column of the maximum."""
    offs = tl.arange(0, BLOCK)
    mv = tl.full([BLOCK], float("-inf"), tl.float32)
    sv = tl.zeros([BLOCK], tl.float32)
    iv = tl.zeros([BLOCK], tl.int32)
    for v0 in range(c0, c1, BLOCK):
        col = v0 + offs
        ok = col < c1
        x = tl.load(X + r * s_x + col, mask=ok, other=float("-inf")).to(tl.float32)
        up = x > mv  # strictly greater: a lane keeps its first maximum
        # one exponential per column: the smaller of (x, max) against the larger
        e = tl.exp(tl.where(up, mv - x, x - mv))
        e = tl.where(x == float("-inf"), 0.0, e)  # a masked column (or a row of -inf) adds nothing
        sv = tl.where(up, sv * e + 1.0, sv + e)
        iv = tl.where(up, col, iv)
        mv = tl.maximum(mv, x)
    return mv, sv, iv


@triton.jit
def _combine(mv, sv, iv, V):
    """Lanes (or chunks) -> the maximum, ``sum exp(x - max)`` and the first column of the maximum."""
    M = tl.max(mv, 0)
    S = tl.sum(tl.where(mv == float("-inf"), 0.0, sv * tl.exp(mv - M)), 0)
    return M, S, tl.min(tl.where(mv == M, iv, V), 0)


@triton.jit
def greedy_part_kernel(X, PM, PS, PI, V, s_x, NC, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pdl_enter()
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    c0 = c * CHUNK
    mv, sv, iv = _lanes(X, r, c0, tl.minimum(c0 + CHUNK, V), s_x, BLOCK)
    M, S, i = _combine(mv, sv, iv, V)
    tl.store(PM + r * NC + c, M)
    tl.store(PS + r * NC + c, S)
    tl.store(PI + r * NC + c, i)


@triton.jit
def greedy_blocks_kernel(X, PM, PS, PI, V, s_x, NC, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """``greedy_part_kernel``'s partials with a program's state in three scalars: per block of
    ``BLOCK`` columns its maximum, then ``sum exp(x - max)`` against the running maximum (one
    exponential a column and one a block, no per-column state to carry), the first column of the
    block's maximum kept where it rises strictly."""
    pdl_enter()
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    c0 = c * CHUNK
    offs = tl.arange(0, BLOCK)
    M = float("-inf")
    S = 0.0
    i = 0
    for v0 in range(c0, c0 + CHUNK, BLOCK):
        col = v0 + offs
        x = tl.load(X + r * s_x + col, mask=col < V, other=float("-inf")).to(tl.float32)
        bm = tl.max(x, 0)
        bi = tl.min(tl.where(x == bm, col, V), 0)
        m2 = tl.maximum(M, bm)
        e = tl.where(x == float("-inf"), 0.0, tl.exp(x - m2))
        S = tl.where(m2 == float("-inf"), 0.0, S * tl.exp(M - m2) + tl.sum(e, 0))
        i = tl.where(bm > M, bi, i)
        M = m2
    tl.store(PM + r * NC + c, M)
    tl.store(PS + r * NC + c, S)
    tl.store(PI + r * NC + c, i)


# inline PTX (the lean form's exponential) runs on a GPU only; Triton's interpreter takes ``tl.exp2``
PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp2_ftz(u, PTX: tl.constexpr):
    """``2^u`` in one ``ex2.approx.ftz``: an exponential a column without the non-flushing form's
    range fix (a compare, two conditional multiplies). What it flushes, results below 2^-126, is
    nothing beside the block's own maximum, which adds 1; ``2^-inf`` is 0."""
    if PTX:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [u], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(u)


@triton.jit
def greedy_lean_kernel(X, PM, PS, PI, V, s_x, NC, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """The block form, one block of ``BLOCK`` columns a program, with fewer instructions a column
    (the block form is bound by them: it takes the same time on an H100 as on an H200). The block
    is held as ``[BLOCK // VEC, VEC]``, ``VEC`` adjacent columns a row, so a row's maximum is a
    thread's own. The first column of the block's maximum is found without a compare a column: the
    first row whose maximum it is, then that row's ``VEC`` columns read again. A masked column
    (``-inf``) adds ``2^-inf = 0`` without a select; a block of ``-inf`` only adds 0."""
    pdl_enter()
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    c0 = c * BLOCK
    NR: tl.constexpr = BLOCK // VEC
    rows = tl.arange(0, NR)
    lane = tl.arange(0, VEC)
    col = c0 + rows[:, None] * VEC + lane[None, :]
    x = tl.load(X + r * s_x + col, mask=col < V, other=float("-inf")).to(tl.float32)
    rm = tl.max(x, 1)
    M = tl.max(rm, 0)
    c1 = c0 + tl.min(tl.where(rm == M, rows, NR), 0) * VEC + lane
    xr = tl.load(X + r * s_x + c1, mask=c1 < V, other=float("-inf")).to(tl.float32)
    i = tl.min(tl.where(xr == M, c1, V), 0)
    e = _exp2_ftz((x - M) * LOG2E, PTX)
    S = tl.where(M == float("-inf"), 0.0, tl.sum(tl.sum(e, 1), 0))
    tl.store(PM + r * NC + c, M)
    tl.store(PS + r * NC + c, S)
    tl.store(PI + r * NC + c, i)


@triton.jit
def greedy_finish_kernel(PM, PS, PI, TOK, OUT, V, NC, SB: tl.constexpr):
    pdl_enter()
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, SB)
    ok = c < NC
    M, S, tok = _combine(tl.load(PM + r * NC + c, mask=ok, other=float("-inf")),
                         tl.load(PS + r * NC + c, mask=ok, other=0.0), tl.load(PI + r * NC + c, mask=ok, other=0), V)
    lp = -tl.log(S)
    tl.store(TOK + r, tok.to(tl.int64))
    tl.store(OUT + r * 3, tok.to(tl.float64))
    tl.store(OUT + r * 3 + 1, lp.to(tl.float64))
    tl.store(OUT + r * 3 + 2, tl.minimum(lp, 0.0).to(tl.float64))


# the first kernel's launch (a fixed choice for every batch: the columns' order is the tile's);
# ``blocks``: ``greedy_blocks_kernel`` (bench/results/greedy_draw_h200.json)
# (the block form, one block a program, two warps: 28.4 / 9.2 us at 256 / 64 rows of 129280 against
# 36.4 / 11.2 for the lane form, the best of 12 shapes)
SHIPPED = dict(CHUNK=2048, BLOCK=2048, num_warps=2, blocks=True)


def tile_from(text: str | None) -> dict:
    """The first kernel's launch from ``V4STACK_GREEDY_TILE``: a JSON object of a
    ``bench/greedy_draw.py`` tile, to time one against the shipped tile in a whole step; unset or
    empty: the shipped one."""
    if not text:
        return dict(SHIPPED)
    import json

    try:
        t = json.loads(text)
    except ValueError as e:
        raise ValueError(f"V4STACK_GREEDY_TILE: not JSON: {text!r}") from e
    if (not isinstance(t, dict) or set(t) - {"CHUNK", "BLOCK", "num_warps", "blocks", "lean"}
            or not {"CHUNK", "BLOCK", "num_warps"} <= set(t)):
        raise ValueError(f"V4STACK_GREEDY_TILE: CHUNK, BLOCK, num_warps (and blocks or lean) only, got {text!r}")
    ints = {k: v for k, v in t.items() if k != "blocks"}
    if (any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in ints.values())
            or not isinstance(t.get("blocks", False), bool)):
        raise ValueError(f"V4STACK_GREEDY_TILE: positive integers (blocks: true or false), got {text!r}")
    if (any(v & (v - 1) for k, v in ints.items() if k != "CHUNK") or t["CHUNK"] % t["BLOCK"]
            or ("lean" in t and t["CHUNK"] != t["BLOCK"])):
        raise ValueError(f"V4STACK_GREEDY_TILE: BLOCK, num_warps and lean powers of two, CHUNK a multiple of "
                         f"BLOCK (equal for lean), got {text!r}")
    return t


TILE = tile_from(os.environ.get("V4STACK_GREEDY_TILE"))


def greedy_draw(logits: torch.Tensor, tile: dict | None = None):
    """``tile``: ``CHUNK`` / ``BLOCK`` / ``num_warps`` of the first kernel (a fixed choice for every
    batch: the columns' order is the tile's)."""
    t = tile or TILE
    chunk, block, warps = t["CHUNK"], t["BLOCK"], t["num_warps"]
    part = greedy_blocks_kernel if t.get("blocks") else greedy_part_kernel
    vec = t.get("lean", 0)  # the lean form's columns a row (one block a program: CHUNK == BLOCK)
    assert not vec or chunk == block, "the lean form runs one block a program"
    B, V = logits.shape
    tok = torch.empty(B, dtype=torch.int64, device=logits.device)
    out = torch.empty(B, 3, dtype=torch.float64, device=logits.device)
    if B:
        nc = triton.cdiv(V, chunk)
        pm = torch.empty(B, nc, dtype=torch.float32, device=logits.device)
        ps = torch.empty_like(pm)
        pi = torch.empty(B, nc, dtype=torch.int32, device=logits.device)
        if vec:
            launch(greedy_lean_kernel, (B, nc), logits, pm, ps, pi, V, logits.stride(0), nc, BLOCK=block, VEC=vec,
                   num_warps=warps)
        else:
            launch(part, (B, nc), logits, pm, ps, pi, V, logits.stride(0), nc, CHUNK=chunk, BLOCK=block,
                   num_warps=warps)
        launch(greedy_finish_kernel, (B,), pm, ps, pi, tok, out, V, nc, SB=triton.next_power_of_2(nc), num_warps=1)
    return tok, out
