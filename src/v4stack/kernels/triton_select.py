"""The indexer's choice in one kernel (Triton): per query, the pool rows of its ``k`` best-scored
entries, in entry order.

``topk_rows(scores [n, E], rows [n, E], k)`` is ``rows.gather(1, sort(topk(scores masked -inf where
rows < 0, k, stable)))``: the top ``k`` by score, ties to the lower entry, listed in ascending entry
order. One program per query holds its row of scores as order-preserving integer keys (``-0.0``
taken as ``+0.0``, as a sort compares them equal), finds the ``k``-th largest key by a bitwise
search from the top bit (a counting pass a bit: 32 for fp32 scores, 16 for bf16 ones, whose low
half is the same in every key of a sign; or a pass of two bits, the three counts packed into one
sum; a row just past a power of two in two blocks, ``SPLIT``), takes every key above it
and the first ties in entry order, and writes the chosen rows by a running count. It replaces a
radix sort of the scores, a sort of the chosen indices and two gathers (74 us for one CSA layer's
queries at batch 64 and 16k tokens on an H200). Integer results: equal to the torch composition's
for any non-NaN scores.
"""

import torch
import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import launch, next_pow2

# one program holds a query's entries (and a count fits 16 bits); wider rows take the torch composition
MAX_ENTRIES = 16384


@triton.jit
def _keys(S, ROWS, n, s_s, s_r, e, E, SHIFT: tl.constexpr):
    """Entries ``e`` of query ``n``: their pool rows and order-preserving keys in [0, 2^(32 - SHIFT))
    (-1 past E). ``SHIFT``: low bits of the widened score that are the same for every score of its
    sign (16 for bf16, 13 for fp16 scores; 0 for fp32) - dropped, the keys keep their order."""
    inside = e < E
    r = tl.load(ROWS + n * s_r + e, mask=inside, other=-1)
    s = tl.load(S + n * s_s + e, mask=inside, other=float("-inf")).to(tl.float32)
    s = tl.where(r >= 0, s, float("-inf"))
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 -> +0.0
    bits = s.to(tl.int32, bitcast=True)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648  # float order, as [0, 2^32)
    if SHIFT > 0:  # zeros (ones where negative) in every key: a bit a pass spent on them would decide nothing
        key = key >> SHIFT
    return r, tl.where(inside, key, -1)  # past E: below every entry


@triton.jit
def _packed(key, c1, c2, c3):
    """The counts of keys >= c1, c2, c3 in 16-bit fields of one sum."""
    return tl.sum((key >= c1).to(tl.int64) + ((key >= c2).to(tl.int64) << 16) + ((key >= c3).to(tl.int64) << 32), 0)


