"""Real process groups for tests (gloo, or NCCL one GPU a rank): ``world`` processes, free port."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, backend):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_world(fn, world: int, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; a failing rank fails the call."""
    mp.spawn(_entry, args=(world, free_port(), fn, args, backend), nprocs=world, join=True)
