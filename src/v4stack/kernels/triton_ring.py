"""The decode step's ring kernels (Triton): the compressor's projections into its tail rings, the
rows a closing entry pools, and a boundary capture's copy of a ring into its snapshot slot.

``tail_write``: row ``n`` of a decode step writes ``kv[n]`` widened to the ring's dtype and
``score[n] + ape[pos[n] % ratio]`` into ring row ``dest[n]`` of the kv and score rings. The torch
composition launches up to seven kernels (two casts, the remainder, the ape gather, the add and
two ``index_copy_``); this is one. Widening is exact and the add is one IEEE fp32 addition, so
the rings hold the composition's bits, in both modes.

``ring_capture``: capture ``c`` (request row ``seq[c]`` at position ``pos[c]``) writes ring row
``j`` of that row's state slot, as it stood at ``q = pos[c] - R + j``, into row ``q mod R`` of its
snapshot slot ``slot[c]`` - ``fill`` where ``q < 0``. The torch composition (``Rings.capture``)
launches ~10 kernels a ring (the positions, the ring rows, the clamp, the gather, the fill and the
indexed write); this is one. A copy: the snapshot holds the ring's bits.

``closing_rows``: the kv and score rows an entry that closes in a decode step pools, read from its
request's tail rings - for entry ``e`` of ratio ``m`` the positions ``e m - lookback + j``, ``j <
coff m``, in position order, the overlapped compressor's first ``m`` rows from channels ``[0, c)``
and the next ``m`` from ``[c, 2c)``, 0 / -inf before position 0. The composition (``Rings.rows``,
two gathers with their fills, two concatenations) is ~12 kernels; this is one, and a copy.

``pack_keys_into``: the indexer keys that close in a step, packed into V4's cache format
(``ops/fp8_keys.py``: e4m3 codes and a power-of-two scale a 32 dims) straight into their pool rows.
The torch composition is ~20 kernels (a few a block, the concatenation, the indexed write); this
is one, with the composition's bytes: the same fp32 quotient for the scale, a multiply by a power of
two for the codes and e4m3's round-to-nearest-even done in fp32 arithmetic (``triton_round``), so the
conversion after it is exact on the GPU and in the interpreter alike.
"""

import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import launch, next_pow2
from v4stack.kernels.triton_round import e4m3_byte, pow2_ceil_exp


@triton.jit
def tail_kernel(KV, G, APE, POS, DEST, RK, RS, W, ratio, s_kv, s_g, BW: tl.constexpr):
    pdl_enter()
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BW + tl.arange(0, BW)
    m = c < W
    dst = tl.load(DEST + n)
    a = tl.load(POS + n) % ratio
    kv = tl.load(KV + n * s_kv + c, mask=m, other=0.0).to(RK.dtype.element_ty)
    g = tl.load(G + n * s_g + c, mask=m, other=0.0).to(RS.dtype.element_ty)
    g = g + tl.load(APE + a * W + c, mask=m, other=0.0).to(RS.dtype.element_ty)
    tl.store(RK + dst * W + c, kv, mask=m)
    tl.store(RS + dst * W + c, g, mask=m)


