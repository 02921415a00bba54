"""The indexer's choice in one kernel (Triton): per query, the pool rows of its ``k`` best-scored
entries, in entry order.

``topk_rows(scores [n, E], rows [n, E], k)`` is ``rows.gather(1, sort(topk(scores masked -inf where
rows < 0, k, stable)))``: the top ``k`` by score, ties to the lower entry, listed in ascending entry
order. One program per query holds its row of scores as order-preserving integer keys (``-0.0``
taken as ``+0.0``, as a sort compares them equal), finds the ``k``-th largest key by a bitwise
search from the top bit (32 counting passes; or 16 of two bits, the three counts of a pass packed
into one sum), takes every key above it and the first ties in entry order, and writes the chosen
rows by a running count. It replaces a radix sort of the scores, a sort of the chosen indices and
two gathers (74 us for one CSA layer's queries at batch 64 and 16k
tokens on an H200). Integer results: equal to the torch composition's for any non-NaN scores.
"""

import torch
import triton
import triton.language as tl

from v4stack.kernels.launch import launch, next_pow2

MAX_ENTRIES = 16384  # one program holds a query's entries (and a count fits 16 bits); wider rows take the
# torch composition


@triton.jit
def topk_rows_kernel(S, ROWS, OUT, E, k, s_s, s_r, s_o, EB: tl.constexpr, BITS: tl.constexpr = 2):
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EB)
    inside = e < E
    r = tl.load(ROWS + n * s_r + e, mask=inside, other=-1)
    s = tl.load(S + n * s_s + e, mask=inside, other=float("-inf")).to(tl.float32)
    s = tl.where(r >= 0, s, float("-inf"))
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 -> +0.0
    bits = s.to(tl.int32, bitcast=True)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648  # float order, as [0, 2^32)
    key = tl.where(inside, key, -1)  # past E: below every entry
    res = tl.zeros([], tl.int64)
    if BITS == 1:  # one count a bit
        for b in range(31, -1, -1):
            cand = res | (tl.full([], 1, tl.int64) << b)
            if tl.sum((key >= cand).to(tl.int32), 0) >= k:
                res = cand
    else:  # two bits a pass: the three counts packed in 16-bit fields of one sum (E <= 16384)
        for b in range(30, -1, -2):
            c1 = res | (tl.full([], 1, tl.int64) << b)
            c2 = res | (tl.full([], 2, tl.int64) << b)
            c3 = res | (tl.full([], 3, tl.int64) << b)
            packed = (key >= c1).to(tl.int64) + ((key >= c2).to(tl.int64) << 16) + ((key >= c3).to(tl.int64) << 32)
            tot = tl.sum(packed, 0)
            n1, n2, n3 = tot & 0xFFFF, (tot >> 16) & 0xFFFF, (tot >> 32) & 0xFFFF
            res = tl.where(n3 >= k, c3, tl.where(n2 >= k, c2, tl.where(n1 >= k, c1, res)))
    gt = key > res
    eq = key == res
    need = k - tl.sum(gt.to(tl.int32), 0)
    sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
    pos = tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(OUT + n * s_o + pos, r, mask=sel)


# one bit a pass: the form measured in the serving step (18 us for 256 queries of 4096 entries,
# bench/results/indexer_select_h200.json); bench/indexer_select.py times two bits a pass and the warps
TILE = {"BITS": 1}


def topk_rows(scores: torch.Tensor, rows: torch.Tensor, k: int, tile: dict | None = None) -> torch.Tensor:
    n, E = scores.shape
    out = torch.empty(n, k, dtype=torch.int64, device=scores.device)
    if n and k:
        t = tile or TILE
        eb = max(16, next_pow2(E))
        launch(topk_rows_kernel, (n,), scores, rows, out, E, k, scores.stride(0), rows.stride(0), out.stride(0), EB=eb,
               BITS=t.get("BITS", 1), num_warps=t.get("num_warps", min(16, max(4, eb // 512))))
    return out
