"""Bit-identity of the expert-parallel paths, with real gloo processes on one host.

For every case, each rank checks its own tokens: MegaMoE == all-to-all baseline == the
single-process layer (``reference_routed``, the documented order) bitwise; BF16 dispatch, fp32
combine. Cases cover random and Zipf-skewed routing, experts that receive no tokens, a rank
that sends nothing, top-2 and top-3, per-row and per-tile GEMMs, and rings small enough that
back-pressure and streamed waves happen.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from tests.megamoe.common import make_moe, offsets
from v4stack import ops
from tests.optim.distributed import run_world
from v4stack.megamoe import AllToAllMoE, ExpertShard, MegaMoE, reference_moe, reference_routed
from v4stack.megamoe.layer import ExpertParallelMoE
from v4stack.megamoe.routing import histogram, routing


@dataclass(frozen=True)
class Case:
    counts: tuple        # tokens sent by each rank
    kind: str            # routing: uniform, zipf, subset
    topk: int = 2
    gemm: str = "row"
    tile: int = 4
    ring: int = 3
    subset: int | None = None
    dispatch: torch.dtype = torch.bfloat16
    combine: torch.dtype = torch.float32


EP2 = [
    Case((9, 6), "uniform"),
    Case((12, 5), "zipf", topk=3, gemm="tile"),
    Case((7, 0), "subset", ring=2, subset=3),
    # lossy options: FP8 dispatch (per-128 scales) and BF16 combine, still one fixed rounding
    Case((6, 9), "uniform", topk=3, gemm="tile", dispatch=torch.float8_e4m3fn, combine=torch.bfloat16),
]
EP4 = [
    Case((6, 0, 9, 4), "uniform"),
    Case((7, 5, 0, 8), "zipf", topk=3, ring=2),
    Case((5, 5, 5, 5), "subset", subset=3),          # ranks 2 and 3 own only idle experts
    Case((10, 3, 4, 0), "zipf", gemm="tile", tile=2),
]


def _inputs(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = sum(case.counts)
    x = torch.randn(n, 64, generator=g).to(torch.bfloat16)
    idx, w = routing(case.kind, n, 8, case.topk, g, subset=case.subset)
    return x, idx, w


def _cases_world(rank, world, cases):
    if world == 2:  # one set of processes also runs the layer and error checks (spawns are slow)
        _errors(rank, world)
        _layer_world(rank, world)
    for ci, case in enumerate(cases):
        moe = make_moe(topk=case.topk, seed=ci)
        off = offsets(list(case.counts))
        mine = slice(off[rank], off[rank + 1])
        shard = ExpertShard.from_moe(moe, rank, world, tile=case.tile, gemm=case.gemm)
        opts = dict(dispatch_dtype=case.dispatch, combine_dtype=case.combine)
        mega = MegaMoE(shard, max_tokens=max(case.counts), ring_tiles=case.ring, **opts)
        base = AllToAllMoE(shard, **opts)
        for call in range(2):  # the second call reuses the symmetric buffers with a new routing
            x, idx, w = _inputs(case, seed=100 * ci + call)
            if case.kind == "subset":
                assert 0 in histogram(idx, 8)  # some experts really receive nothing
            got = mega(x[mine], idx[mine], w[mine])
            ref = reference_routed(moe, x, idx, w, tile=case.tile, gemm=case.gemm, **opts)[mine]
            assert torch.equal(got, base(x[mine], idx[mine], w[mine])), (case, call, "baseline")
            assert torch.equal(got, ref), (case, call, "single-process")
            assert got.dtype == torch.float32 and got.shape == (case.counts[rank], 64)
            if case.counts[rank]:
                assert got.abs().sum() > 0
            assert mega.last.ring_peak <= case.ring
            if case.dispatch != torch.bfloat16 or case.combine != torch.float32:  # lossy, but close
                exact = reference_routed(moe, x, idx, w, tile=case.tile, gemm=case.gemm)[mine]
                assert not torch.equal(got, exact)
                torch.testing.assert_close(got, exact, rtol=0.1, atol=0.1)
        mega.close()


EP8 = [  # one expert per rank: the EP8 layout of the multi-GPU runs, exact on CPU processes
    Case((3, 0, 5, 2, 7, 1, 0, 4), "uniform"),
    Case((6, 2, 0, 3, 5, 4, 1, 2), "zipf", topk=3, gemm="tile"),
    Case((2, 2, 2, 2, 2, 2, 2, 2), "subset", subset=3),  # five ranks own only idle experts
]


@pytest.mark.parametrize("world, cases", [(2, EP2), (4, EP4)], ids=["ep2", "ep4"])
def test_megamoe_bit_identical(world, cases):
    run_world(_cases_world, world, cases)


@pytest.mark.slow
def test_megamoe_bit_identical_ep8():
    run_world(_cases_world, 8, EP8)


def _layer_world(rank, world):
    for path in ("megamoe", "baseline"):
        _layer_path(rank, world, path)


def _layer_path(rank, world, path):
    """The model's layer (gate on local tokens + shared expert) expert-parallel vs one process
    (runs inside test_megamoe_bit_identical[ep2])."""
    moe = make_moe(topk=2, seed=7)
    counts = [5, 0, 8, 3][:world] if world > 2 else [5, 0]
    off = offsets(counts)
    g = torch.Generator().manual_seed(3)
    x_all = torch.randn(off[-1], 64, generator=g).to(torch.bfloat16)
    ids = torch.zeros(off[-1], dtype=torch.long)
    layer = ExpertParallelMoE(moe, path=path, max_tokens=8, tile=4, ring_tiles=2)
    mine = slice(off[rank], off[rank + 1])
    out = layer(x_all[mine], ids[mine])
    # the gate ran on this rank's tokens; the reference uses exactly that routing
    idx, w = moe.gate(x_all[mine], ids[mine])
    parts = [None] * world
    dist.all_gather_object(parts, (idx, w))
    idx_all, w_all = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    ref = reference_moe(moe, x_all, idx_all, w_all, tile=4)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref[mine])
    # same math as the model's own layer (in fast mode its GEMMs batch differently: close, not bitwise)
    model = moe.combine(x_all, idx_all, w_all)
    torch.testing.assert_close(ref.float(), model.float(), rtol=1e-2, atol=1e-2)


def _invariant_world(rank, world):
    """In the ops' invariant mode the expert-parallel layer equals the model's own MoE layer."""
    with ops.mode("invariant"):
        moe = make_moe(topk=3, seed=11)
        counts = [6, 3]
        off = offsets(counts)
        g = torch.Generator().manual_seed(5)
        x_all = torch.randn(off[-1], 64, generator=g).to(torch.bfloat16)
        ids = torch.zeros(off[-1], dtype=torch.long)
        mine = slice(off[rank], off[rank + 1])
        idx, w = moe.gate(x_all[mine], ids[mine])
        parts = [None] * world
        dist.all_gather_object(parts, (idx, w))
        idx_all, w_all = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        model = moe.combine(x_all, idx_all, w_all)
        for path in ("megamoe", "baseline"):
            layer = ExpertParallelMoE(moe, path=path, max_tokens=8, tile=4, gemm="tile", ring_tiles=2)
            assert torch.equal(layer.apply(x_all[mine], idx, w), model[mine]), path


@pytest.mark.skipif(not hasattr(ops, "mode"), reason="ops has no invariant mode yet")
def test_equals_model_layer_in_invariant_mode():
    run_world(_invariant_world, 2)


def _errors(rank, world):
    moe = make_moe()
    shard = ExpertShard.from_moe(moe, rank, world)
    mega = MegaMoE(shard, max_tokens=2)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    idx = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="max_tokens"):
        mega(x, idx, idx.float())
    with pytest.raises(ValueError, match="idx"):
        mega(x[:2], idx[:2, :1], idx[:2, :1].float())
    with pytest.raises(ValueError, match="ring_tiles"):
        MegaMoE(shard, max_tokens=2, ring_tiles=1)
    mega.close()


def test_errors_name_the_field():  # the distributed ones run inside test_megamoe_bit_identical[ep2]
    with pytest.raises(ValueError, match="n_routed_experts"):
        ExpertShard.from_moe(make_moe(), 0, 3)
    with pytest.raises(ValueError, match="gemm"):
        ExpertShard.from_moe(make_moe(), 0, 1, gemm="fast")
