"""More kernel contracts as ``prove.Spec``s: RMSNorm, the one-row softmax, the split / merge
launches of the sparse attention, and the grouped GEMM's in-kernel tile table."""

from __future__ import annotations

from v4stack.kernels.prove import Access, Spec, cdiv


def rms_norm(BLOCK=4096) -> Spec:
    """RMSNorm: program r walks its row in BLOCK slices (two passes) reading X and W, storing Y."""
    def col(n):
        return n.c * BLOCK + n.o

    return Spec(
        name="rms_norm", dims=("R", "N"),
        grid=lambda n: {"r": n.R},
        lanes=lambda n: {"c": cdiv(n.N, BLOCK), "o": BLOCK},
        accesses=(
            Access("X", "load", lambda n: (n.r, col(n)), lambda n: (n.R, n.N), lambda n: col(n) < n.N),
            Access("W", "load", lambda n: (col(n),), lambda n: (n.N,), lambda n: col(n) < n.N),
            Access("Y", "store", lambda n: (n.r, col(n)), lambda n: (n.R, n.N), lambda n: col(n) < n.N,
                   lanes=("c", "o")),
        ),
    )


def softmax_row(BLOCK=4096, row_bound=None, name="softmax_row") -> Spec:
    """The one-row softmax: program r reads its whole row in one BLOCK-wide vector (the wrapper
    launches it only for N <= BLOCK: the contract) and stores it. ``row_bound`` replaces the
    column mask (to show a broken one is caught)."""
    def mask(n):
        return row_bound(n) if row_bound else n.o < n.N

    return Spec(
        name=name, dims=("R", "N"), requires=lambda n: [n.N <= BLOCK],
        grid=lambda n: {"r": n.R},
        lanes=lambda n: {"o": BLOCK},
        accesses=(
            Access("X", "load", lambda n: (n.r, n.o), lambda n: (n.R, n.N), mask),
            Access("Y", "store", lambda n: (n.r, n.o), lambda n: (n.R, n.N), mask, lanes=("o",)),
        ),
    )


def sparse_attention_split(D=512, BH=16, CH=64) -> Spec:
    """The split launch: program (t, hg, c) scores chunk c of row t and stores its statistics at
    [t, c, h] (and [t, c, h, d]); the merge program (t, hg) reads the NCH chunks of its rows in
    order and stores the output. Index reads as in the fused kernel (any value; a pool row is
    read only for 0 <= idx < N)."""
    import z3

    def j(n):
        return n.c * CH + n.jj

    def h(n):
        return n.hg * BH + n.hh

    NCH = lambda n: cdiv(n.K0 + n.K1, CH)  # noqa: E731
    return Spec(
        name="sparse_attention_split", dims=("T", "H", "K0", "K1", "N0", "N1"), zero_ok=("K0", "K1", "N0", "N1"),
        requires=lambda n: [n.K0 + n.K1 >= 1],
        grid=lambda n: {"t": n.T, "hg": cdiv(n.H, BH), "c": NCH(n)},
        lanes=lambda n: {"jj": CH, "hh": BH, "d": D, "c2": NCH(n)},
        data=lambda n: {"r0": (-(1 << 63), 1 << 63), "r1": (-(1 << 63), 1 << 63)},
        accesses=(
            Access("I0", "load", lambda n: (n.t, j(n)), lambda n: (n.T, n.K0), lambda n: j(n) < n.K0),
            Access("I1", "load", lambda n: (n.t, j(n) - n.K0), lambda n: (n.T, n.K1),
                   lambda n: z3.And(j(n) >= n.K0, j(n) < n.K0 + n.K1)),
            Access("P0", "load", lambda n: (n.r0, n.d), lambda n: (n.N0, D),
                   lambda n: z3.And(j(n) < n.K0, n.r0 >= 0, n.r0 < n.N0)),
            Access("P1", "load", lambda n: (n.r1, n.d), lambda n: (n.N1, D),
                   lambda n: z3.And(j(n) >= n.K0, j(n) < n.K0 + n.K1, n.r1 >= 0, n.r1 < n.N1)),
            Access("Pm", "store", lambda n: (n.t, n.c, h(n)), lambda n: (n.T, NCH(n), n.H), lambda n: h(n) < n.H,
                   lanes=("hh",)),
            Access("Pa", "store", lambda n: (n.t, n.c, h(n), n.d), lambda n: (n.T, NCH(n), n.H, D),
                   lambda n: h(n) < n.H, lanes=("hh", "d")),
            Access("Pa", "load", lambda n: (n.t, n.c2, h(n), n.d), lambda n: (n.T, NCH(n), n.H, D),
                   lambda n: h(n) < n.H),
        ),
    )


