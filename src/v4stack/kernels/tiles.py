"""Tile shapes of the Triton GEMMs, by size bucket (no Triton import: the contract proofs read
them too). A bucket changes an output tile's M x N shape (and which program runs it) only, never
an element's K chain.

The defaults below can be replaced by ``tiles_chosen.json`` beside this file: the pick of
``bench/gemm_tiles.py`` on the GPU, each bucket's tile the fastest of the ``*_CANDIDATES`` whose
rows were bit-identical to the rows computed alone. Only candidates listed here can be chosen,
so every tile that can run has its contract proved (``specs.py`` proves every candidate).
"""

import json
import os
from pathlib import Path


def _t(BM, BN, BK, w=4, s=4, **kw):
    return dict(BM=BM, BN=BN, BK=BK, num_warps=w, num_stages=s, **kw)


# The K rule of the fixed-slice GEMMs (``triton_slices``): constants, so a row's sum order depends
# on K alone. bf16 / fp16: slices of HALF_SPLIT. fp32 (3xTF32) and hc_mix: slices of F32_SPLIT in
# K steps of F32_BK (the 3xTF32 chain interleaves its three products per step, so the step is fixed).
HALF_SPLIT = 2048
F32_SPLIT = 256
F32_BK = 32
# ``grid``: a tile's K slices run in separate programs (few rows still fill the SMs); ``tma``: the
# persistent TMA kernel. BM >= 64 with 4+ warps runs on ``wgmma``, BM 16 / 32 on ``mma.sync``: a
# tile may be chosen only where the sweep found its bits equal to the reference tile's.
HALF_CANDIDATES = (_t(64, 32, 128, grid=True), _t(64, 64, 64, grid=True), _t(64, 128, 64, grid=True),
                   _t(64, 32, 64, s=6, grid=True), _t(128, 64, 64, grid=True), _t(64, 64, 64),
                   _t(128, 128, 64, w=8, tma=True), _t(128, 256, 64, w=8, s=3, tma=True),
                   _t(128, 256, 64, w=8, s=3, tma=True, WS=True), _t(16, 64, 128, s=4, grid=True),
                   _t(32, 64, 64, s=5, grid=True), _t(128, 128, 64, w=8, s=5, tma=True),
                   # M = 64..256: 128-512 programs in flight, deeper K steps (second sweep)
                   _t(64, 32, 128), _t(64, 16, 128), _t(64, 16, 128, grid=True), _t(64, 64, 128, grid=True),
                   _t(128, 128, 64, w=8, grid=True), _t(128, 64, 128, w=8, s=3), _t(64, 128, 128, s=3),
                   # third sweep. M = 256: 128 programs as 128 x 128 tiles x 2 slices (grid form, the last
                   # program adding 2 partials, unroll 2), or 128 x 64 / 64 x 128 tiles on TMA
                   _t(128, 128, 64, w=8, grid=True, unroll=2), _t(128, 128, 128, w=8, s=3, grid=True, unroll=2),
                   _t(128, 128, 64, w=8, grid=True, unroll=1),
                   _t(128, 64, 128, w=8, s=4), _t(64, 128, 128, s=4),
                   _t(128, 64, 128, w=8, s=3, tma=True), _t(128, 64, 128, w=8, s=4, tma=True),
                   _t(128, 64, 128, w=8, s=3, tma=True, WS=True), _t(64, 128, 128, s=4, tma=True),
                   _t(64, 128, 128, s=3, tma=True, WS=True),
                   _t(128, 128, 64, w=8, s=4, tma=True, grid=True, unroll=2),
                   _t(128, 128, 128, w=8, s=3, tma=True, grid=True, unroll=2),
                   # M <= 64: the grid form adding its 2 partials with unroll 2
                   _t(16, 64, 128, grid=True, unroll=2), _t(64, 32, 128, grid=True, unroll=2),
                   _t(64, 64, 128, grid=True, unroll=2))
HALF_TILES = ((64, HALF_CANDIDATES[1]), (256, HALF_CANDIDATES[2]), (1 << 62, HALF_CANDIDATES[6]))
# fp32 (3xTF32, BK = F32_BK)
F32_CANDIDATES = (_t(64, 32, F32_BK, s=3, grid=True), _t(64, 64, F32_BK, s=3, grid=True),
                  _t(64, 16, F32_BK, s=4, grid=True), _t(128, 64, F32_BK, w=8, s=3, grid=True),
                  _t(64, 64, F32_BK, s=3), _t(128, 64, F32_BK, w=8, s=3), _t(16, 32, F32_BK, s=4, grid=True),
                  _t(32, 32, F32_BK, s=4, grid=True), _t(128, 64, F32_BK, w=8, s=4),
                  _t(16, 16, F32_BK, s=4, grid=True), _t(16, 32, F32_BK, s=3, grid=True),
                  # third sweep: the partials added by a second launch, one element per thread
                  _t(16, 32, F32_BK, s=4, grid=True, two=True), _t(64, 32, F32_BK, s=3, grid=True, two=True),
                  _t(16, 32, F32_BK, s=4, grid=True, unroll=16))
