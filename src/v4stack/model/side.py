"""A second CUDA stream for work a layer can run beside its main chain.

A CSA layer's decode step has two chains that meet only at the attention: the query and window
path (``wq_b``, the rotations, the window ring, the compressor's tail) and the indexer's (its
compressor's tail and closing keys, its query projection, the scores over every closed entry, the
top-k). The indexer's chain is the longer and reads memory; the query's is mostly one GEMM. Run
on two streams they overlap, and under a CUDA graph capture the fork and the join are the graph's
edges, so a replay runs them concurrently with no host work.

``Fork`` is the discipline: everything both chains read is made on the main stream before the
fork (the side stream waits for it there), the side stream writes only what the main chain does
not touch until the join, and the main stream waits for the side stream before it reads the
side's results. Tensors the side stream allocates are freed after the join, and the next fork
makes the side stream wait for the main one again, so a block the caching allocator hands out
twice is never in use on both streams at once. The kernels and their inputs are the same either
way: the bits do not depend on the streams.
"""

from __future__ import annotations

import torch

_STREAMS: dict[int, torch.cuda.Stream] = {}


def stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of ``device`` (one a device, made on first use)."""
    i = device.index if device.index is not None else torch.cuda.current_device()
    s = _STREAMS.get(i)
    if s is None:
        s = _STREAMS[i] = torch.cuda.Stream(device=i)
    return s


class Fork:
    """``with Fork(device) as f:`` enqueues its body on the side stream after everything the main
    stream has enqueued so far; ``f.join()`` makes the main stream wait for that body."""

    made = 0  # forks enqueued (eager steps and graph captures; a replay runs its captured ones)

    def __init__(self, device: torch.device):
        self.main = torch.cuda.current_stream(device)
        self.side = stream(device)
        self._ctx = None
        self.joined = False

    def __enter__(self) -> "Fork":
        Fork.made += 1
        self.side.wait_stream(self.main)
        self._ctx = torch.cuda.stream(self.side)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    def join(self) -> None:
        if not self.joined:
            self.main.wait_stream(self.side)
            self.joined = True
