"""Timing a GPU call with CUDA events: warm-up calls, then one event pair around each timed call.

    from bench.timing import cuda_times, cuda_median
    ts = cuda_times(lambda: a @ b, reps=10)       # seconds, one sample per call
    t = cuda_median(lambda: a @ b, reps=10)       # the median, seconds
"""

from __future__ import annotations

import statistics

import torch


def cuda_times(fn, reps: int, warmup: int = 3) -> list[float]:
    """Seconds each of ``reps`` calls of ``fn`` took on the device, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e-3)
    return out


def cuda_median(fn, reps: int, warmup: int = 3) -> float:
    """The median of ``cuda_times``, in seconds."""
    return statistics.median(cuda_times(fn, reps, warmup))
