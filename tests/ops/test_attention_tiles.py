"""The sparse attention's launch shapes (``kernels/attention_tiles``): every candidate shape gives
the same bits in Triton's interpreter on the CPU (the shapes' index arithmetic and the fixed
summation order; whether the GPU's matrix instructions round alike is measured there by
``test_attention_gpu.py`` and ``bench/attention_tiles.py``), a row alone equals the row in a batch, the bucket table refuses shapes that are not candidates, and the column-block launch's
contract proves while a store that ignores its column block is caught."""

import dataclasses
import json

import pytest
import torch

from v4stack.kernels import attention_tiles as AT

T, H, D, K = 2, 64, 256, 70  # 64 heads: BH = 64 is a real head group; D = 256: DV = 128 splits the columns


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).bfloat16()
    keys = torch.randn(T, K, D, generator=g).bfloat16()
    mask = torch.rand(T, K, generator=g) > 0.3
    mask[:, 60:] = False  # a hidden tail
    return q, keys, mask, torch.randn(H, generator=g), D ** -0.5


def _run(ta, tile, q, keys, mask, sink, scale):
    return ta.attention_with_sink(q, keys, mask, sink, scale, tiles=((1 << 62, tile),))


def test_every_candidate_shape_gives_the_reference_bits():
    ta = pytest.importorskip("v4stack.kernels.triton_attention")
    from v4stack.ops import core

    q, keys, mask, sink, scale = _case()
    ref = _run(ta, AT.CANDIDATES[0], q, keys, mask, sink, scale)
    want = core.attention_with_sink(q.double(), keys.double(), mask, sink.double(), scale)
    torch.testing.assert_close(ref.double(), want, atol=2e-2, rtol=2e-2)
    for tile in AT.CANDIDATES[1:]:
        assert torch.equal(_run(ta, tile, q, keys, mask, sink, scale).view(torch.int16), ref.view(torch.int16)), tile
    alone = _run(ta, AT.CANDIDATES[3], q[1:2], keys[1:2], mask[1:2], sink, scale)  # column blocks, one row
    assert torch.equal(alone.view(torch.int16), ref[1:2].view(torch.int16))
    # inverse control: the comparison sees a change of summation order (fp32, the candidates of
    # the first chunk reversed: the same set, other pairs in the tree and another dot order)
    f = [t.float() if t.is_floating_point() else t for t in (q, keys, mask)]
    perm = torch.cat([torch.arange(63, -1, -1), torch.arange(64, K)])
    a = _run(ta, AT.CANDIDATES[0], *f, sink, scale)
    b = _run(ta, AT.CANDIDATES[0], f[0], f[1][:, perm], f[2][:, perm], sink, scale)
    assert not torch.equal(a, b)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_pick_caps_heads_and_takes_the_bucket():
    tiles = ((8, AT.CANDIDATES[2]), (1 << 62, AT.CANDIDATES[4]))
    assert AT.pick(1, 64, tiles)["BH"] == 64 and AT.pick(1, 64, tiles)["path"] == "split"
    assert AT.pick(9, 64, tiles)["path"] == "fused" and AT.pick(10**6, 64, tiles) == dict(AT.CANDIDATES[4])
    assert AT.pick(9, 4, tiles)["BH"] == 16 and AT.pick(9, 20, tiles)["BH"] == 32  # never past the heads
    default = ((1 << 62, dict(AT.CANDIDATES[0], path=None)),)
    assert AT.pick(16, 16, default)["path"] == "split" and AT.pick(264, 16, default)["path"] == "fused"
    assert set(AT.block_heads()) >= {t["BH"] for t in AT.CANDIDATES}


def test_chosen_table_takes_only_candidates(tmp_path):
    p = tmp_path / "attention_tiles.json"
    p.write_text(json.dumps({"tiles": [[8, AT.CANDIDATES[1]], [1 << 62, AT.CANDIDATES[3]]]}))
    assert AT.load_chosen(p) == ((8, AT.CANDIDATES[1]), (1 << 62, AT.CANDIDATES[3]))
    p.write_text(json.dumps({"tiles": [[1 << 62, dict(AT.CANDIDATES[0], BH=128)]]}))
    with pytest.raises(ValueError, match="not a candidate"):
        AT.load_chosen(p)
    p.write_text(json.dumps({"tiles": [[64, AT.CANDIDATES[0]]]}))
    with pytest.raises(ValueError, match="every row count"):
        AT.load_chosen(p)
    assert AT.load_chosen(tmp_path / "absent.json") is None


def test_column_block_contract_proves_and_a_store_ignoring_the_block_is_caught():
    pytest.importorskip("z3")
    from v4stack.kernels import prove, specs_more

    good = specs_more.sparse_attention_cols(BH=64, DV=256)
    assert prove.prove(good) == []
    store = next(a for a in good.accesses if a.kind == "store")
    bad_store = dataclasses.replace(store, coords=lambda n: (n.t, n.hg * 64 + n.hh, n.e))  # column block dropped
    bad = dataclasses.replace(good, name="cols_overlap", accesses=tuple(bad_store if a is store else a
                                                                        for a in good.accesses))
    fails = prove.prove(bad)
    assert [f["property"] for f in fails] == ["disjoint"]
    assert fails[0]["counterexample"]["cb"] != fails[0]["counterexample"]["cb_b"]