F32_TILES = ((64, F32_CANDIDATES[0]), (1 << 62, F32_CANDIDATES[1]))
# fp32 outputs at most F32_SKINNY_N wide (the MoE gate's logits, N = experts) fill one narrow column
# tile: narrow tiles with the grid form spread the rows over the SMs, where F32_TILES' wide ones
# (picked at N = 4096) leave a few programs (bench/results/skinny_tiles_h200.json: 256 x 8 x 4096
# 24.4 -> 5.9 us, 4096 x 64 x 4096 138 -> 51 us); every tile gives the same bits
F32_SKINNY_N = 64
F32_SKINNY_TILES = ((256, F32_CANDIDATES[11]), (1 << 62, F32_CANDIDATES[12]))
# hc_mix (fp32 3xTF32, N <= 64 in one N tile): rows per program, K step F32_BK
HC_CANDIDATES = (dict(BM=64, BK=F32_BK, num_warps=4, num_stages=3, grid=True),
                 dict(BM=128, BK=F32_BK, num_warps=8, num_stages=3, grid=True),
                 dict(BM=128, BK=F32_BK, num_warps=4, num_stages=3, grid=True),
                 dict(BM=64, BK=F32_BK, num_warps=4, num_stages=4, grid=True),
                 dict(BM=64, BK=F32_BK, num_warps=4, num_stages=3),
                 dict(BM=16, BK=F32_BK, num_warps=4, num_stages=4, grid=True),
                 dict(BM=32, BK=F32_BK, num_warps=4, num_stages=4, grid=True),
                 # third sweep: the 64 partials of a row added by a second launch (``two``: ``fr`` rows x 32
                 # columns per program, one element per thread) or, in the one launch, more loads at once
                 dict(BM=16, BK=F32_BK, num_warps=4, num_stages=4, grid=True, two=True),
                 dict(BM=16, BK=F32_BK, num_warps=4, num_stages=8, grid=True, two=True),
                 dict(BM=16, BK=F32_BK, num_warps=4, num_stages=8, grid=True, two=True, fr=8),
                 dict(BM=32, BK=F32_BK, num_warps=4, num_stages=4, grid=True, two=True),
                 dict(BM=64, BK=F32_BK, num_warps=4, num_stages=3, grid=True, two=True),
                 dict(BM=64, BK=F32_BK, num_warps=4, num_stages=8, grid=True, two=True),
                 dict(BM=64, BK=F32_BK, num_warps=4, num_stages=4, grid=True, two=True, fr=8),
                 dict(BM=128, BK=F32_BK, num_warps=8, num_stages=3, grid=True, two=True),
                 dict(BM=16, BK=F32_BK, num_warps=4, num_stages=4, grid=True, unroll=32),
                 dict(BM=16, BK=F32_BK, num_warps=4, num_stages=8, grid=True),
                 dict(BM=16, BK=F32_BK, num_warps=2, num_stages=4, grid=True, two=True))
HC_TILES = ((1 << 62, HC_CANDIDATES[0]),)
# hc_mix on bf16 / fp16 streams (``hc_pre``): only tiles whose bits on such streams equal the fp32
# tiles' (the sweep found ``mma.sync`` tiles, BM < 64, differ there while they agree on fp32 input)
HC_HALF_TILES = ((1 << 62, HC_CANDIDATES[0]),)
# grouped expert GEMM, by routed rows per expert ``ceil(T / E)`` (what fills a row tile; decode-sized
# calls spread over more N tiles)
# ``tma``: the persistent TMA kernel (``triton_grouped_tma``; ``FLAT``: its tile and K loops flattened into
# one pipelined loop, ``occ``: programs per SM); the others the table kernel (one program per tile)
GROUPED_CANDIDATES = (_t(64, 32, 128), _t(64, 128, 64, s=3), _t(64, 64, 64), _t(64, 256, 64, w=8, s=3),
                      _t(64, 64, 128, s=3), _t(64, 128, 64),
                      _t(64, 64, 64, s=6, tma=True), _t(64, 128, 64, tma=True), _t(64, 128, 64, tma=True, occ=2),
                      _t(64, 256, 64, w=8, tma=True), _t(64, 256, 64, w=8, tma=True, FLAT=True),
                      _t(128, 128, 64, w=8, tma=True), _t(128, 128, 64, w=8, tma=True, FLAT=True),
                      _t(128, 256, 64, w=8, s=3, tma=True), _t(128, 256, 64, w=8, s=3, tma=True, FLAT=True),
                      _t(64, 128, 128, s=3, tma=True), _t(64, 32, 128, tma=True), _t(64, 64, 64, tma=True, occ=2),
                      # decode (memory-bound, 9-65 experts): more column tiles in flight, deeper K steps
                      _t(64, 64, 128, s=4, tma=True))
