"""ops.grouped_linear: per-expert GEMM whose rows never depend on how many rows share an expert."""

import pytest
import torch

from v4stack import ops

E, N, K = 4, 24, 40


def _case(counts, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), K, generator=g).to(dtype)
    w = torch.randn(E, N, K, generator=g).to(dtype)
    off = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    return x, w, off


def _per_expert_f64(x, w, off):
    y = torch.empty(x.shape[0], N, dtype=torch.float64)
    for e in range(E):
        y[off[e]:off[e + 1]] = x[off[e]:off[e + 1]].double() @ w[e].double().T
    return y


def test_invariant_rows_do_not_depend_on_the_expert_batch():
    x, w, off = _case([9, 0, 17, 4])
    with ops.mode("invariant"):
        y = ops.grouped_linear(x, w, off)
        for r, e in ((0, 0), (12, 2), (26, 3)):  # one row alone under its expert
            alone = torch.zeros(E + 1, dtype=torch.long)
            alone[e + 1:] = 1
            assert torch.equal(ops.grouped_linear(x[r:r + 1], w, alone), y[r:r + 1])
        # inverse control: the same row with its K order permuted gives other bits
        p = torch.randperm(K, generator=torch.Generator().manual_seed(3))
        yp = ops.grouped_linear(x[:, p], w[:, :, p], off)
    assert not torch.equal(yp, y)
    torch.testing.assert_close(y.double(), _per_expert_f64(x, w, off), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ops.grouped_linear(x, w, off), y, atol=1e-4, rtol=1e-4)


def test_offsets_are_checked():
    x, w, off = _case([3, 3, 3, 3])
    with pytest.raises(ValueError, match="offsets must be"):
        ops.grouped_linear(x, w, off[:-1])
    with pytest.raises(ValueError, match="rise from 0"):
        ops.grouped_linear(x, w, torch.tensor([0, 5, 4, 9, 12]))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_triton_grouped_kernel_matches_float64(dtype, tol):
    tg = pytest.importorskip("v4stack.kernels.triton_grouped")
    x, w, off = _case([70, 0, 5, 1], dtype=dtype)  # an expert spanning two row tiles, an empty one
    y = tg.grouped_linear(x, w, off)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), _per_expert_f64(x, w, off), atol=tol * 8, rtol=tol)


def test_triton_grouped_gemm_rows_alone_equal_rows_in_the_batch():
    # the kernel finds each program's tile from the offsets: a row alone under its expert (a
    # one-row table) gets the bits it has in the full batch
    tgr = pytest.importorskip("v4stack.kernels.triton_grouped")
    x, w, off = _case([70, 0, 5, 1], dtype=torch.float32)
    y = tgr.grouped_linear(x, w, off)
    for r, e in ((0, 0), (69, 0), (72, 2), (75, 3)):
        alone = torch.zeros_like(off)
        alone[e + 1:] = 1
        assert torch.equal(tgr.grouped_linear(x[r:r + 1], w, alone), y[r:r + 1])


