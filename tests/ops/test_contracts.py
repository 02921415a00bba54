"""Kernel contracts proved with Z3 (CPU, no GPU): the kernels' specs prove; an off-by-one bound
and a tile that does not divide are rejected with a counterexample shape."""

import pytest

pytest.importorskip("z3")

from v4stack.kernels import prove, specs  # noqa: E402


@pytest.mark.parametrize("name", list(specs.ALL))
def test_kernel_contracts_prove(name):
    assert prove.prove(specs.ALL[name]()) == []


def test_off_by_one_row_bound_is_rejected_with_a_counterexample():
    bad = specs.gemm("gemm_off_by_one", row_bound=lambda n: n.pm * 64 + n.i <= n.M)
    with pytest.raises(prove.ContractError, match="bounds load X") as e:
        prove.require(bad)
    cex = {f["access"]: f["counterexample"] for f in e.value.failures}
    x = cex["load X"]
    assert x["pm"] * 64 + x["i"] == x["M"]  # the row one past the end
    assert "store Y" in cex


def test_non_dividing_tile_is_rejected_with_a_counterexample():
    # K loads without a mask need BK | K; a contract promising only K % 32 == 0 with BK = 64 fails
    failures = prove.prove(specs.gemm("gemm_k32", mask_k=False, k_multiple=32))
    div = [f for f in failures if f["property"] == "divides"]
    assert div and div[0]["counterexample"]["K"] % 64 != 0 and div[0]["counterexample"]["K"] % 32 == 0
    assert any(f["access"] == "load X" for f in failures)
    # the same kernel under a contract that makes the tile divide proves
    assert prove.prove(specs.gemm("gemm_k64", mask_k=False, k_multiple=64)) == []


def test_overlapping_writes_are_found():
    # a store that ignores its column lane: two lanes write one element
    g = specs.gemm()
    bad = prove.Spec(name="gemm_overlap", dims=g.dims, requires=g.requires, grid=g.grid, lanes=g.lanes,
                     accesses=(prove.Access("Y", "store", lambda n: (n.pm * 64 + n.i, n.pn * 128),
                                            lambda n: (n.M, n.N), lambda n: n.pm * 64 + n.i < n.M,
                                            lanes=("i", "j")),))
    (f,) = prove.prove(bad)
    assert f["property"] == "disjoint"


def test_recorded_proofs_are_for_the_current_specs():
    # the GPU image has no Z3: there a kernel's build accepts the proof recorded for these exact
    # sources (python -m v4stack.kernels.specs rewrites it)
    import json

    rec = json.loads(specs.PROOFS.read_text())
    assert rec["source_sha256"] == specs.source_hash(), "run: python -m v4stack.kernels.specs"
    assert rec["proved"] == sorted(specs.ALL)


def test_without_z3_a_build_takes_only_a_proof_recorded_for_these_sources(monkeypatch, tmp_path):
    import json

    monkeypatch.setattr(specs, "have_z3", lambda: False)
    specs.build("sparse_attention")  # the recorded proof matches
    specs.build("gemm_half")  # a group: every tile bucket's proof
    stale = tmp_path / "proofs.json"
    stale.write_text(json.dumps({"source_sha256": "0" * 64, "proved": sorted(specs.ALL)}))
    monkeypatch.setattr(specs, "PROOFS", stale)
    with pytest.raises(prove.ContractError, match="no proof is recorded"):
        specs.build("sparse_attention")


def test_a_pool_read_without_its_index_bound_is_rejected():
    # the sparse attention reads a pool row only for 0 <= idx < N; trusting the caller (idx >= 0
    # only) fails with an index at or past the pool's rows
    failures = prove.prove(specs.sparse_attention(checked=False, name="sparse_attention_unchecked"))
    assert {f["access"] for f in failures} == {"load P0", "load P1"}
    cex = next(f["counterexample"] for f in failures if f["access"] == "load P0")
    assert cex["r0"] >= cex["N0"] >= 0


def test_one_row_softmax_with_an_off_by_one_mask_is_rejected():
    from v4stack.kernels import specs_more

    failures = prove.prove(specs_more.softmax_row(row_bound=lambda n: n.o <= n.N, name="softmax_row_off_by_one"))
    cex = {f["access"]: f["counterexample"] for f in failures}
    assert cex["load X"]["o"] == cex["load X"]["N"]  # the column one past the row