def tail_write(kv, score, ape, positions, ratio: int, ring_kv, ring_score, dest, cd=None) -> None:
    """Rows ``kv, score [N, W]`` (any float dtype), ``ape [ratio, W]`` (fp32), ``positions [N]``
    and ring rows ``dest [N]`` (int64) into ``ring_kv, ring_score [S, R, W]`` (fp32); ``cd``, the
    op's compute dtype, is fp32 wherever the dispatch sends a call here (``tail_write_ok``)."""
    N, W = kv.shape
    if N and W:
        bw = min(1024, next_pow2(W))
        launch(tail_kernel, (N, -(-W // bw)), kv, score, ape, positions, dest, ring_kv, ring_score, W, ratio,
               kv.stride(0), score.stride(0), BW=bw, num_warps=4)


@triton.jit
def capture_kernel(POOL, SNAP, SLOTS, SEQ, POS, SLOT, R, D, fill, s_snap, BR: tl.constexpr, BD: tl.constexpr):
    pdl_enter()
    c = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * BR + tl.arange(0, BR)
    rows_in = j < R
    q = tl.load(POS + c) - R + j
    r = ((q % R) + R) % R  # position q's ring row (floor remainder: q may be negative)
    src = tl.load(SLOTS + tl.load(SEQ + c)) * R + r
    have = rows_in & (q >= 0)
    dst = tl.load(SLOT + c) * s_snap + r * D
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        dm = d < D
        v = tl.load(POOL + src[:, None] * D + d[None, :], mask=have[:, None] & dm[None, :], other=fill)
        tl.store(SNAP + dst[:, None] + d[None, :], v.to(SNAP.dtype.element_ty), mask=rows_in[:, None] & dm[None, :])


def ring_capture(pool, snap, slots, seq, pos, slot, R: int, fill: float) -> None:
    """``pool [S * R, D]`` (a ring's rows), ``snap [P, R, D]`` (contiguous), the step's state slots
    ``slots [T]`` and the captures' ``seq, pos, slot [C]`` (int64): see the module."""
    C, D = seq.shape[0], pool.shape[1]
    if C and R and D:
        br = min(16, next_pow2(R))
        launch(capture_kernel, (C, -(-R // br)), pool, snap, slots, seq, pos, slot, R, D, float(fill), snap.stride(0),
               BR=br, BD=min(256, next_pow2(D)), num_warps=4)


@triton.jit
def closing_kernel(PK, PS, SLOTS, SEQ, ENT, OK, OS, R, m, lookback, W, c, COFF: tl.constexpr, BD: tl.constexpr):
    pdl_enter()
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    q = tl.load(ENT + n) * m - lookback + j
    have = q >= 0
    row = tl.load(SLOTS + tl.load(SEQ + n)) * R + tl.where(have, q, 0) % R
    half = j * 0
    if COFF == 2:  # the overlapped compressor: the previous block's rows from the first half of the channels
        half = tl.where(j >= m, c, 0)
    out = (n * (COFF * m) + j) * c
    for d0 in range(0, c, BD):
        d = d0 + tl.arange(0, BD)
        dm = d < c
        kv = tl.load(PK + row * W + half + d, mask=dm & have, other=0.0)
        sc = tl.load(PS + row * W + half + d, mask=dm & have, other=float("-inf"))
        tl.store(OK + out + d, kv, mask=dm)
        tl.store(OS + out + d, sc, mask=dm)


def closing_rows(kv_pool, score_pool, slots, seq, entry, R: int, m: int, lookback: int, coff: int, c: int):
    """``kv_pool, score_pool [S * R, coff * c]`` (a compressor's tail rings), the step's state slots
    ``slots [T]``, the closing entries' step rows ``seq [n]`` and entry numbers ``entry [n]`` (int64)
    -> ``(kv, score) [n, coff * m, c]`` in the rings' dtype: see the module."""
    import torch

    n, L = seq.shape[0], coff * m
    kv = torch.empty(n, L, c, dtype=kv_pool.dtype, device=kv_pool.device)
    score = torch.empty(n, L, c, dtype=score_pool.dtype, device=score_pool.device)
    if n and L and c:
        launch(closing_kernel, (n, L), kv_pool, score_pool, slots, seq, entry, kv, score, R, m, lookback,
               kv_pool.shape[1], c, COFF=coff, BD=min(1024, next_pow2(c)), num_warps=4)
    return kv, score


def builds() -> dict:
    """name -> (jit function, signature, constexprs) for the ahead-of-time Hopper build check (a
    CSA compressor at V4-Flash width: two 512-wide halves; the rotation into a ring's rows and
    into a fresh tensor, and in place - with its barrier, and without it for the test that shows
    the race - and the two of a decode step in one launch)."""
    sig = dict(KV="*bf16", G="*bf16", APE="*fp32", POS="*i64", DEST="*i64", RK="*fp32", RS="*fp32", W="i32",
               ratio="i32", s_kv="i32", s_g="i32")
    from v4stack.kernels import triton_mhc as tm

    rope = dict(X="*bf16", Y="*bf16", POS="*i64", FREQ="*fp64", CS="*fp64", DEST="*i64", M="i32", D="i32")
    table = {**rope, "CS": "*fp32"}
    cap = dict(POOL="*bf16", SNAP="*bf16", SLOTS="*i64", SEQ="*i64", POS="*i64", SLOT="*i64", R="i32", D="i32",
               fill="fp32", s_snap="i32")
    return {"tail_write": (tail_kernel, sig, dict(BW=1024)),
            "pack_keys": (pack_keys_kernel, dict(X="*bf16", DEST="*i64", P="*u8", s_x="i32", s_p="i32"),
                          dict(D=128, BLK=32, PAD=16)),
            "ring_capture": (capture_kernel, cap, dict(BR=16, BD=256)),
            "closing_rows": (closing_kernel, dict(PK="*fp32", PS="*fp32", SLOTS="*i64", SEQ="*i64", ENT="*i64",
                                                  OK="*fp32", OS="*fp32", R="i32", m="i32", lookback="i32", W="i32",
                                                  c="i32"), dict(COFF=2, BD=512)),
            **{f"rope_dest{int(d)}": (tm.rope_kernel, rope, dict(SIGN=1.0, HALF=32, BM=16, BD=128, HAS_DEST=d))
               for d in (False, True)},
            **{f"rope_inplace{'' if b else '_nobarrier'}": (tm.rope_kernel, rope, dict(
                SIGN=1.0, HALF=32, BM=16, BD=128, HAS_DEST=False, COPY=False, BARRIER=b)) for b in (True, False)},
            **{f"rope_table_dest{int(d)}": (tm.rope_kernel, table, dict(
                SIGN=1.0, HALF=32, BM=16, BD=128, HAS_DEST=d, COPY=d, BARRIER=not d, TABLE=True))
               for d in (False, True)},
            **{f"rope_pair{'' if b else '_nobarrier'}": (tm.rope_pair_kernel, dict(
                Q="*bf16", POS="*i64", FREQ="*fp64", CS="*fp32", KV="*bf16", POOL="*bf16", DEST="*i64", MQ="i32",
                DQ="i32", DK="i32", QB="i32"), dict(HALF=32, BMQ=16, BD=128, TABLE=True, BARRIER=b)) for b in (True, False)},
            "rope_table": (tm.rope_table_kernel, dict(POS="*i64", FREQ="*fp64", CS="*fp32", T="i32"),
                           dict(HALF=32, BT=64))}


@triton.jit
def pack_keys_kernel(X, DEST, P, s_x, s_p, D: tl.constexpr, BLK: tl.constexpr, PAD: tl.constexpr):
    """Row ``n`` of ``X [N, D]`` packed (``ops/fp8_keys.py``) into pool row ``DEST[n]`` of ``P``."""
    pdl_enter()
    n = tl.program_id(0).to(tl.int64)
    NB: tl.constexpr = D // BLK
    x = tl.reshape(tl.load(X + n * s_x + tl.arange(0, D)).to(tl.float32), [NB, BLK])
    amax = tl.max(tl.abs(x), 1)
    # the scale's biased exponent: 2^ceil(log2(amax / 448)), at least 2^-126; an all-zero block gets 1 (127)
    e = tl.where(amax > 0, pow2_ceil_exp(tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))), 127)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 2^(127 - e), exact: a power of two
    code = e4m3_byte(x * inv[:, None])
    row = P + tl.load(DEST + n) * s_p
    tl.store(row + tl.arange(0, D), tl.reshape(code, [D]))
    tl.store(row + D + tl.arange(0, NB), e.to(tl.uint8))
    z = tl.arange(0, PAD)  # the alignment's bytes: zeros (PAD a power of two covering them)
    tl.store(row + D + NB + z, tl.zeros([PAD], tl.uint8), mask=D + NB + z < s_p)


def pack_keys_into(new, pool, dest) -> None:
    """Keys ``new [N, D]`` (D a power of two, at least 16) packed into rows ``dest [N]`` (int64) of
    the flattened key pool ``pool`` (uint8, ``ops.fp8_keys.width(D)`` bytes a row): ``ops.fused.pack_keys_into``."""
    from v4stack.ops.fp8_keys import blocks, width  # here: the ops package imports the kernels while it loads

    N, D = new.shape
    if N:
        p = pool.view(-1, pool.shape[-1])
        launch(pack_keys_kernel, (N,), new, dest, p, new.stride(0), p.stride(0), D=D, BLK=min(32, D),
               PAD=next_pow2(max(1, width(D) - D - blocks(D))), num_warps=1)
