"""MoE routing kernels (Triton): the gate's scores to top-k, then (token, slot) pairs by expert.

- ``moe_gate``: from the gate's logits ``[T, E]`` (fp32) per row: ``s = sqrt(softplus(l))``, the
  top-k experts of ``s + bias`` (ties to the lower expert id, descending; or the fixed
  ``tid2eid[token]`` table of a hash layer), their unbiased scores normalised to sum 1 and scaled.
  One program per row, so a row's result does not depend on its batch. The torch composition
  launches ~8 kernels (softplus, sqrt, bias add, topk, gather, sum, division, scaling).
- ``moe_route``: a counting sort of the ``P = T * k`` pairs by expert id, one program per
  expert: the pairs of lower experts and its own counted (the grouped GEMM's row offsets
  ``[E + 1]``), then each of its pairs' rank in pair order, so the order equals a stable
  sort's. It also writes each sorted pair's token (``pair // k``) and routing weight. It replaces a radix sort (27 us a call on an
  H200 at 384 pairs), ``searchsorted``, ``arange``, a division and a gather.
- ``moe_route_rows``: ``moe_route``'s pass for a decode step's pairs (one block) with the sorted
  pairs' rows copied in the same launch, program (expert, column block): the grouped GEMM's inputs
  without a gather kernel after it.
- ``moe_unsort_combine``: the grouped GEMM's sorted outputs back per token, summed in
  ``ops.moe_combine``'s order (ascending expert id, fp32), plus the shared expert, cast to the
  model's dtype: one kernel for a cast, a scatter, the combine, the add and the last cast.

Integer results are exact (equal to the torch reference's); ``softplus`` is
``log1p(exp(x))`` (``x`` above 20 kept) with ``log1p`` computed as ``log(u) * e / (u - 1)``,
divisions and square roots correctly rounded, ``exp`` / ``log`` from libdevice (the accurate
functions, not the ``ex2.approx`` / ``lg2.approx`` of ``tl.exp``) on the GPU; Triton's interpreter,
which has no libdevice, runs ``tl.exp`` / ``tl.log`` (``ACCURATE=False``).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import _INTERPRET, launch, next_pow2
from v4stack.kernels.triton_rows import write_streams
from v4stack.kernels.triton_slices import _add_in_order


@triton.jit
def gate_kernel(L, B, TAB, TOK, IDX, WO, E, s_l, scale, K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                HASHED: tl.constexpr, HAS_B: tl.constexpr, ACCURATE: tl.constexpr, S: tl.constexpr, SP: tl.constexpr):
    """One token a program. ``S`` > 0: ``L`` is the logits' slice partials ``[S, T, E]`` (``s_l`` =
    T * E), added in slice order as ``triton_slices.finish_kernel`` adds them (the same bits)."""
    pdl_enter()
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BE)
    ok = c < E
    if S > 0:
        j = tl.arange(0, SP).to(tl.int64)
        parts = tl.load(L + (t * E + c)[None, :, None] + j[None, None, :] * s_l,
                        mask=ok[None, :, None] & (j < S)[None, None, :], other=0.0)
        x = tl.reshape(_add_in_order(tl.zeros([1, BE], tl.float32), parts, 1, BE, SP), [BE])
    else:
        x = tl.load(L + t * s_l + c, mask=ok, other=0.0).to(tl.float32)
    if ACCURATE:  # libdevice's accurate functions (on the GPU; Triton's interpreter has no libdevice)
        e = libdevice.exp(x)
    else:
        e = tl.exp(x)
    u = 1.0 + e
    one = u == 1.0
    if ACCURATE:
        lu = libdevice.log(u)
    else:
        lu = tl.log(u)
    lp = tl.where(one, e, tl.div_rn(lu * e, tl.where(one, 1.0, u - 1.0)))
    sp = tl.where(x > 20.0, x, lp)
    s = tl.sqrt_rn(sp)
    ks = tl.arange(0, KP)
    kok = ks < K
    sel = tl.full([KP], -1, tl.int32)
    if HASHED:
        tok = tl.load(TOK + t)
        sel = tl.load(TAB + tok * K + ks, mask=kok, other=-1).to(tl.int32)
    else:
        v = s
        if HAS_B:
            v = s + tl.load(B + c, mask=ok, other=0.0)
        v = tl.where(ok, v, float("-inf"))
        for j in tl.static_range(K):
            m = tl.max(v, axis=0)
            # (kept inside [0, E) even for a NaN row, so no later kernel indexes out of bounds)
            pick = tl.minimum(tl.min(tl.where(v == m, c, BE), axis=0), E - 1)
            sel = tl.where(ks == j, pick, sel)
            v = tl.where(c == pick, float("-inf"), v)
    # the chosen experts' unbiased scores, in slot order
    w = tl.sum(tl.where(c[None, :] == sel[:, None], s[None, :], 0.0), axis=1)
    tot = tl.sum(w, axis=0)
    w = tl.div_rn(w, tot) * scale
    tl.store(IDX + t * K + ks, sel.to(tl.int64), mask=kok)
    tl.store(WO + t * K + ks, w, mask=kok)


def moe_gate(logits: torch.Tensor, bias, table, token_ids, k: int, scale: float):
    """-> expert ids ``[T, k]`` (int64) and routing weights ``[T, k]`` (fp32)."""
    T, E = logits.shape
    return _gate(logits, T, E, logits.stride(0), 0, bias, table, token_ids, k, scale)


def moe_gate_partials(parts: torch.Tensor, S: int, bias, table, token_ids, k: int, scale: float):
    """``moe_gate`` of the logits whose slice partials are ``parts [S', T, E]`` (the first ``S``
    slices taken), summed in the gate's kernel."""
    _, T, E = parts.shape
    return _gate(parts, T, E, T * E, S, bias, table, token_ids, k, scale)