@triton.jit
def topk_rows_kernel(S, ROWS, OUT, E, k, s_s, s_r, s_o, EB: tl.constexpr, BITS: tl.constexpr = 1,
                     EBT: tl.constexpr = 0, SHIFT: tl.constexpr = 0):
    """``EB`` entries in one block, and with ``EBT`` the entries from ``EB`` on in a second block of
    ``EBT`` (a row just past a power of two - a 16k step's 4608 - held as 4096 + 512, not 8192);
    keys of ``32 - SHIFT`` bits (``_keys``), one pass a bit (``BITS`` 1) or two."""
    pdl_enter()
    n = tl.program_id(0).to(tl.int64)
    KB: tl.constexpr = 32 - SHIFT
    r, key = _keys(S, ROWS, n, s_s, s_r, tl.arange(0, EB), E, SHIFT)
    if EBT > 0:
        rt, keyt = _keys(S, ROWS, n, s_s, s_r, EB + tl.arange(0, EBT), E, SHIFT)
    res = tl.zeros([], tl.int64)
    if BITS == 1:  # one count a bit
        for b in range(KB - 1, -1, -1):
            cand = res | (tl.full([], 1, tl.int64) << b)
            cnt = tl.sum((key >= cand).to(tl.int32), 0)
            if EBT > 0:
                cnt += tl.sum((keyt >= cand).to(tl.int32), 0)
            if cnt >= k:
                res = cand
    else:  # two bits a pass: the three counts packed in 16-bit fields of one sum (E <= 16384)
        for b in range(KB - 2 + KB % 2, -1, -2):  # an odd width's first pair: a bit no key has, and its top
            c1 = res | (tl.full([], 1, tl.int64) << b)
            c2 = res | (tl.full([], 2, tl.int64) << b)
            c3 = res | (tl.full([], 3, tl.int64) << b)
            tot = _packed(key, c1, c2, c3)
            if EBT > 0:
                tot += _packed(keyt, c1, c2, c3)
            n1, n2, n3 = tot & 0xFFFF, (tot >> 16) & 0xFFFF, (tot >> 32) & 0xFFFF
            res = tl.where(n3 >= k, c3, tl.where(n2 >= k, c2, tl.where(n1 >= k, c1, res)))
    gt = key > res
    eq = key == res
    n_gt = tl.sum(gt.to(tl.int32), 0)
    if EBT > 0:
        gtt = keyt > res
        eqt = keyt == res
        n_gt += tl.sum(gtt.to(tl.int32), 0)
    need = k - n_gt
    sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
    pos = tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(OUT + n * s_o + pos, r, mask=sel)
    if EBT > 0:  # the second block continues the first's tie count and positions
        selt = gtt | (eqt & (tl.cumsum(eqt.to(tl.int32), 0) + tl.sum(eq.to(tl.int32), 0) <= need))
        post = tl.cumsum(selt.to(tl.int32), 0) - 1 + tl.sum(sel.to(tl.int32), 0)
        tl.store(OUT + n * s_o + post, rt, mask=selt)


# one bit a pass: the form measured in the serving step (18 us for 256 queries of 4096 entries,
# bench/results/indexer_select_h200.json, 1 program an SM at 8192); a row just past a power of two
# in two blocks: a 16k step's 4608 entries as 4096 + 512 (209 registers a thread at the 4 warps it
# launches, so two programs an SM, against one 8192-wide program of 16 warps at 93, one an SM:
# `python -m v4stack.kernels.builds topk_rows_bf16_split topk_rows_bf16_wide`, Triton 3.6) - the same
# rows for any split, and rows up to a power of two are held as before. bench/indexer_select.py times
# every form.
TILE = {"BITS": 1, "SPLIT": True, "SHIFT": True}

# low bits that a widened score of this dtype holds the same for every score of its sign: bf16 is
# fp32's top half (16); fp16's 10-bit mantissa leaves 13. Searching the keys without them takes 16 /
# 19 passes instead of 32 (the two-bit search 8 / 10 instead of 16) and chooses the same rows (20.6
# -> 15.1 us for 256 queries of 4608 bf16 scores on an H100, bench/results/topk_forms_h100_84e0fe4.json).
_SHIFTS = {torch.bfloat16: 16, torch.float16: 13}


def topk_rows(scores: torch.Tensor, rows: torch.Tensor, k: int, tile: dict | None = None) -> torch.Tensor:
    n, E = scores.shape
    out = torch.empty(n, k, dtype=torch.int64, device=scores.device)
    if n and k:
        t = tile or TILE
        eb, ebt = max(16, next_pow2(E)), 0
        if t.get("SPLIT") and eb > 16 and E < eb:  # the largest power of two below E, then the rest
            eb //= 2
            ebt = max(16, next_pow2(E - eb))
        # a split row at 4 warps: 20.4 against 35.5 us at 8 for 256 x 4608 (indexer_select_h100.json)
        warps = 4 if ebt else min(16, max(4, eb // 512))
        shift = _SHIFTS.get(scores.dtype, 0) if t.get("SHIFT") else 0
        launch(topk_rows_kernel, (n,), scores, rows, out, E, k, scores.stride(0), rows.stride(0), out.stride(0), EB=eb,
               BITS=t.get("BITS", 1), EBT=ebt, SHIFT=shift, num_warps=t.get("num_warps", warps))
    return out