def grouped_table(BM=64, BN=128, BK=64, EB=256, name="grouped_table", tma=False) -> Spec:
    """The grouped GEMM with its tile table in the kernel. Program (p, pn) finds expert ``e`` and
    its tile ``j`` within the expert: data that follow from the tile prefix sum (``0 <= j <
    ceil(n_e / BM)``), with the expert's row range ``[lo, hi)`` from the offsets (the contract:
    offsets rise from 0 to T, so different experts' ranges do not overlap - ``relate``). Also
    claimed and proved: ``min(E, T) + T // BM`` programs are enough (per expert ``ceil(n / BM) <=
    n // BM + 1`` for n > 0, and floors add up to at most the floor of the sum).

    ``tma``: the persistent TMA kernel (``triton_grouped_tma``). Its programs walk the same output
    tiles (row tile, column tile) - each once, ``t -> (t % tiles, t // tiles)`` - so the tile is the
    unit here; X and W are read by TMA boxes, which the hardware clips to the tensor (a box row past
    the expert's end reads the next expert's row or, past T, zeros: the load's mask is the tensor's
    bounds), W as one ``[E * N, K]`` matrix from row ``e * N + n * BN``; stores are masked as in
    the table kernel."""
    import z3

    def row(n):
        return n.lo + n.j * BM + n.i

    def col(n):
        return n.pn * BN + n.jc

    def kidx(n):
        return n.kb * BK + n.kk

    def relate(a, b):
        same = a.e == b.e
        return [z3.If(same, z3.And(a.lo == b.lo, a.hi == b.hi, a.p - a.j == b.p - b.j),
                      z3.If(a.e < b.e, a.hi <= b.lo, b.hi <= a.lo))]

    return Spec(
        name=name, dims=("T", "E", "N", "K", "n1", "n2"), zero_ok=("n1", "n2"),
        requires=lambda n: [n.E <= EB, n.n1 + n.n2 <= n.T],
        grid=lambda n: {"p": z3.If(n.E < n.T, n.E, n.T) + n.T / BM, "pn": cdiv(n.N, BN)},
        lanes=lambda n: {"i": BM, "jc": BN, "kb": cdiv(n.K, BK), "kk": BK, "le": EB},
        data=lambda n: {"e": (0, n.E), "lo": (0, n.T + 1), "hi": (0, n.T + 1), "j": (0, n.T + 1)},
        relate=relate, program_data=("e", "j"),
        requires_data=lambda n: [n.lo <= n.hi, n.j < cdiv(n.hi - n.lo, BM)],
        accesses=(
            Access("Off", "load", lambda n: (n.le,), lambda n: (n.E + 1,), lambda n: n.le < n.E),
            Access("Off", "load", lambda n: (n.le + 1,), lambda n: (n.E + 1,), lambda n: n.le < n.E),
            Access("X", "load", lambda n: (row(n), kidx(n)), lambda n: (n.T, n.K),
                   lambda n: z3.And(row(n) < (n.T if tma else n.hi), kidx(n) < n.K)),
            Access("W", "load", lambda n: (n.e, col(n), kidx(n)), lambda n: (n.E, n.N, n.K),
                   lambda n: z3.And(col(n) < n.N, kidx(n) < n.K)) if not tma else
            Access("W", "load", lambda n: (n.e * n.N + col(n), kidx(n)), lambda n: (n.E * n.N, n.K),
                   lambda n: z3.And(n.e * n.N + col(n) < n.E * n.N, kidx(n) < n.K)),
            Access("Y", "store", lambda n: (row(n), col(n)), lambda n: (n.T, n.N),
                   lambda n: z3.And(row(n) < n.hi, col(n) < n.N), lanes=("i", "jc")),
        ),
        divides=(("ceil(n/BM) <= n//BM + 1 (n > 0)",
                  lambda n: z3.Implies(n.n1 > 0, cdiv(n.n1, BM) <= n.n1 / BM + 1)),
                 ("n1//BM + n2//BM <= (n1+n2)//BM", lambda n: n.n1 / BM + n.n2 / BM <= (n.n1 + n.n2) / BM)),
    )