def test_tma_tiles_give_the_table_kernels_bits():
    # the persistent TMA kernel (its boxes start at a tile's first row and run into the next
    # expert's rows; W read as one [E * N, K] matrix) against the table kernel, bit for bit, on
    # uneven and empty experts (the GPU sweep checks the same at the flash4 widths)
    tgr = pytest.importorskip("v4stack.kernels.triton_grouped")
    from v4stack.kernels import tiles

    x, w, off = _case([70, 0, 5, 1], dtype=torch.bfloat16)
    ref = tgr.grouped_linear(x, w, off, tiles.GROUPED_FALLBACK)
    tma = [t for t in tiles.GROUPED_CANDIDATES if t.get("tma") and t["BK"] == tiles.GROUPED_FALLBACK["BK"]]
    assert {t["BM"] for t in tma} == {64, 128} and any(t.get("FLAT") for t in tma)
    for t in tma:
        assert torch.equal(tgr.grouped_linear(x, w, off, t), ref), t
    for r, e in ((69, 0), (72, 2)):  # a row alone under its expert: the same bits
        alone = torch.zeros_like(off)
        alone[e + 1:] = 1
        assert torch.equal(tgr.grouped_linear(x[r:r + 1], w, alone, tma[0]), ref[r:r + 1])
    # inverse control: the same products in another K order give other bits (2^24 + 63 ones, then
    # -2^24 a K step later, loses the ones in fp32; with the +-2^24 in one step they survive)
    xk = torch.zeros(76, 128)
    xk[:, 0], xk[:, 1:64], xk[:, 64] = 2.0 ** 24, 1.0, -2.0 ** 24
    wk = torch.ones(E, N, 128, dtype=torch.bfloat16)
    p = torch.arange(128)
    p[1], p[64] = 64, 1
    y, yp = (tgr.grouped_linear(a.bfloat16(), wk, off, tma[0]) for a in (xk, xk[:, p]))
    assert not torch.equal(y, yp) and (yp == 63).all()
    # fp32 (outside TMA's terms here) runs the table kernel's fallback tile
    xf, wf, offf = _case([70, 0, 5, 1])
    assert torch.equal(tgr.grouped_linear(xf, wf, offf, tma[0]), tgr.grouped_linear(xf, wf, offf, tiles.GROUPED_FALLBACK))


