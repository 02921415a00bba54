import glob
import os

import pytest
import torch
import torch.distributed as dist

from tests.optim.distributed import run_world
from v4stack.megamoe.symm import ShmSymmetric, symmetric_buffer

LAYOUT = {"a": ((4, 3), torch.bfloat16), "flags": ((8,), torch.int32), "b": ((5,), torch.float32)}


def _shm_world(rank, world):
    dist.barrier()
    before = set(glob.glob("/dev/shm/v4stack-megamoe-*"))
    buf = ShmSymmetric(LAYOUT, None)
    # the files are gone once every rank has mapped them
    assert not (set(glob.glob("/dev/shm/v4stack-megamoe-*")) - before)
    for r in range(world):  # write into every peer's copy, each into its own row / slot
        buf.remote(r, "a")[rank % 4].fill_(rank + 1)
        buf.remote(r, "flags")[rank] = 100 + rank
    buf.local("b").copy_(torch.arange(5, dtype=torch.float32) * (rank + 1))
    buf.barrier()
    for r in range(world):
        assert int(buf.local("flags")[r]) == 100 + r
        assert torch.equal(buf.local("a")[r % 4], torch.full((3,), r + 1, dtype=torch.bfloat16))
        assert torch.equal(buf.remote(r, "b"), torch.arange(5, dtype=torch.float32) * (r + 1))
    buf.barrier()
    # a second buffer in the same group does not alias the first
    other = symmetric_buffer({"b": ((5,), torch.float32)}, None, "cpu")
    other.local("b").fill_(-1)
    dist.barrier()
    assert torch.equal(buf.local("b"), torch.arange(5, dtype=torch.float32) * (rank + 1))
    buf.close()
    other.close()


@pytest.mark.slow  # the default run checks this inside test_exact's EP2 processes (spawns are slow)
def test_shm_symmetric_buffer_across_processes():
    run_world(_shm_world, 2)


def test_unknown_device_names_the_field():
    with pytest.raises(ValueError, match="device"):
        symmetric_buffer(LAYOUT, None, "meta")


def _cuda_world(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        buf = symmetric_buffer({"a": ((world, 4), torch.float32)}, None, f"cuda:{rank}")
        for r in range(world):
            buf.remote(r, "a")[rank].fill_(rank + 1)
        torch.cuda.synchronize()
        buf.barrier()
        torch.cuda.synchronize()
        for r in range(world):
            assert torch.equal(buf.local("a")[r].cpu(), torch.full((4,), float(r + 1)))
        buf.barrier()
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_cuda_symmetric_buffer():
    import torch.multiprocessing as mp

    from tests.optim.distributed import free_port

    world = min(2, torch.cuda.device_count())
    mp.spawn(_cuda_world, args=(world, free_port()), nprocs=world, join=True)
