"""Launch shapes of the sparse attention kernel (``triton_attention``), by query-row bucket (no
Triton import: the contract proofs read them too).

A shape says how many heads one program takes (``BH``), how many output columns (``DV``; the
scores always run over the full head width), its warps and pipeline stages, and the launch
(``split``: one program per chunk then an in-order merge, for few rows; ``fused``). None of these
changes the order of a (row, head)'s arithmetic: chunks of 64 candidates in list order, MMAs
over the head width and over the chunk in k-steps in order, the chunk's row sum a fixed pairwise
tree, the chunks merged in order. Whether the GPU's matrix instructions round alike for every
shape (``mma.sync`` for 16 or 32 heads a program, ``wgmma`` for 64) is measured, not assumed:
``bench/attention_tiles.py`` sorts the candidates into classes of bit-identical outputs on the
GPU and writes ``attention_tiles.json`` beside this file, every bucket a shape of one class, so
a row's bits never depend on which bucket its batch falls in. Every candidate's contract is
proved (``specs.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

CHUNK = 64  # candidates per chunk: part of the arithmetic, the same for every shape
LIVE_BI = 1024  # index block of the fused launch's pass for a row's last visible candidate


def _t(BH, w, s, path, DV=None, mw=8):
    return dict(BH=BH, DV=DV, num_warps=w, num_stages=s, path=path, merge_warps=mw)


# CANDIDATES[0] is the default of every bucket until a GPU sweep has chosen
CANDIDATES = (_t(16, 8, 3, "fused"), _t(16, 8, 2, "split"), _t(64, 8, 2, "split"), _t(64, 8, 1, "fused", DV=256),
              _t(64, 8, 1, "fused"), _t(64, 16, 2, "fused"), _t(64, 4, 1, "fused", DV=128), _t(32, 8, 2, "fused"),
              _t(16, 8, 2, "fused"), _t(16, 4, 3, "fused"), _t(16, 4, 2, "fused"),
              _t(32, 8, 3, "fused"), _t(64, 8, 2, "fused"))
SPLIT_BELOW = 264  # default path: split below this many (row x head group) programs (2 waves of 132 SMs)
TILES = ((1 << 62, dict(CANDIDATES[0], path=None)),)  # (rows <=, shape); path None: by SPLIT_BELOW
CHOSEN = Path(__file__).with_name("attention_tiles.json")


def load_chosen(path: Path = CHOSEN):
    """The bucket table of a GPU sweep (``attention_tiles.json``), or None without one. A shape
    that is not a candidate (no proved contract, not bit-compared) is refused."""
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    table = []
    for top, tile in raw["tiles"]:
        if tile not in CANDIDATES:
            raise ValueError(f"{path.name}: {tile} is not a candidate (no proved contract)")
        table.append((int(top), dict(tile)))
    if not table or table[-1][0] < (1 << 62):
        raise ValueError(f"{path.name}: the table must end with a bucket for every row count")
    return tuple(table)


TILES = load_chosen() or TILES


def pick(T: int, H: int, tiles=None) -> dict:
    """The shape for ``T`` rows of ``H`` heads: the first bucket with ``rows >= T``; heads per
    program capped at the next power of two of ``H`` (at least 16)."""
    for top, t in tiles or TILES:
        if T <= top:
            break
    bh = min(t["BH"], max(16, 1 << max(0, H - 1).bit_length()))
    hg = -(-H // bh)
    path = t["path"] or ("split" if T * hg < SPLIT_BELOW else "fused")
    return dict(t, BH=bh, path=path)


def takes_online(T: int, H: int) -> bool:
    """Where fast mode runs ``triton_attention_online``: rows whose bucket launches the 64-head
    fused shape (the shape it was measured faster than, ``bench/attention_online.py``)."""
    t = pick(T, H)
    return t["path"] == "fused" and t["BH"] == 64 and not t["DV"]


def block_heads() -> list[int]:
    """Every BH a candidate can launch with (the specs prove each)."""
    return sorted({t["BH"] for t in CANDIDATES} | {16, 32})


def column_blocks() -> list[tuple[int, int]]:
    """Every (BH, DV) with DV below the head width that a candidate can launch (D = 512)."""
    return sorted({(t["BH"], t["DV"]) for t in CANDIDATES if t["DV"]})
