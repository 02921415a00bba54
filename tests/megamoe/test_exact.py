"""Bit-identity of the expert-parallel backends, with real gloo processes on one host.

Each rank checks its own tokens: MegaMoE == all-to-all == the single-process layer
(``tests/megamoe/reference.py``: the test's own plain-torch layer, itself checked equal to the
model's ``LocalGrouped``) bitwise, forward and backward (gradients of x, of the routing weights and
of every local expert's weights). Cases cover uniform and Zipf routing, experts that receive
nothing, a rank that sends nothing, top-2 and top-3, fp32 and bf16 activations, and FP8 dispatch
(inference) against the reference fed the same rounding.

With ``source_order`` (what the trainer uses) each rank's rows are their own expert batch: outputs
and input gradients equal the single-process layer run on that rank's tokens alone, and the
experts' weight gradients equal one process accumulating the ranks' batches in rank order.
"""

from dataclasses import dataclass

import pytest
import torch

from tests.megamoe.common import make_moe, offsets, same_grad
from tests.megamoe.reference import single_process_routed
from tests.optim.distributed import run_world
from v4stack.megamoe.backend import ExpertParallel, make_transport
from v4stack.megamoe.fp8 import FP8, pack_rows, unpack_rows
from v4stack.megamoe.routing import histogram, routing
from v4stack.model.moe import LocalGrouped

PATHS = ("megamoe", "all_to_all")


@dataclass(frozen=True)
class Case:
    counts: tuple        # tokens sent by each rank
    kind: str            # routing: uniform, zipf, subset
    topk: int = 2
    subset: int | None = None
    dtype: torch.dtype = torch.float32
    dispatch: torch.dtype | None = None


EP2 = [
    Case((9, 6), "uniform"),
    Case((12, 5), "zipf", topk=3, dtype=torch.bfloat16),
    Case((7, 0), "subset", subset=3),
    Case((6, 9), "uniform", topk=3, dtype=torch.bfloat16, dispatch=FP8),
]
EP4 = [
    Case((6, 0, 9, 4), "uniform"),
    Case((7, 5, 0, 8), "zipf", topk=3, dtype=torch.bfloat16),
    Case((5, 5, 5, 5), "subset", subset=3),          # ranks 2 and 3 own only idle experts
]
EP8 = [  # one expert per rank
    Case((3, 0, 5, 2, 7, 1, 0, 4), "uniform"),
    Case((6, 2, 0, 3, 5, 4, 1, 2), "zipf", topk=3, dtype=torch.bfloat16),
    Case((2, 2, 2, 2, 2, 2, 2, 2), "subset", subset=3),
]