def _gate(L, T: int, E: int, s_l: int, S: int, bias, table, token_ids, k: int, scale: float):
    idx = torch.empty(T, k, dtype=torch.int64, device=L.device)
    w = torch.empty(T, k, dtype=torch.float32, device=L.device)
    if T:
        hashed = table is not None
        launch(gate_kernel, (T,), L, bias if bias is not None else L, table if hashed else idx,
               token_ids if hashed else idx, idx, w, E, s_l, float(scale), K=k, KP=next_pow2(k), BE=next_pow2(E),
               HASHED=hashed, HAS_B=bias is not None, ACCURATE=not _INTERPRET, S=S, SP=next_pow2(max(S, 1)),
               num_warps=1)
    return idx, w


@triton.jit
def _route_ids(IDX, p, P, E, K: tl.constexpr, JOIN: tl.constexpr):
    """The expert ids of pairs ``p`` (-1 past ``P``); with JOIN slot ``K`` of a token is expert ``E - 1``."""
    KJ: tl.constexpr = K + JOIN
    if JOIN:
        real = (p < P) & (p % KJ < K)
        return tl.where(real, tl.load(IDX + (p // KJ) * K + p % KJ, mask=real, other=-1).to(tl.int32),
                        tl.where(p < P, E - 1, -1))
    else:
        return tl.load(IDX + p, mask=p < P, other=-1).to(tl.int32)


@triton.jit
def _route_place(W, ORDER, RANK, TOK, WS, p, ids, e, run, P, K: tl.constexpr, JOIN: tl.constexpr):
    """Expert ``e``'s pairs among ``p`` placed from row ``run`` on, in pair order; -> the next free row."""
    KJ: tl.constexpr = K + JOIN
    hit = (ids == e) & (p < P)
    h = hit.to(tl.int32)
    pos = run + tl.cumsum(h, 0) - 1
    tl.store(ORDER + pos, p.to(tl.int64), mask=hit)
    tl.store(RANK + p, pos.to(tl.int64), mask=hit)
    tl.store(TOK + pos, (p // KJ).to(tl.int64), mask=hit)
    if JOIN:
        w = tl.where(p % KJ < K, tl.load(W + (p // KJ) * K + p % KJ, mask=hit & (p % KJ < K), other=0.0), 1.0)
    else:
        w = tl.load(W + p, mask=hit, other=0.0)
    tl.store(WS + pos, w, mask=hit)
    return run + tl.sum(h, 0)


@triton.jit
def route_kernel(IDX, W, OFF, ORDER, RANK, TOK, WS, P, E, K: tl.constexpr, BP: tl.constexpr, JOIN: tl.constexpr,
                 ONE: tl.constexpr = False):
    """Program ``e`` places expert ``e``'s pairs: a pass counting the pairs of lower experts (its
    first row) and its own, then one placing its pairs in pair order (a running count plus the
    block's inclusive cumulative sum). Ids outside ``[0, E)`` are not placed. ``JOIN``: every
    token has one more pair, its slot ``K``, for expert ``E - 1`` with weight 1 (the shared expert
    joined to the routed ones; ``IDX`` / ``W`` hold the ``K`` routed slots). ``ONE`` (``P <= BP``:
    a decode step's pairs): the ids are loaded once and both passes run on them."""
    pdl_enter()
    e = tl.program_id(0)
    zero = tl.sum(tl.zeros([BP], tl.int32), 0)
    if ONE:
        p = tl.arange(0, BP)
        ids = _route_ids(IDX, p, P, E, K, JOIN)
        below = tl.sum(((ids >= 0) & (ids < e)).to(tl.int32), 0)
        tl.store(OFF + 1 + e, (below + tl.sum((ids == e).to(tl.int32), 0)).to(tl.int64))
        if e == 0:
            tl.store(OFF, zero.to(tl.int64))
        _route_place(W, ORDER, RANK, TOK, WS, p, ids, e, below, P, K, JOIN)
    else:
        below = zero
        mine = zero
        for start in range(0, P, BP):
            ids = _route_ids(IDX, start + tl.arange(0, BP), P, E, K, JOIN)
            below += tl.sum(((ids >= 0) & (ids < e)).to(tl.int32), 0)
            mine += tl.sum((ids == e).to(tl.int32), 0)
        tl.store(OFF + 1 + e, (below + mine).to(tl.int64))
        if e == 0:
            tl.store(OFF, zero.to(tl.int64))
        run = below  # the next free row of expert e
        for start in range(0, P, BP):
            p = start + tl.arange(0, BP)
            run = _route_place(W, ORDER, RANK, TOK, WS, p, _route_ids(IDX, p, P, E, K, JOIN), e, run, P, K, JOIN)


ROUTE_ONE = 4096  # pairs a program holds in one block (a decode step's: 256 tokens x 7 pairs fit)


@triton.jit
def route_rows_kernel(IDX, W, OFF, ORDER, RANK, TOK, WS, X, R, P, E, D, s_x, s_r, K: tl.constexpr,
                      BP: tl.constexpr, JOIN: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Program ``(e, c)``: ``route_kernel``'s one-block pass for expert ``e`` (program ``(e, 0)``
    stores its offsets, order, rank, tokens and weights), then expert ``e``'s sorted rows over
    columns ``[c BC, (c + 1) BC)``: row ``i`` is ``X[tok[i]]`` cast to ``R``'s dtype. Every program of
    the expert stores the tokens of its pairs (the same values) and reads them back after the
    block's barrier, so it copies in placement order without another launch."""
    pdl_enter()
    e = tl.program_id(0)
    c = tl.program_id(1)
    KJ: tl.constexpr = K + JOIN
    p = tl.arange(0, BP)
    ids = _route_ids(IDX, p, P, E, K, JOIN)
    below = tl.sum(((ids >= 0) & (ids < e)).to(tl.int32), 0)
    hit = (ids == e) & (p < P)
    mine = tl.sum(hit.to(tl.int32), 0)
    if c == 0:
        tl.store(OFF + 1 + e, (below + mine).to(tl.int64))
        if e == 0:
            tl.store(OFF, (below * 0).to(tl.int64))
        _route_place(W, ORDER, RANK, TOK, WS, p, ids, e, below, P, K, JOIN)
    else:
        tl.store(TOK + below + tl.cumsum(hit.to(tl.int32), 0) - 1, (p // KJ).to(tl.int64), mask=hit)
    tl.debug_barrier()  # the tokens, stored by some threads, are read back by others
    i = tl.arange(0, BR)
    d = (c * BC + tl.arange(0, BC)).to(tl.int64)
    dm = d < D
    for r0 in range(0, mine, BR):
        m = (r0 + i) < mine
        row = (below + r0 + i).to(tl.int64)
        t = tl.load(TOK + row, mask=m, other=0)
        v = tl.load(X + t[:, None] * s_x + d[None, :], mask=m[:, None] & dm[None, :], other=0.0)
        tl.store(R + row[:, None] * s_r + d[None, :], v.to(R.dtype.element_ty), mask=m[:, None] & dm[None, :])


def _route_outputs(P: int, E: int, wdtype, dev):
    """The routing's outputs for ``P`` pairs over ``E`` experts: offsets, order, rank, tokens, weights."""
    long = dict(dtype=torch.int64, device=dev)
    return (torch.empty(E + 1, **long), torch.empty(P, **long), torch.empty(P, **long), torch.empty(P, **long),
            torch.empty(P, dtype=wdtype, device=dev))


# route_rows' column block and rows a step (BR x BC a program's tile). At 16 rows a step the sm_90a
# build takes 108 registers (two 8-warp programs an SM, flash4's 9 x 16 programs in one wave on 132
# SMs) against 148, and measured no faster: 9.98 against 9.82 us at 256 tokens, 4.25 / 4.05 at 64
# (an H100 at b7d789c, bench/results/route_rows_h100_b7d789c.json)
ROWS_TILE = dict(BR=32, BC=256, num_warps=8)


def moe_route_rows(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, n_experts: int, joined: bool,
                   dtype, tile: dict | None = None):
    """``moe_route`` and the sorted pairs' rows ``x[tok].to(dtype)`` in one launch (a decode step's
    pairs: at most ``ROUTE_ONE``): the grouped GEMM's inputs without torch's gather. ``tile``:
    ``ROWS_TILE``'s keys (``bench/route_rows.py`` times others)."""
    T, k = indices.shape
    P = T * (k + joined)
    E = n_experts + joined
    D = x.shape[1]
    off, order, rank, tok, ws = _route_outputs(P, E, weights.dtype, indices.device)
    rows = torch.empty(P, D, dtype=dtype, device=indices.device)
    t = tile or ROWS_TILE
    launch(route_rows_kernel, (E, max(1, -(-D // t["BC"]))), indices, weights, off, order, rank, tok, ws, x, rows, P,
           E, D, x.stride(0), rows.stride(0), K=k, BP=max(16, next_pow2(P)), JOIN=joined, BR=t["BR"], BC=t["BC"],
           **{o: t[o] for o in ("num_warps", "maxnreg") if o in t})
    return off, order, rank, tok, ws, rows


def moe_route(indices: torch.Tensor, weights: torch.Tensor, n_experts: int, joined: bool = False):
    """``indices [T, k]`` expert ids in ``[0, E)``, ``weights [T, k]`` -> row offsets ``[E + 1]``,
    pair order ``[T k]`` (stable by expert), each pair's position in it ``[T k]``, each sorted
    pair's token ``[T k]`` (int64) and weight ``[T k]`` (``weights``' dtype). ``joined``: as if
    ``indices`` / ``weights`` had one more column, expert ``E`` with weight 1 (``E + 1`` experts,
    ``T (k + 1)`` pairs) - the shared expert, without the padded copies."""
    T, k = indices.shape
    P = T * (k + joined)
    n_experts += joined
    off, order, rank, tok, ws = _route_outputs(P, n_experts, weights.dtype, indices.device)
    one = P <= ROUTE_ONE
    launch(route_kernel, (n_experts,), indices, weights, off, order, rank, tok, ws, P, n_experts, K=k,
           BP=max(16, next_pow2(P)) if one else 1024, JOIN=joined, ONE=one, num_warps=8 if P > 1024 else 4)
    return off, order, rank, tok, ws


@triton.jit
def combine_ranks(IDX, n, k, j, JOIN: tl.constexpr):
    """Token ``n``'s slots ``j`` ranked in ``ops.moe_combine``'s order, (expert id, slot) -> (ranks,
    its pair count: ``k``, or ``k + 1`` with ``JOIN``, the shared expert's slot ranked last)."""
    ids = tl.load(IDX + n * k + j, mask=j < k, other=0)
    if JOIN:
        ids = tl.where(j == k, 1 << 30, ids)
        k = k + 1
    before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (j[None, :] < j[:, None]))
    return tl.sum((before & (j < k)[None, :]).to(tl.int32), 1), k


@triton.jit
def unsort_kernel(O, RANK, IDX, S, Y, k, D, s_o, s_s, s_y, BK: tl.constexpr, BD: tl.constexpr, HAS_S: tl.constexpr,
                  JOIN: tl.constexpr):
    """``JOIN``: token ``n``'s pairs are ``k + 1``, the last one the shared expert's (after every
    routed expert in the combine's order), ``IDX`` holding the ``k`` routed ids."""
    pdl_enter()
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = d < D
    acc = combine_row(O, RANK, IDX, n, d, dm, k, s_o, BK, BD, JOIN)
    if HAS_S:
        acc = acc + tl.load(S + n * s_s + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(Y + n * s_y + d, acc.to(Y.dtype.element_ty, fp_downcast_rounding="rtne"), mask=dm)


@triton.jit
def combine_row(O, RANK, IDX, n, d, dm, k, s_o, BK: tl.constexpr, BD: tl.constexpr, JOIN: tl.constexpr):
    """Token ``n``'s sorted rows ``O[RANK[n k + j]]`` over columns ``d`` summed in fp32 in the
    combine's order (``unsort_kernel``'s sum, also ``moe_hc_write_kernel``'s)."""
    j = tl.arange(0, BK)
    srt, k = combine_ranks(IDX, n, k, j, JOIN)
    live = j < k
    rows = tl.load(RANK + n * k + j, mask=live, other=0)  # every slot's sorted row at once (k counts the joined slot)
    acc = tl.zeros([BD], tl.float32)
    # unrolled over the BK slots, so the rows' loads are in flight together (a loop over k issued them one
    # after another: 4.23 -> 4.08 us a call at 256 tokens, 3.21 -> 2.37 at 64, 3.31 -> 2.10 at 16 on an H100,
    # the same bits; bench/unsort_rows.py, bench/results/unsort_rows_h100_5544e32.json); the adds stay in
    # rank order, and a slot past k adds nothing (``where``, not + 0.0, which would turn a -0.0 sum into +0.0)
    for r in tl.static_range(BK):
        slot = tl.sum(tl.where((srt == r) & live, j, 0), 0)
        row = tl.sum(tl.where(j == slot, rows, 0), 0)
        v = tl.load(O + row * s_o + d, mask=dm & (r < k), other=0.0).to(tl.float32)
        acc = tl.where(r < k, acc + v, acc)
    return acc


@triton.jit
def moe_hc_write_kernel(O, RANK, IDX, X, Post, Comb, Y, k, n, D, s_o, s_xn, s_xj, s_pn, s_cn, s_cj, s_yn, s_yk,
                        BK: tl.constexpr, BD: tl.constexpr, NB: tl.constexpr, JOIN: tl.constexpr):
    """Token ``t``'s combined expert rows over columns ``d`` (``combine_row``), rounded to the
    streams' dtype as ``unsort_kernel`` stores them, then ``hc_write``'s new streams from them
    (``triton_rows.write_streams``): the two kernels' bits, the combined row never stored."""
    pdl_enter()
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = d < D
    acc = combine_row(O, RANK, IDX, t, d, dm, k, s_o, BK, BD, JOIN)
    o = acc.to(X.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
    write_streams(X, o, Post, Comb, Y, t, d, n, D, s_xn, s_xj, s_pn, s_cn, s_cj, s_yn, s_yk, NB)


def moe_hc_write(x, out, rank, indices, joined, post, comb):
    """``ops.fused.moe_hc_write`` in fast mode: ``hc_write(x, moe_unsort_combine(out, rank, indices,
    None, x.dtype, joined), post, comb)`` in one launch (the two kernels' grid: a token and 1024
    columns a program)."""
    k = indices.shape[1]
    N, n, D = x.shape
    xc, pc, cc = x.contiguous(), post.contiguous(), comb.contiguous()
    y = torch.empty(N, n, D, dtype=x.dtype, device=x.device)
    if N and D:
        bd = min(1024, next_pow2(D))
        launch(moe_hc_write_kernel, (N, -(-D // bd)), out, rank, indices, xc, pc, cc, y, k, n, D, out.stride(0),
               xc.stride(0), xc.stride(1), pc.stride(0), cc.stride(0), cc.stride(1), y.stride(0), y.stride(1),
               BK=max(2, next_pow2(k + joined)), BD=bd, NB=max(2, next_pow2(n)), JOIN=joined, num_warps=4)
    return y


def moe_unsort_combine(out: torch.Tensor, rank: torch.Tensor, indices: torch.Tensor, shared, out_dtype,
                       joined: bool = False):
    """Per token ``t``: the sorted outputs ``out[rank[t k + j]]`` summed in fp32 in ascending
    expert id (ties in slot order), plus ``shared [T, d]`` (widened to fp32) if given, written in
    ``out_dtype``. ``joined``: ``moe_route(..., joined=True)``'s pairs (one more a token, added last)."""
    T, k = indices.shape
    D = out.shape[1]
    y = torch.empty(T, D, dtype=out_dtype, device=out.device)
    if T and D:
        bd = min(1024, next_pow2(D))
        launch(unsort_kernel, (T, -(-D // bd)), out, rank, indices, shared if shared is not None else out, y, k, D,
               out.stride(0), shared.stride(0) if shared is not None else 0, y.stride(0), BK=max(2, next_pow2(k + joined)),
               BD=bd, HAS_S=shared is not None, JOIN=joined, num_warps=4)
    return y


def builds() -> dict:
    """name -> (jit function, signature, constexprs) for the ahead-of-time Hopper build check: at
    V4-Flash widths (256 experts, top 6) and at 8 experts (the 4-layer serving bench)."""
    gate = dict(L="*fp32", B="*fp32", TAB="*i32", TOK="*i64", IDX="*i64", WO="*fp32", E="i32", s_l="i32", scale="fp32")
    route = dict(IDX="*i64", W="*fp32", OFF="*i64", ORDER="*i64", RANK="*i64", TOK="*i64", WS="*fp32", P="i32",
                 E="i32")
    unsort = dict(O="*bf16", RANK="*i64", IDX="*i64", S="*bf16", Y="*bf16", k="i32", D="i32", s_o="i32", s_s="i32",
                  s_y="i32")
    rows = {**route, "X": "*bf16", "R": "*bf16", "D": "i32", "s_x": "i32", "s_r": "i32"}
    return {
        "moe_gate": (gate_kernel, gate, dict(K=6, KP=8, BE=256, HASHED=False, HAS_B=True, ACCURATE=True, S=0, SP=1)),
        "moe_gate_e8": (gate_kernel, gate, dict(K=6, KP=8, BE=8, HASHED=False, HAS_B=True, ACCURATE=True, S=0, SP=1)),
        "moe_gate_hashed": (gate_kernel, gate, dict(K=6, KP=8, BE=256, HASHED=True, HAS_B=False, ACCURATE=True, S=0,
                                                    SP=1)),
        # fast mode's router: the logits' 16 slice partials (K = 4096) summed in the gate
        "moe_gate_e8_partials": (gate_kernel, gate, dict(K=6, KP=8, BE=8, HASHED=False, HAS_B=True, ACCURATE=True,
                                                         S=16, SP=16)),
        "moe_route": (route_kernel, route, dict(K=6, BP=1024, JOIN=False)),
        "moe_route_e8": (route_kernel, route, dict(K=6, BP=512, JOIN=True)),
        "moe_route_one": (route_kernel, route, dict(K=6, BP=2048, JOIN=True, ONE=True)),
        "moe_route_rows": (route_rows_kernel, rows, dict(K=6, BP=2048, JOIN=True, BR=ROWS_TILE["BR"],
                                                         BC=ROWS_TILE["BC"]), dict(num_warps=ROWS_TILE["num_warps"])),
        "moe_unsort_combine": (unsort_kernel, unsort, dict(BK=8, BD=1024, HAS_S=True, JOIN=False)),
        "moe_unsort_combine_joined": (unsort_kernel, unsort, dict(BK=8, BD=1024, HAS_S=False, JOIN=True)),
    }
