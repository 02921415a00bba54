"""A decode step's shared index tensors (Triton), one kernel each instead of ~3-17 small ones.

- ``ring_rows``: every row's own ring row ``slot * R + pos % R`` (``Rings.dest``) and, with ``W``,
  its window's rows ``slot * R + q % R`` for ``q = pos - W + 1 .. pos`` (-1 where ``q < 0``).
- ``entry_rows``: every row's compressed entries ``e < E`` as pool rows through its block table
  (``block * per + e % per``), -1 where the entry has not closed by this step (``e >= (pos + 1) //
  ratio``) or its block is -1 - the candidates of an HCA layer, and the rows an indexer scores.
- ``feed_ids``: a decode step's token ids taken, where ``src >= 0``, from the tokens the previous
  step drew on the device (``fed[src]``), in place - inside the step's graph, not a copy before it.
- ``layout_in``: a decode step's whole layout read by the kernel itself from pinned host memory
  (mapped into the device's address space) into its device buffer, the ids fed as ``feed_ids``
  feeds them - one kernel node where a graph otherwise has a copy-engine transfer and the feed.
  The host rewrites the staging between replays, so its loads bypass the caches (``.cv``).

Integer arithmetic only: the results equal the torch compositions' (``ops/fused.py``).
"""

import torch
import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import launch, next_pow2


@triton.jit
def ring_rows_kernel(POS, SLOTS, DEST, WIN, R, W, HAS_WIN: tl.constexpr, BW: tl.constexpr):
    pdl_enter()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t)
    base = tl.load(SLOTS + t) * R
    tl.store(DEST + t, base + pos % R)
    if HAS_WIN:
        for j0 in range(0, W, BW):
            j = j0 + tl.arange(0, BW)
            q = pos - W + 1 + j
            tl.store(WIN + t * W + j, tl.where(q >= 0, base + tl.where(q >= 0, q, 0) % R, -1), mask=j < W)


def ring_rows(positions: torch.Tensor, slots: torch.Tensor, R: int, W: int):
    T = positions.shape[0]
    dest = torch.empty(T, dtype=torch.int64, device=positions.device)
    win = torch.empty(T, W, dtype=torch.int64, device=positions.device) if W else None
    if T:
        launch(ring_rows_kernel, (T,), positions, slots, dest, win if W else dest, R, W, HAS_WIN=W > 0,
               BW=min(1024, next_pow2(max(W, 1))), num_warps=4)
    return dest, win


@triton.jit
def entry_rows_kernel(TAB, POS, ROWS, nb, E, s_tab, ratio, per, BE: tl.constexpr):
    pdl_enter()
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1).to(tl.int64) * BE + tl.arange(0, BE)
    inside = e < E
    closed = (tl.load(POS + t) + 1) // ratio
    blk = tl.load(TAB + t * s_tab + tl.minimum(e // per, nb - 1), mask=inside, other=-1)
    ok = (e < closed) & (blk >= 0)
    tl.store(ROWS + t * E + e, tl.where(ok, blk * per + e % per, -1), mask=inside)


def entry_rows(table: torch.Tensor, positions: torch.Tensor, ratio: int, per: int, E: int) -> torch.Tensor:
    T = positions.shape[0]
    rows = torch.empty(T, E, dtype=torch.int64, device=positions.device)
    if T and E:
        be = min(1024, next_pow2(E))
        launch(entry_rows_kernel, (T, triton.cdiv(E, be)), table, positions, rows, table.shape[1], E, table.stride(0),
               ratio, per, BE=be, num_warps=4)
    return rows


@triton.jit
def feed_ids_kernel(IDS, SRC, FED, T, BT: tl.constexpr):
    pdl_enter()
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    inside = t < T
    src = tl.load(SRC + t, mask=inside, other=-1)
    fed = tl.load(FED + tl.where(src >= 0, src, 0), mask=inside & (src >= 0), other=0)
    tl.store(IDS + t, fed, mask=inside & (src >= 0))


def feed_ids(ids: torch.Tensor, src: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
    T = ids.shape[0]
    if T:
        bt = min(1024, next_pow2(T))
        launch(feed_ids_kernel, (triton.cdiv(T, bt),), ids, src, fed, T, BT=bt, num_warps=4)
    return ids


@triton.jit
def layout_in_kernel(STAGE, BUF, FED, n, R, BT: tl.constexpr):
    pdl_enter()
    i = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    inside = i < n
    v = tl.load(STAGE + i, mask=inside, other=0, volatile=True)
    head = inside & (i < R)
    src = tl.load(STAGE + 4 * R + i, mask=head, other=-1, volatile=True)
    fed = tl.load(FED + tl.where(src >= 0, src, 0), mask=head & (src >= 0), other=0)
    tl.store(BUF + i, tl.where(src >= 0, fed, v), mask=inside)


def layout_in(buf: torch.Tensor, staging: torch.Tensor, fed: torch.Tensor, R: int) -> torch.Tensor:
    n = buf.shape[0]
    if n:
        # one element a thread, so each warp's volatile load is one contiguous 256-byte read of the host memory
        launch(layout_in_kernel, (triton.cdiv(n, 128),), staging, buf, fed, n, R, BT=128, num_warps=4)
    return buf
