"""The contracts of the Triton kernels, as ``prove.Spec``s of their index arithmetic.

Each mirrors its kernel's loads and stores (``triton_gemm``, ``triton_rows``,
``triton_attention``): sizes and strides are symbols, tile sizes the kernel's constants.
``build(name)`` proves a spec once, when its kernel is first built (``gpu._lazy``); the tests
prove all of them on the CPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from pathlib import Path

from v4stack.kernels import attention_tiles, specs_more, tiles
from v4stack.kernels.prove import Access, ContractError, Spec, cdiv, require


def gemm(name="gemm_tile", BM=64, BN=128, BK=64, mask_k=True, k_multiple=1, row_bound=None) -> Spec:
    """``Y[M, N] = X[M, K] @ W[N, K]^T`` (strided rows), one program per BM x BN tile, K in BK
    slices. ``mask_k=False`` drops the K mask (a contract must then make BK divide K);
    ``row_bound`` replaces the row mask (to show an off-by-one is caught)."""

    def row(n):
        return n.pm * BM + n.i

    def col(n):
        return n.pn * BN + n.j

    def kidx(n):
        return n.kb * BK + n.kk

    def rmask(n):
        return row_bound(n) if row_bound else row(n) < n.M

    def amask(n):
        import z3

        return z3.And(rmask(n), kidx(n) < n.K) if mask_k else rmask(n)

    def bmask(n):
        import z3

        return z3.And(col(n) < n.N, kidx(n) < n.K) if mask_k else col(n) < n.N

    def smask(n):
        import z3

        return z3.And(rmask(n), col(n) < n.N)

    return Spec(
        name=name, dims=("M", "N", "K"), requires=lambda n: [n.K % k_multiple == 0],
        grid=lambda n: {"pm": cdiv(n.M, BM), "pn": cdiv(n.N, BN)},
        lanes=lambda n: {"i": BM, "j": BN, "kb": cdiv(n.K, BK), "kk": BK},
        accesses=(
            Access("X", "load", lambda n: (row(n), kidx(n)), lambda n: (n.M, n.K), amask),
            Access("W", "load", lambda n: (col(n), kidx(n)), lambda n: (n.N, n.K), bmask),
            Access("Y", "store", lambda n: (row(n), col(n)), lambda n: (n.M, n.N), smask, lanes=("i", "j")),
        ),
        divides=(() if mask_k else ((f"{BK} | K", lambda n: n.K % BK == 0),)),
    )


def fp8_gemm(BM=64, BN=128, B=128, name="fp8_gemm") -> Spec:
    """The block-scaled FP8 GEMM: the weight scale read per (N tile, K slice) is the block's own
    because the K slice is the scale block's width ``B`` and the N tile lies inside one block
    (``BN`` divides ``B``: claimed, and proved from the constants)."""
    import z3

    g = gemm(name, BM=BM, BN=BN, BK=B)
    scale = Access("Scale", "load", lambda n: ((n.pn * BN) / B, (n.kb * B) / B), lambda n: (cdiv(n.N, B), cdiv(n.K, B)),
                   lambda n: z3.And(n.pm * BM + n.i < n.M))
    return Spec(name=g.name, dims=g.dims, requires=g.requires, grid=g.grid, lanes=g.lanes,
                accesses=g.accesses + (scale,), divides=((f"{BN} | {B}", lambda n: z3.IntVal(B) % BN == 0),))


def softmax(BLOCK=4096) -> Spec:
    """Wide-row softmax: chunk c of row r reads its BLOCK elements, writes its statistics at
    [r, c] (pass 1), reads all S statistics of its row and writes its elements (pass 2)."""
    import z3

    def col(n):
        return n.c * BLOCK + n.o

    return Spec(
        name="softmax_rows", dims=("R", "N"),
        grid=lambda n: {"r": n.R, "c": cdiv(n.N, BLOCK)},
        lanes=lambda n: {"o": BLOCK, "j": 64},
        requires=lambda n: [cdiv(n.N, BLOCK) <= 64],  # SB = 64 statistics lanes at most
        accesses=(
            Access("X", "load", lambda n: (n.r, col(n)), lambda n: (n.R, n.N), lambda n: col(n) < n.N),
            Access("Pstats", "store", lambda n: (n.r, n.c), lambda n: (n.R, cdiv(n.N, BLOCK)), lanes=()),
            Access("Pstats", "load", lambda n: (n.r, n.j), lambda n: (n.R, cdiv(n.N, BLOCK)),
                   lambda n: n.j < cdiv(n.N, BLOCK)),
            Access("Y", "store", lambda n: (n.r, col(n)), lambda n: (n.R, n.N), lambda n: col(n) < n.N,
                   lanes=("o",)),
        ),
    )


IDX_MIN, IDX_MAX = -(1 << 63), 1 << 63  # an index tensor's values: any int64 (int32 lies inside)


LIVE_BI = attention_tiles.LIVE_BI  # triton_attention._live_chunks: its index block


def sparse_attention(D=512, BH=16, CH=64, checked=True, name="sparse_attention") -> Spec:
    """The fused sparse attention: index loads per chunk column, pool rows read by index, the
    output per head. The indices are data of any value: the kernel reads a pool row only when
    ``0 <= idx < N`` of its pool (anything else is no candidate), so every read is in bounds for
    any index tensor. ``checked=False`` drops the ``idx < N`` test (a kernel trusting its caller),
    which the proof rejects with an index past the pool."""
    import z3

    def j(n):
        return n.c * CH + n.jj

    def h(n):
        return n.hg * BH + n.hh

    def ok(r, N):
        return z3.And(r >= 0, r < N) if checked else r >= 0

    return Spec(
        name=name, dims=("T", "H", "K0", "K1", "N0", "N1"), zero_ok=("K0", "K1", "N0", "N1"),
        requires=lambda n: [n.K0 + n.K1 >= 1],
        grid=lambda n: {"t": n.T, "hg": cdiv(n.H, BH)},
        lanes=lambda n: {"c": cdiv(n.K0 + n.K1, CH), "jj": CH, "hh": BH, "d": D, "b": cdiv(n.K1, LIVE_BI),
                         "jb": LIVE_BI},
        data=lambda n: {"r0": (IDX_MIN, IDX_MAX), "r1": (IDX_MIN, IDX_MAX)},
        accesses=(
            Access("Q", "load", lambda n: (n.t, h(n), n.d), lambda n: (n.T, n.H, D), lambda n: h(n) < n.H),
            # the live-chunk count's pass over pool 1's indices (``_live_chunks``), blocks of LIVE_BI
            Access("I1", "load", lambda n: (n.t, n.b * LIVE_BI + n.jb), lambda n: (n.T, n.K1),
                   lambda n: n.b * LIVE_BI + n.jb < n.K1),
            Access("I0", "load", lambda n: (n.t, j(n)), lambda n: (n.T, n.K0), lambda n: j(n) < n.K0),
            Access("I1", "load", lambda n: (n.t, j(n) - n.K0), lambda n: (n.T, n.K1),
                   lambda n: z3.And(j(n) >= n.K0, j(n) < n.K0 + n.K1)),
            Access("P0", "load", lambda n: (n.r0, n.d), lambda n: (n.N0, D),
                   lambda n: z3.And(j(n) < n.K0, ok(n.r0, n.N0))),
            Access("P1", "load", lambda n: (n.r1, n.d), lambda n: (n.N1, D),
                   lambda n: z3.And(j(n) >= n.K0, j(n) < n.K0 + n.K1, ok(n.r1, n.N1))),
            Access("Sink", "load", lambda n: (h(n),), lambda n: (n.H,), lambda n: h(n) < n.H),
            Access("O", "store", lambda n: (n.t, h(n), n.d), lambda n: (n.T, n.H, D), lambda n: h(n) < n.H,
                   lanes=("hh", "d")),
        ),
    )


def indexer(D=128, BH=64, BS=64, CH=1, name="indexer", fp8=False, min_width=None) -> Spec:
    """Indexer scores: program (t, ps) scores chunks c < CH of keys (ps*CH + c)*BS.. for query t over all heads; keys are
    shared [S, D], per row [T, S, D] (the larger index space of the two), or pool rows [NK, D]
    read by index (``rows [T, S]``, any value; a row is read only when ``0 <= row < NK``). ``fp8``:
    the pool holds V4's packed keys, rows of ``W`` bytes (at least the D codes and their ceil(D / 32)
    exponent bytes; ``min_width`` another bound, to show a short row is caught): a row's codes at
    [0, D), its block ``nb``'s exponent at D + nb."""
    import z3

    NB = -(-D // 32)
    least = D + NB if min_width is None else min_width

    def s_(n):
        return (n.ps * CH + n.c) * BS + n.s

    def in_pool(n):
        return z3.And(n.row >= 0, n.row < n.NK)

    pool = (Access("Pool", "load", lambda n: (n.row, n.d), lambda n: (n.NK, D), in_pool),) if not fp8 else (
        Access("Pool_codes", "load", lambda n: (n.row, n.d), lambda n: (n.NK, n.W), in_pool),
        Access("Pool_exponents", "load", lambda n: (n.row, D + n.nb), lambda n: (n.NK, n.W), in_pool))
    return Spec(
        name=name, dims=("T", "H", "S", "NK") + (("W",) if fp8 else ()),
        requires=lambda n: [n.H <= BH] + ([n.W >= least] if fp8 else []), zero_ok=("NK",),
        grid=lambda n: {"t": n.T, "ps": cdiv(n.S, BS * CH)},
        lanes=lambda n: {"h": BH, "s": BS, "d": D, "c": CH, "nb": NB},
        data=lambda n: {"row": (IDX_MIN, IDX_MAX)},
        accesses=(
            Access("Q", "load", lambda n: (n.t, n.h, n.d), lambda n: (n.T, n.H, D), lambda n: n.h < n.H),
            Access("W", "load", lambda n: (n.t, n.h), lambda n: (n.T, n.H), lambda n: n.h < n.H),
            Access("K", "load", lambda n: (n.t, s_(n), n.d), lambda n: (n.T, n.S, D), lambda n: s_(n) < n.S),
            Access("Rows", "load", lambda n: (n.t, s_(n)), lambda n: (n.T, n.S), lambda n: s_(n) < n.S),
            *pool,
            Access("Y", "store", lambda n: (n.t, s_(n)), lambda n: (n.T, n.S), lambda n: s_(n) < n.S,
                   lanes=("s", "c")),
        ),
    )


def row_mix(name: str, BJ=8, BD=1024) -> Spec:
    """weighted_pool / moe_combine / hc_read / hc_write: program (r, pd) reads the J rows of token
    r (J <= BJ lanes, masked) over channels pd*BD.. and writes channel block pd of its output; for
    moe_combine the row read in step q is a slot index computed in the kernel (data in [0, J))."""
    import z3

    def d(n):
        return n.pd * BD + n.c

    return Spec(
        name=name, dims=("R", "J", "D"), requires=lambda n: [n.J <= BJ],
        grid=lambda n: {"r": n.R, "pd": cdiv(n.D, BD)},
        lanes=lambda n: {"j": BJ, "c": BD, "k": n.J},
        data=lambda n: {"slot": (0, n.J)},
        accesses=(
            Access("In", "load", lambda n: (n.r, n.j, d(n)), lambda n: (n.R, n.J, n.D),
                   lambda n: z3.And(n.j < n.J, d(n) < n.D)),
            Access("Weights", "load", lambda n: (n.r, n.j), lambda n: (n.R, n.J), lambda n: n.j < n.J),
            Access("In_by_slot", "load", lambda n: (n.r, n.slot, d(n)), lambda n: (n.R, n.J, n.D),
                   lambda n: d(n) < n.D),
            Access("Out", "store", lambda n: (n.r, n.k, d(n)), lambda n: (n.R, n.J, n.D), lambda n: d(n) < n.D,
                   lanes=("k", "c")),
        ),
    )


ALL = {"softmax_rows": softmax, "sparse_attention": sparse_attention, "indexer_bs64": lambda: indexer(name="indexer_bs64"),
       "indexer_bs128": lambda: indexer(BS=128, name="indexer_bs128"),
       "indexer_fp8_bs128": lambda: indexer(BS=128, name="indexer_fp8_bs128", fp8=True),
       # the half-precision launch's tile (triton_gemm.INDEXER_TILE: 128 keys, two chunks a program),
       # and the same over V4's packed keys (FP8: ops/fp8_keys.py rows)
       "indexer_bs128_ch2": lambda: indexer(BS=128, CH=2, name="indexer_bs128_ch2"),
       "indexer_fp8_bs128_ch2": lambda: indexer(BS=128, CH=2, name="indexer_fp8_bs128_ch2", fp8=True),
       "row_mix": lambda: row_mix("row_mix"), "rms_norm": specs_more.rms_norm, "softmax_row": specs_more.softmax_row,
       "sparse_attention_split": specs_more.sparse_attention_split}


def tile_spec(table: str, t: dict) -> str:
    """The spec name of tile ``t`` of ``table`` (one per distinct index arithmetic)."""
    table = table.removesuffix("_GRAPH")  # the graph tables hold the same candidates
    table = "F32_TILES" if table == "F32_SKINNY_TILES" else table
    form = ("two" if t.get("two") else "grid") if t.get("grid") else "fused"
    if table == "HALF_TILES":
        return f"half_{form}_{t['BM']}x{t['BN']}x{t['BK']}" + ("_tma" if t.get("tma") else "")
    if table == "F32_TILES":
        return f"f32_{form}_{t['BM']}x{t['BN']}x{t['BK']}"
    if table in ("HC_TILES", "HC_HALF_TILES"):
        return f"hc_{form}_{t['BM']}x{t['BK']}"
    if table == "GROUPED_TILES":
        return f"grouped_table_{t['BM']}x{t['BN']}x{t['BK']}" + ("_tma" if t.get("tma") else "")
    raise ValueError(table)


def finish_spec(table: str, t: dict) -> str | None:
    """The spec name of the second launch of a ``two`` tile (``triton_slices.finish_kernel``)."""
    table = table.removesuffix("_GRAPH")
    if not (t.get("grid") and t.get("two")):
        return None
    return f"slices_finish_{t.get('fr', 4)}" + ("_rms" if table in ("HC_TILES", "HC_HALF_TILES") else "")


def _tile_builder(table: str, t: dict, name: str):
    table = table.removesuffix("_GRAPH")
    table = "F32_TILES" if table == "F32_SKINNY_TILES" else table
    g, two = t.get("grid", False), t.get("two", False)
    if table == "HALF_TILES":
        # the TMA kernels' K steps within a slice: BK | SPLIT, as the slices kernel's (grid: ``tma_grid_kernel``)
        return lambda: specs_more.slices(t["BM"], t["BN"], t["BK"], tiles.HALF_SPLIT, grid=g, two=two, name=name)
    if table == "F32_TILES":
        return lambda: specs_more.slices(t["BM"], t["BN"], t["BK"], tiles.F32_SPLIT, grid=g, two=two, name=name)
    if table in ("HC_TILES", "HC_HALF_TILES"):  # N <= 64: BN is the next power of two of N, at most 64
        return lambda: specs_more.slices(t["BM"], 64, t["BK"], tiles.F32_SPLIT, grid=g, rms=True, two=two, name=name)
    return lambda: specs_more.grouped_table(t["BM"], t["BN"], t["BK"], name=name, tma=t.get("tma", False))


for _table, _cands in tiles.CANDIDATES.items():  # every candidate tile: any of them may be chosen
    for _t in _cands:
        _n = tile_spec(_table, _t)
        ALL.setdefault(_n, _tile_builder(_table, _t, _n))
        _f = finish_spec(_table, _t)
        if _f:
            ALL.setdefault(_f, (lambda t, f: lambda: specs_more.slices_finish(t.get("fr", 4), 32, f.endswith("_rms"),
                                                                               name=f))(_t, _f))
_ATTENTION = ["sparse_attention", "sparse_attention_split"]
for _bh in attention_tiles.block_heads():  # every launch shape of the sparse attention's candidates
    if _bh != 16:
        ALL[f"sparse_attention_bh{_bh}"] = (lambda b: lambda: sparse_attention(BH=b, name=f"sparse_attention_bh{b}"))(_bh)
        ALL[f"sparse_attention_split_bh{_bh}"] = (lambda b: lambda: dataclasses.replace(
            specs_more.sparse_attention_split(BH=b), name=f"sparse_attention_split_bh{b}"))(_bh)
        _ATTENTION += [f"sparse_attention_bh{_bh}", f"sparse_attention_split_bh{_bh}"]
for _bh, _dv in attention_tiles.column_blocks():
    ALL[f"sparse_attention_cols_bh{_bh}_dv{_dv}"] = (lambda b, v: lambda: specs_more.sparse_attention_cols(BH=b, DV=v))(_bh, _dv)
    _ATTENTION.append(f"sparse_attention_cols_bh{_bh}_dv{_dv}")
for _i, (_, _t) in enumerate(tiles.FP8_TILES):
    ALL[f"fp8_gemm_{_i}"] = (lambda t, i: lambda: fp8_gemm(t["BM"], t["BN"], tiles.FP8_BLOCK, f"fp8_gemm_{i}"))(_t, _i)


def _active(*tables: str) -> list[str]:
    names = [tile_spec(tb, t) for tb in tables for _, t in getattr(tiles, tb)]
    return names + [f for tb in tables for _, t in getattr(tiles, tb) if (f := finish_spec(tb, t))]


GROUPS = {"gemm_half": _active("HALF_TILES", "F32_TILES", "HALF_TILES_GRAPH", "F32_TILES_GRAPH", "F32_SKINNY_TILES"),
          # the grouped GEMM's TMA tiles run the fallback tile where TMA's terms do not hold
          "gemm_grouped": sorted({*_active("GROUPED_TILES", "GROUPED_TILES_GRAPH"),
                                  tile_spec("GROUPED_TILES", tiles.GROUPED_FALLBACK)}),
          "hc_mix": _active("HC_TILES", "HC_HALF_TILES", "HC_TILES_GRAPH", "HC_HALF_TILES_GRAPH"),
          "fp8_gemm": [n for n in ALL if n.startswith("fp8_gemm")],
          "softmax": ["softmax_rows", "softmax_row"], "sparse_attention": _ATTENTION,
          "indexer": ["indexer_bs64", "indexer_bs128", "indexer_fp8_bs128", "indexer_bs128_ch2",
                      "indexer_fp8_bs128_ch2"]}


PROOFS = Path(__file__).with_name("proofs.json")


def source_hash() -> str:
    """Hash of the specs and the prover: a recorded proof holds for exactly these sources."""
    h = hashlib.sha256()
    for f in ("specs.py", "specs_more.py", "prove.py", "tiles.py", "attention_tiles.py"):
        h.update(Path(__file__).with_name(f).read_bytes())
    return h.hexdigest()


def record() -> dict:
    """Prove every spec and write ``proofs.json`` (run where Z3 is installed; the tests check it
    is current)."""
    for name in ALL:
        require(ALL[name]())
    rec = {"source_sha256": source_hash(), "proved": sorted(ALL)}
    PROOFS.write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def have_z3() -> bool:
    return importlib.util.find_spec("z3") is not None


def build(name: str) -> None:
    """Prove kernel ``name``'s contract (once per process) before the kernel is built; raises
    ``ContractError`` with counterexamples if it fails. Where Z3 is not installed (the GPU
    image), the proof recorded in ``proofs.json`` stands if it was made for these exact sources."""
    names = GROUPS.get(name, [name])
    if have_z3():
        for n in names:
            require(ALL[n]())
        return
    rec = json.loads(PROOFS.read_text()) if PROOFS.exists() else {}
    for n in names:
        if rec.get("source_sha256") != source_hash() or n not in rec.get("proved", ()):
            raise ContractError(n, [{"property": "unproved", "access": "",
                                     "counterexample": "z3 is not installed and no proof is recorded for these sources"}])


if __name__ == "__main__":
    print(record())
