"""The expert-parallel backends on GPUs (one rank per GPU, up to two; ``cpu:gloo,cuda:nccl``).

- Inference: MegaMoE's device-side pipeline == the all-to-all baseline with the same grouped
  kernels, bitwise, with BF16 and with FP8 dispatch, over two calls with new routings (buffer reuse)
  and a rank that sends nothing; both close to the single-process layer (fp32 math).
- Training: gradients through both backends on CUDA equal the single-process layer's bitwise.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.megamoe.common import make_moe, offsets, same_grad
from tests.megamoe.reference import single_process_routed
from tests.optim.distributed import free_port
from v4stack.megamoe.backend import ExpertParallel, make_transport
from v4stack.megamoe.experts import LocalExperts
from v4stack.megamoe.fp8 import FP8
from v4stack.megamoe.pipeline import DevicePipeline
from v4stack.megamoe.routing import routing


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _inference(rank, world, dev):
    moe = make_moe(topk=3, seed=5).to(dev)
    ex = LocalExperts(moe, rank, world)
    a2a = make_transport("all_to_all", n_experts=8, topk=3, hidden=64, max_tokens=64, device=dev)
    for dd, per_wave in ((torch.bfloat16, None), (torch.bfloat16, 1), (FP8, None), (FP8, 1)):
        # one expert per wave: more waves than ring slots, so slots are reused behind back-pressure
        pipe = DevicePipeline(ex, max_tokens=64, device=dev, dispatch_dtype=dd, wave_experts=per_wave)
        base = ExpertParallel(moe, a2a, dispatch_dtype=dd)
        assert base.kernels
        for call, (kind, counts) in enumerate((("uniform", [37, 21]), ("zipf", [45, 0]), ("uniform", [1, 3]))):
            counts = counts[:world] if world > 1 else [counts[0]]
            off = offsets(counts)
            mine = slice(off[rank], off[rank + 1])
            g = torch.Generator().manual_seed(call)
            x = torch.randn(off[-1], 64, generator=g).to(torch.bfloat16).to(dev)
            idx, w = routing(kind, off[-1], 8, 3, g)
            idx, w = idx.to(dev), w.to(dev)
            pipe.ring_x.fill_(float("nan"))  # stale ring rows must never be read
            got = pipe(x[mine], w[mine], idx[mine])
            ref_base = base.infer(x[mine], w[mine], idx[mine])
            assert got.is_cuda and got.shape == (counts[rank], 64)
            assert len(pipe.last_waves) == (8 // world if per_wave else 1)
            assert torch.equal(got, ref_base), (dd, call, "baseline")
            with torch.no_grad():
                ref = single_process_routed(moe, x.float(), w, idx)[mine]
            if counts[rank]:
                assert _rel(got, ref) < (0.08 if dd == FP8 else 0.03), (dd, call, _rel(got, ref))
            if per_wave and call == 0:  # the same call replayed from a CUDA graph
                run = pipe.graphed(counts[rank], peer_tokens=max(counts))
                assert torch.equal(run(x[mine], w[mine], idx[mine]).clone(), got), (dd, "graph")
                del run
        pipe.close()


def _gradients(rank, world, dev):
    counts = [9, 6][:world] if world > 1 else [9]
    off = offsets(counts)
    mine = slice(off[rank], off[rank + 1])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(off[-1], 64, generator=g).to(dev)
    idx, w = routing("zipf", off[-1], 8, 2, g)
    idx, w = idx.to(dev), w.to(dev)
    r = torch.randn(off[-1], 64, generator=g).to(dev)
    ref_moe = make_moe(topk=2, seed=2).to(dev)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    (single_process_routed(ref_moe, xa, wa, idx) * r).sum().backward()
    for path in ("megamoe", "all_to_all"):
        moe = make_moe(topk=2, seed=2).to(dev)
        t = make_transport(path, n_experts=8, topk=2, hidden=64, max_tokens=16, device=dev)
        xm, wm = x[mine].clone().requires_grad_(), w[mine].clone().requires_grad_()
        (ExpertParallel(moe, t)(moe, xm, wm, idx[mine]) * r[mine]).sum().backward()
        assert torch.equal(xm.grad, xa.grad[mine]) and torch.equal(wm.grad, wa.grad[mine]), path
        per = 8 // world
        for e in range(rank * per, (rank + 1) * per):
            a, b = moe.experts[e].w2.weight.grad, ref_moe.experts[e].w2.weight.grad
            assert same_grad(a, b), (path, e)
        t.close()


def _world(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world, device_id=dev)
    try:
        _inference(rank, world, dev)
        _gradients(rank, world, dev)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_backends_on_gpus():
    world = min(2, torch.cuda.device_count())
    mp.spawn(_world, args=(world, free_port()), nprocs=world, join=True)