def sparse_attention_cols(D=512, BH=64, DV=256, CH=64, name=None) -> Spec:
    """The fused sparse attention with column blocks: program (t, hg, cb) scores its heads'
    chunks over the full head width ``D`` and computes output columns ``[cb * DV, cb * DV + DV)``
    only (``D // DV`` programs per head group), reading those columns of the candidate rows again
    for ``p @ v``. Index reads as in the fused kernel (any value; a pool row is read only for
    ``0 <= idx < N``); the column blocks store disjoint parts of a row's output."""
    import z3

    def j(n):
        return n.c * CH + n.jj

    def h(n):
        return n.hg * BH + n.hh

    def col(n):
        return n.cb * DV + n.e

    def pools(d):
        return (Access("P0", "load", lambda n: (n.r0, d(n)), lambda n: (n.N0, D),
                       lambda n: z3.And(j(n) < n.K0, n.r0 >= 0, n.r0 < n.N0)),
                Access("P1", "load", lambda n: (n.r1, d(n)), lambda n: (n.N1, D),
                       lambda n: z3.And(j(n) >= n.K0, j(n) < n.K0 + n.K1, n.r1 >= 0, n.r1 < n.N1)))

    return Spec(
        name=name or f"sparse_attention_cols_bh{BH}_dv{DV}", dims=("T", "H", "K0", "K1", "N0", "N1"),
        zero_ok=("K0", "K1", "N0", "N1"), requires=lambda n: [n.K0 + n.K1 >= 1],
        grid=lambda n: {"t": n.T, "hg": cdiv(n.H, BH), "cb": D // DV},
        lanes=lambda n: {"c": cdiv(n.K0 + n.K1, CH), "jj": CH, "hh": BH, "d": D, "e": DV},
        data=lambda n: {"r0": (-(1 << 63), 1 << 63), "r1": (-(1 << 63), 1 << 63)},
        accesses=(
            Access("Q", "load", lambda n: (n.t, h(n), n.d), lambda n: (n.T, n.H, D), lambda n: h(n) < n.H),
            Access("I0", "load", lambda n: (n.t, j(n)), lambda n: (n.T, n.K0), lambda n: j(n) < n.K0),
            Access("I1", "load", lambda n: (n.t, j(n) - n.K0), lambda n: (n.T, n.K1),
                   lambda n: z3.And(j(n) >= n.K0, j(n) < n.K0 + n.K1)),
            *pools(lambda n: n.d),  # the scores' full-width read
            *pools(col),  # this block's columns again, for p @ v
            Access("Sink", "load", lambda n: (h(n),), lambda n: (n.H,), lambda n: h(n) < n.H),
            Access("O", "store", lambda n: (n.t, h(n), col(n)), lambda n: (n.T, n.H, D), lambda n: h(n) < n.H,
                   lanes=("hh", "e")),
        ),
        divides=((f"DV = {DV} divides D = {D}", lambda n: z3.BoolVal(D % DV == 0)),),
    )


def slices(BM=64, BN=64, BK=64, SPLIT=2048, grid=False, rms=False, counters=1 << 16, slice_end=True,
           slice_index=True, two=False, name="slices") -> Spec:
    """The fixed-K-slice GEMM (``triton_slices.slices_kernel``). Slice ``s`` covers K in
    ``[s SPLIT, min(s SPLIT + SPLIT, K))``. Fused: program (pm, pn) walks the slices (lane s)
    and stores Y once. Grid: program (pm, pn, s) stores its slice's partial at ``P[s, row, col]``
    (``PSS[s, row]`` with ``rms``), counts its arrival at ``CNT[pm * ceil(N / BN) + pn]`` and, if
    last (``s == last``: one value per tile, ``relate``), reads the S partials and stores Y.
    ``rms`` needs one N tile (``N <= BN``: else two N tiles would store the same ``PSS``).
    ``slice_end=False`` drops the slice end's cut at K, ``slice_index=False`` stores every slice's
    partial at ``P[row, col]`` (broken variants the proof must reject). ``two``: the grid form whose
    partials ``slices_finish`` adds (no counters, no Y store here)."""
    import z3

    S = lambda n: cdiv(n.K, SPLIT)  # noqa: E731
    GN = lambda n: cdiv(n.N, BN)  # noqa: E731

    def row(n):
        return n.pm * BM + n.i

    def col(n):
        return n.pn * BN + n.j

    def k(n):
        return n.s * SPLIT + n.kb * BK + n.kk

    def kend(n):
        return z3.If(n.s * SPLIT + SPLIT < n.K, n.s * SPLIT + SPLIT, n.K) if slice_end else n.s * SPLIT + SPLIT

    def out(n):
        return z3.And(row(n) < n.M, col(n) < n.N)

    loads = (Access("X", "load", lambda n: (row(n), k(n)), lambda n: (n.M, n.K), lambda n: z3.And(row(n) < n.M,
                                                                                                  k(n) < kend(n))),
             Access("W", "load", lambda n: (col(n), k(n)), lambda n: (n.N, n.K), lambda n: z3.And(col(n) < n.N,
                                                                                                  k(n) < kend(n))))
    req = (lambda n: [n.N <= BN]) if rms else (lambda n: [])
    lanes = {"i": BM, "j": BN, "kb": cdiv(SPLIT, BK), "kk": BK}
    divides = ((f"{BK} | {SPLIT}", lambda n: z3.IntVal(SPLIT) % BK == 0),)
    if not grid:
        acc = loads + (Access("Y", "store", lambda n: (row(n), col(n)), lambda n: (n.M, n.N), out, lanes=("i", "j")),)
        return Spec(name=name, dims=("M", "N", "K"), requires=req, grid=lambda n: {"pm": cdiv(n.M, BM), "pn": GN(n)},
                    lanes=lambda n: {**lanes, "s": S(n)}, accesses=acc, divides=divides)
    pidx = (lambda n: (n.s, row(n), col(n))) if slice_index else (lambda n: (row(n), col(n)))
    pshape = (lambda n: (S(n), n.M, n.N)) if slice_index else (lambda n: (n.M, n.N))
    pss = (Access("PSS", "store", lambda n: (n.s, row(n)), lambda n: (S(n), n.M), lambda n: row(n) < n.M,
                  lanes=("i",)),) if rms else ()
    if two:
        return Spec(name=name, dims=("M", "N", "K"), requires=req,
                    grid=lambda n: {"pm": cdiv(n.M, BM), "pn": GN(n), "s": S(n)}, lanes=lambda n: lanes,
                    accesses=loads + (Access("P", "store", pidx, pshape, out, lanes=("i", "j")),) + pss,
                    divides=divides)
    acc = loads + (
        Access("P", "store", pidx, pshape, out, lanes=("i", "j")),
        Access("CNT", "load", lambda n: (n.pm * GN(n) + n.pn,), lambda n: (counters,)),
        Access("P", "load", lambda n: (n.s2, row(n), col(n)), lambda n: (S(n), n.M, n.N), out),
        Access("Y", "store", lambda n: (row(n), col(n)), lambda n: (n.M, n.N),
               lambda n: z3.And(out(n), n.s == n.last), lanes=("i", "j")),
    )
    if rms:
        acc += pss + (Access("PSS", "load", lambda n: (n.s2, row(n)), lambda n: (S(n), n.M), lambda n: row(n) < n.M),)
    return Spec(
        name=name, dims=("M", "N", "K"),
        requires=lambda n: req(n) + [cdiv(n.M, BM) * GN(n) <= counters],
        grid=lambda n: {"pm": cdiv(n.M, BM), "pn": GN(n), "s": S(n)},
        lanes=lambda n: {**lanes, "s2": S(n)}, data=lambda n: {"last": (0, S(n))},
        relate=lambda a, b: [z3.Implies(z3.And(a.pm == b.pm, a.pn == b.pn), a.last == b.last)],
        accesses=acc, divides=divides)


def slices_finish(FR=4, BN=32, rms=False, name="slices_finish") -> Spec:
    """``triton_slices.finish_kernel``: program (pm, pn) reads the S partials ``P[s, row, col]`` of
    FR rows x BN columns (``PSS[s, row]`` with ``rms``) and stores those elements of Y once."""
    import z3

    def row(n):
        return n.pm * FR + n.i

    def col(n):
        return n.pn * BN + n.j

    def out(n):
        return z3.And(row(n) < n.M, col(n) < n.N)

    acc = (Access("P", "load", lambda n: (n.s2, row(n), col(n)), lambda n: (n.S, n.M, n.N), out),
           Access("Y", "store", lambda n: (row(n), col(n)), lambda n: (n.M, n.N), out, lanes=("i", "j")))
    if rms:
        acc += (Access("PSS", "load", lambda n: (n.s2, row(n)), lambda n: (n.S, n.M), lambda n: row(n) < n.M),)
    return Spec(name=name, dims=("M", "N", "S"), grid=lambda n: {"pm": cdiv(n.M, FR), "pn": cdiv(n.N, BN)},
                lanes=lambda n: {"i": FR, "j": BN, "s2": n.S}, accesses=acc)
