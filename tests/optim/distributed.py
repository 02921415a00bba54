"""Real gloo process groups for tests: spawn ``world`` processes on a free loopback port."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_world(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes; a failing rank fails the call."""
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)