def _inputs(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = sum(case.counts)
    x = torch.randn(n, 64, generator=g).to(case.dtype)
    idx, w = routing(case.kind, n, 8, case.topk, g, subset=case.subset)
    return x, idx, w


def _forward(rank, world, ci, case, transports):
    moe = make_moe(topk=case.topk, seed=ci)
    off = offsets(list(case.counts))
    mine = slice(off[rank], off[rank + 1])
    for call in range(2):  # the second call reuses the buffers with a new routing
        x, idx, w = _inputs(case, 100 * ci + call)
        if case.kind == "subset":
            assert 0 in histogram(idx, 8)  # some experts really receive nothing
        xr = unpack_rows(pack_rows(x), 64, x.dtype) if case.dispatch == FP8 else x
        with torch.no_grad():
            ref = single_process_routed(moe, xr, w, idx)[mine]
            if call == 0:  # the test's own layer is the model's layer, bit for bit
                assert torch.equal(single_process_routed(moe, xr, w, idx), LocalGrouped()(moe, xr, w, idx))
        for path in PATHS:
            be = ExpertParallel(moe, transports[path], dispatch_dtype=case.dispatch)
            with torch.no_grad():
                got = be(moe, x[mine], w[mine], idx[mine])
            assert got.dtype == torch.float32 and got.shape == (case.counts[rank], 64)
            assert torch.equal(got, ref), (case, call, path)
            if case.counts[rank]:
                assert got.abs().sum() > 0
        if case.dispatch is not None:  # lossy, and really different from the exact layer
            with torch.no_grad():
                exact = single_process_routed(moe, x, w, idx)[mine]
            assert not torch.equal(ref, exact)
            torch.testing.assert_close(ref, exact, rtol=0.1, atol=0.1)


def _backward(rank, world, ci, case, transports):
    off = offsets(list(case.counts))
    mine = slice(off[rank], off[rank + 1])
    x, idx, w = _inputs(case, 7 + ci)
    r = torch.randn(x.shape[0], 64, generator=torch.Generator().manual_seed(ci))
    ref_moe = make_moe(topk=case.topk, seed=ci)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = single_process_routed(ref_moe, xa, wa, idx)
    (out * r).sum().backward()
    per = 8 // world
    local = range(rank * per, (rank + 1) * per)
    if rank == 0:  # the test's own layer and the model's LocalGrouped: same outputs and gradients
        model_moe = make_moe(topk=case.topk, seed=ci)
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        ob = LocalGrouped()(model_moe, xb, wb, idx)
        (ob * r).sum().backward()
        assert torch.equal(ob, out) and torch.equal(xb.grad, xa.grad) and torch.equal(wb.grad, wa.grad)
        for e in range(8):
            for name in ("w1", "w2", "w3"):
                g, gr = getattr(model_moe.experts[e], name).weight.grad, getattr(ref_moe.experts[e], name).weight.grad
                assert same_grad(g, gr), (case, e, name)
    for path in PATHS:
        moe = make_moe(topk=case.topk, seed=ci)
        xm, wm = x[mine].clone().requires_grad_(), w[mine].clone().requires_grad_()
        got = ExpertParallel(moe, transports[path])(moe, xm, wm, idx[mine])
        assert torch.equal(got.detach(), out.detach()[mine]), (case, path, "forward")
        (got * r[mine]).sum().backward()
        assert torch.equal(xm.grad, xa.grad[mine]), (case, path, "dx")
        assert torch.equal(wm.grad, wa.grad[mine]), (case, path, "dw")
        for e in local:
            for name in ("w1", "w2", "w3"):
                g, gr = getattr(moe.experts[e], name).weight.grad, getattr(ref_moe.experts[e], name).weight.grad
                assert same_grad(g, gr), (case, path, e, name)
        assert xm.grad.abs().sum() > 0 or case.counts[rank] == 0
    _source_order(rank, world, ci, case, transports, x, idx, w, r)
    if case.dtype == torch.bfloat16 and world == 2:
        # control: the per-pair row gradients, added per token in expert order, give the reference's
        # bits; added in slot order (as plain per-pair code would) they do not - the order matters
        # and the equalities above see it
        n, k = idx.shape
        xp = x.repeat_interleave(k, 0).requires_grad_()
        y = single_process_routed(make_moe(topk=case.topk, seed=ci), xp, w.reshape(-1, 1), idx.reshape(-1, 1))
        (y.view(n, k, -1).sum(1) * r).sum().backward()
        order = torch.sort(idx.reshape(-1), stable=True).indices
        by_expert = torch.zeros_like(x).index_put_((order // k,), xp.grad[order], accumulate=True)
        by_slot = torch.zeros_like(x).index_put_((torch.arange(n * k) // k,), xp.grad, accumulate=True)
        assert torch.equal(by_expert, xa.grad)
        assert not torch.equal(by_slot, xa.grad)


def _source_order(rank, world, ci, case, transports, x, idx, w, r):
    off = offsets(list(case.counts))
    per = 8 // world
    # one process running each rank's tokens alone, accumulating gradients in rank order
    ref_moe = make_moe(topk=case.topk, seed=ci)
    want = []
    for s in range(world):
        sl = slice(off[s], off[s + 1])
        xs, ws = x[sl].clone().requires_grad_(), w[sl].clone().requires_grad_()
        out = single_process_routed(ref_moe, xs, ws, idx[sl])
        if out.numel():  # a rank that sends nothing adds nothing
            (out * r[sl]).sum().backward()
        want.append((out.detach(), xs.grad if out.numel() else torch.zeros_like(xs),
                     ws.grad if out.numel() else torch.zeros_like(ws)))
    mine = slice(off[rank], off[rank + 1])
    for path in PATHS:
        moe = make_moe(topk=case.topk, seed=ci)
        xm, wm = x[mine].clone().requires_grad_(), w[mine].clone().requires_grad_()
        got = ExpertParallel(moe, transports[path], source_order=True)(moe, xm, wm, idx[mine])
        (got * r[mine]).sum().backward()
        assert torch.equal(got.detach(), want[rank][0]), (case, path, "source-order forward")
        assert torch.equal(xm.grad, want[rank][1]) and torch.equal(wm.grad, want[rank][2]), (case, path)
        for e in range(rank * per, (rank + 1) * per):
            for name in ("w1", "w2", "w3"):
                g, gr = getattr(moe.experts[e], name).weight.grad, getattr(ref_moe.experts[e], name).weight.grad
                assert same_grad(g, gr), (case, path, e, name, "source order")
    # control: one batch per expert over all sources (the layer order) gives other weight gradients
    moe = make_moe(topk=case.topk, seed=ci)
    xm, wm = x[mine].clone().requires_grad_(), w[mine].clone().requires_grad_()
    (ExpertParallel(moe, transports["all_to_all"])(moe, xm, wm, idx[mine]) * r[mine]).sum().backward()
    differ = [not same_grad(getattr(moe.experts[e], n).weight.grad, getattr(ref_moe.experts[e], n).weight.grad)
              for e in range(rank * per, (rank + 1) * per) for n in ("w1", "w2", "w3")]
    if case.kind != "subset" and sum(c > 0 for c in case.counts) >= 2:
        assert any(differ), (case, "the source order is not seen")


def _world(rank, world, cases, grads):
    if world == 2:  # one set of processes also checks the shm buffers and the whole model (spawns are slow)
        from tests.megamoe.test_model import _world as model_world
        from tests.megamoe.test_serving import _world as serving_world
        from tests.megamoe.test_symm import _shm_world

        _shm_world(rank, world)
        model_world(rank, world)
        serving_world(rank, world)
    transports = {p: make_transport(p, n_experts=8, topk=3, hidden=64, max_tokens=12) for p in PATHS}
    for ci, case in enumerate(cases):
        _forward(rank, world, ci, case, transports)
        if grads and case.dispatch is None:
            _backward(rank, world, ci, case, transports)
    transports["megamoe"].close()


@pytest.mark.parametrize("world, cases", [(2, EP2), (4, EP4)], ids=["ep2", "ep4"])
def test_forward_and_gradients_bit_identical(world, cases):
    run_world(_world, world, cases, True)


@pytest.mark.slow
def test_forward_bit_identical_ep8():
    run_world(_world, 8, EP8, False)
