"""MegaMoE on CUDA: symmetric memory, pull stream and events, against the baseline (NCCL) and the
single-process layer on the same GPU(s). One rank per GPU, up to two."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.megamoe.common import make_moe, offsets
from tests.optim.distributed import free_port
from v4stack.megamoe import AllToAllMoE, ExpertShard, MegaMoE, reference_routed
from v4stack.megamoe.routing import routing


def _world(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    try:
        for kind, topk, gemm in (("uniform", 2, "tile"), ("zipf", 3, "row")):
            moe = make_moe(topk=topk).to(dev)
            counts = [37, 0][:world] if world > 1 else [37]
            off = offsets(counts)
            g = torch.Generator().manual_seed(topk)
            x = torch.randn(off[-1], 64, generator=g).to(torch.bfloat16).to(dev)
            idx, w = routing(kind, off[-1], 8, topk, g)
            w = w.to(dev)
            mine = slice(off[rank], off[rank + 1])
            shard = ExpertShard.from_moe(moe, rank, world, tile=8, gemm=gemm)
            mega = MegaMoE(shard, max_tokens=64, device=dev, ring_tiles=3)
            got = mega(x[mine], idx[mine], w[mine])
            torch.cuda.synchronize()
            base = AllToAllMoE(shard)(x[mine], idx[mine], w[mine])
            ref = reference_routed(moe, x, idx, w, tile=8, gemm=gemm)[mine]
            assert got.is_cuda and torch.equal(got, base), (kind, "baseline")
            assert torch.equal(got, ref), (kind, "single-process")
            mega.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_megamoe_cuda_bit_identical():
    world = min(2, torch.cuda.device_count())
    mp.spawn(_world, args=(world, free_port()), nprocs=world, join=True)