# a TMA tile where TMA's terms do not hold (fp32, unaligned rows) runs the table kernel with this tile
GROUPED_FALLBACK = GROUPED_CANDIDATES[2]
GROUPED_TILES = ((128, GROUPED_CANDIDATES[0]), (1 << 62, GROUPED_CANDIDATES[1]))
FP8_BLOCK = 128  # weight scale block (rows x columns), V4's checkpoint format
FP8_TILES = ((64, dict(BM=64, BN=32)), (1 << 62, dict(BM=64, BN=128)))

# Calls captured in a CUDA graph (the engine's decode steps) may take another tile of the same
# candidates: ``*_GRAPH``, picked by device time alone, where the tables above are picked by device
# plus host time (a tile whose host launch outlasts its kernel, the TMA kernel's at 256 rows, pays
# for that only outside graphs). Every tile gives a row the same bits, so the two may mix.
GRAPH = {"HALF_TILES": "HALF_TILES_GRAPH", "F32_TILES": "F32_TILES_GRAPH", "HC_TILES": "HC_TILES_GRAPH",
         "HC_HALF_TILES": "HC_HALF_TILES_GRAPH", "GROUPED_TILES": "GROUPED_TILES_GRAPH"}
HALF_TILES_GRAPH, F32_TILES_GRAPH, HC_TILES_GRAPH, HC_HALF_TILES_GRAPH = HALF_TILES, F32_TILES, HC_TILES, HC_HALF_TILES
GROUPED_TILES_GRAPH = GROUPED_TILES

CANDIDATES = {"HALF_TILES": HALF_CANDIDATES, "F32_TILES": F32_CANDIDATES, "F32_SKINNY_TILES": F32_CANDIDATES,
              "HC_TILES": HC_CANDIDATES,
              "HC_HALF_TILES": HC_CANDIDATES,
              "GROUPED_TILES": GROUPED_CANDIDATES}
CANDIDATES.update({g: CANDIDATES[b] for b, g in GRAPH.items()})
# ``V4STACK_TILES`` names another pick file (a sweep's, measured before it is installed)
CHOSEN = Path(os.environ.get("V4STACK_TILES") or Path(__file__).with_name("tiles_chosen.json"))


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def load_chosen(path: Path = CHOSEN, raw: dict | None = None) -> dict:
    """``{table: ((largest M, tile), ...)}`` from a sweep's pick; a tile not among the table's
    candidates (so without a proved contract) is refused. ``raw``: the file's content, already read."""
    raw = _read(path) if raw is None else raw
    out = {}
    for name, rows in raw.get("tables", {}).items():
        cands = CANDIDATES.get(name)
        if cands is None:
            raise ValueError(f"{path.name}: unknown tile table {name!r}")
        table = []
        for top, tile in rows:
            if tile not in cands:
                raise ValueError(f"{path.name}: {name} tile {tile} is not a candidate (no proved contract)")
            table.append((int(top), dict(tile)))
        if not table or table[-1][0] < (1 << 62):
            raise ValueError(f"{path.name}: {name} must end with a bucket for every M")
        out[name] = tuple(table)
    return out


_raw = _read(CHOSEN)
_loaded = load_chosen(CHOSEN, _raw)
globals().update(_loaded)
# the most rows a graph table was measured at (``graph_rows`` of the pick file): a larger captured call
# takes the eager table (GROUPED_TILES_GRAPH holds the engine's decode calls, not a captured prefill)
GRAPH_ROWS = _raw.get("graph_rows", {})
for _b, _g in GRAPH.items():  # a pick without a graph table: graph calls take the same tiles
    if _g not in _loaded:
        globals()[_g] = globals()[_b]


def pick(table, m: int) -> dict:
    for top, t in table:
        if m <= top:
            return t
    raise ValueError(m)


def pick_call(table, graph_table, m: int, cuda: bool, rows: int = 0, graph_rows: int | None = None) -> dict:
    """The bucket's tile of ``table``, or of ``graph_table`` where the two differ at ``m`` and the
    call is being captured in a CUDA graph (the capture query runs only where they differ);
    ``graph_rows``: the graph table serves calls of at most that many ``rows`` only."""
    t = pick(table, m)
    if graph_rows is not None and rows > graph_rows:
        return t
    if cuda and graph_table is not table:
        g = pick(graph_table, m)
        if g != t:
            import torch

            if torch.cuda.is_current_stream_capturing():
                return g
    return t