def test_the_shipped_grouped_tiles_were_bit_checked_at_their_buckets():
    # every bucket of GROUPED_TILES serves a tile whose rows the H200 sweep found equal to the
    # reference tile's and to rows computed alone, at every case of the bucket's rows per expert
    import json
    from pathlib import Path

    from bench import gemm_tiles as G
    from bench import grouped_tiles as GS
    from v4stack.kernels import tiles

    sweep = json.loads((Path(__file__).resolve().parents[2] / "bench/results/grouped_tiles_h200.json").read_text())
    rows = {r["M"]: r for r in GS.per_expert(sweep["grouped"])}
    section, buckets = G.BUCKETS["GROUPED_TILES"]
    assert section == "grouped_per_expert" and {m for m, _ in buckets} == set(rows)
    for m, _ in buckets:
        tile = tiles.pick(tiles.GROUPED_TILES, m)
        v = next(v for v in rows[m]["variants"] if v["tile"] == tile)
        assert G._bits_ok(v), (m, tile)
    # the pick is the sweep's, re-derived from the committed result, except the buckets the pick file
    # overrides from another measurement: each names committed results of the ops check in which the
    # call's rows equal the rows computed alone at every M, and the invariant call at M = 4096 is no
    # slower than fast mode's
    want = G.choose({"grouped_per_expert": list(rows.values())})["GROUPED_TILES"]
    results = Path(__file__).resolve().parents[2] / "bench/results"
    shipped = dict(tiles.GROUPED_TILES)
    for top, timing, invariance, why in json.loads(tiles.CHOSEN.read_text()).get("overrides", {}).get("GROUPED_TILES", []):
        assert why and top in dict(want), top
        want = [[b, shipped[top] if b == top else t] for b, t in want]
        inv = json.loads((results / invariance).read_text())["results"]["grouped_linear"]["invariant"]
        assert len(inv) > 20 and all(inv.values())
        (big,) = [r for r in json.loads((results / timing).read_text())["results"]
                  if r["op"] == "grouped_linear" and r["M"] == 4096]
        assert big["invariant_graph_s"] <= big["fast_graph_s"]
    assert want == [[top, t] for top, t in tiles.GROUPED_TILES]
    # inverse control: a variant with one case whose rows differed is refused
    bad = json.loads(json.dumps(sweep["grouped"][:1]))
    v0 = bad[0]["variants"][0]
    v0["cases"][1]["bits_equal_alone"] = False
    case = bad[0]["cases"][1]
    (g,) = [g for g in GS.per_expert(bad) if g["M"] == -(-case["rows"] // case["experts"])]
    assert not G._bits_ok(next(v for v in g["variants"] if v["tile"] == v0["tile"]))


def test_the_graph_table_is_the_serving_sweeps_pick():
    # GROUPED_TILES_GRAPH (the engine's decode calls, captured in CUDA graphs) is what the committed
    # serving sweep picks - per rows-per-expert value the bit-identical tile with the least device
    # time over one MoE layer's calls - and each of those values is served its own pick
    import json
    from pathlib import Path

    from bench import grouped_tiles as GS
    from v4stack.kernels import tiles

    sweep = json.loads((Path(__file__).resolve().parents[2] / "bench/results/grouped_serving_h200.json").read_text())
    assert sweep["serving"] and GS.choose_graph(sweep)["GROUPED_TILES_GRAPH"] == [list(b) for b in tiles.GROUPED_TILES_GRAPH]
    best = GS.best_tiles(sweep)
    for r, (tile, _) in best.items():
        assert tiles.pick(tiles.GROUPED_TILES_GRAPH, r) == tile, r
    # a layer's decode is two gate / up calls and one down call: counting the one-call gate-up form
    # instead would pick another tile at 50 rows per expert (flash4, batch 64)
    w = dict(GS.CALLS_PER_LAYER)
    try:
        GS.CALLS_PER_LAYER.update(gate_up=1, gate_up13=1)
        assert GS.best_tiles(sweep)[50][0] != best[50][0]
    finally:
        GS.CALLS_PER_LAYER.update(w)
    # inverse control: the best tile at a value, its bits marked different in one case, is not picked
    bad = json.loads(json.dumps(sweep))
    key = best[50][0]
    for row in bad["grouped"]:
        for i, case in enumerate(row["cases"]):
            if -(-case["rows"] // case["experts"]) == 50:
                next(v for v in row["variants"] if v["tile"] == key)["cases"][i]["bits_equal_alone"] = False
    assert GS.best_tiles(bad)[50][0] != key


def test_calls_captured_in_a_graph_take_the_grouped_graph_table(monkeypatch):
    from v4stack.kernels import tiles

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tiles.pick_call(tiles.GROUPED_TILES, tiles.GROUPED_TILES_GRAPH, 50, True) == tiles.pick(tiles.GROUPED_TILES_GRAPH, 50)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert tiles.pick_call(tiles.GROUPED_TILES, tiles.GROUPED_TILES_GRAPH, 50, True) == tiles.pick(tiles.GROUPED_TILES, 50)
    # the two tables differ there (what makes the query matter)
    assert tiles.pick(tiles.GROUPED_TILES, 50) != tiles.pick(tiles.GROUPED_TILES_GRAPH, 50)
    # a captured call larger than any the serving sweep measured (96 rows per expert: the graph table's
    # tile there took 2.0x torch._grouped_mm at 24576 rows over 256 experts, ops_h200.json at 06441ab)
    # takes the eager table
    import json
    from pathlib import Path

    from bench import grouped_tiles as GS

    sweep = json.loads((Path(__file__).resolve().parents[2] / "bench/results/grouped_serving_h200.json").read_text())
    cap = tiles.GRAPH_ROWS["GROUPED_TILES_GRAPH"]
    assert cap == GS.graph_rows(sweep) == 1792
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for m in (50, 96):
        assert tiles.pick_call(tiles.GROUPED_TILES, tiles.GROUPED_TILES_GRAPH, m, True, cap, cap) \
            == tiles.pick(tiles.GROUPED_TILES_GRAPH, m)
        assert tiles.pick_call(tiles.GROUPED_TILES, tiles.GROUPED_TILES_GRAPH, m, True, 24576, cap) \
            == tiles.pick(tiles.GROUPED_TILES, m)