def test_grouped_tile_table_needs_the_offsets_order():
    # without "offsets rise" (two experts' row ranges may overlap) two programs store one row
    import dataclasses

    from v4stack.kernels import specs_more

    g = specs_more.grouped_table()
    failures = prove.prove(dataclasses.replace(g, name="grouped_unordered", relate=lambda a, b: []))
    assert [(f["property"], f["access"]) for f in failures] == [("disjoint", "store Y")]
    cex = failures[0]["counterexample"]
    # two programs store the same row (each program's values are in the counterexample, the second as x_b)
    assert cex["lo"] + cex["j"] * 64 + cex["i"] == cex["lo_b"] + cex["j_b"] * 64 + cex["i_b"]
    assert prove.prove(g) == []  # with it, the same kernel proves


def test_a_chosen_tile_must_be_a_proved_candidate(tmp_path):
    import json

    from v4stack.kernels import tiles

    ok = {"tables": {"HALF_TILES": [[64, tiles.HALF_CANDIDATES[1]], [1 << 62, tiles.HALF_CANDIDATES[6]]]}}
    (tmp_path / "ok.json").write_text(json.dumps(ok))
    assert tiles.load_chosen(tmp_path / "ok.json")["HALF_TILES"][1][1]["tma"] is True
    bad = {"tables": {"HALF_TILES": [[1 << 62, dict(tiles.HALF_CANDIDATES[0], BK=32)]]}}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="not a candidate"):
        tiles.load_chosen(tmp_path / "bad.json")
    # every tile in use has its contract among the proved specs
    assert all(n in specs.ALL for g in ("gemm_half", "gemm_grouped", "hc_mix") for n in specs.GROUPS[g])


def test_fixed_slice_gemm_contracts_reject_broken_variants():
    from v4stack.kernels import specs_more

    # a slice that runs SPLIT past its start without the cut at K reads past the end of X and W
    f = prove.prove(specs_more.slices(64, 64, 64, 128, grid=True, slice_end=False, name="no_cut"))
    cex = {x["access"]: x["counterexample"] for x in f if x["property"] == "bounds"}
    x = cex["load X"]
    assert x["s"] * 128 + x["kb"] * 64 + x["kk"] >= x["K"]
    # partials stored without their slice index: two slices of one tile write one element
    f = prove.prove(specs_more.slices(64, 64, 64, 128, grid=True, slice_index=False, name="no_index"))
    (d,) = [x for x in f if x["property"] == "disjoint"]
    assert d["access"] == "store P" and d["counterexample"]["s"] != d["counterexample"]["s_b"]
    # hc_mix's row sums of squares with two N tiles: both tiles store PSS[s, row]
    good = specs_more.slices(64, 32, 32, 128, grid=True, rms=True, name="rms")
    assert prove.prove(good) == []
    two_tiles = prove.Spec(name="rms_two_tiles", dims=good.dims, grid=good.grid, lanes=good.lanes,
                           accesses=good.accesses, data=good.data, relate=good.relate, divides=good.divides,
                           requires=lambda n: [prove.cdiv(n.M, 64) * prove.cdiv(n.N, 32) <= 1 << 16])
    (d,) = prove.prove(two_tiles)
    assert d["access"] == "store PSS" and d["counterexample"]["pn"] != d["counterexample"]["pn_b"]


def test_indexer_chunks_need_their_own_stride():
    # a program scores CH chunks of BS keys at (ps * CH + c) * BS: a chunk index written ps + c
    # (the chunk count left out) has two programs write the same scores
    import dataclasses

    good = specs.indexer(BS=128, CH=2, name="indexer_chunks")
    assert prove.prove(good) == []

    def s_(n):
        return (n.ps + n.c) * 128 + n.s

    y = prove.Access("Y", "store", lambda n: (n.t, s_(n)), lambda n: (n.T, n.S), lambda n: s_(n) < n.S,
                     lanes=("s", "c"))
    bad = dataclasses.replace(good, name="indexer_chunks_bad_stride",
                              accesses=tuple(a for a in good.accesses if a.tensor != "Y") + (y,))
    assert any(f["property"] == "disjoint" for f in prove.prove(bad))


def test_a_packed_key_row_without_room_for_its_exponents_is_rejected():
    # V4's packed indexer keys: D codes then ceil(D / 32) exponent bytes a row; a contract that
    # promises only the codes' D bytes lets the exponent loads run past the row
    failures = prove.prove(specs.indexer(BS=128, name="indexer_fp8_short", fp8=True, min_width=128))
    assert any(f["access"] == "load Pool_exponents" for f in failures)
    assert prove.prove(specs.indexer(BS=128, name="indexer_fp8_ok", fp8=True)) == []
