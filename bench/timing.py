"""Timing a GPU call with CUDA events: warm-up calls, then one event pair around each timed call.

    from bench.timing import cuda_times, cuda_median
    ts = cuda_times(lambda: a @ b, reps=10)       # seconds, one sample per call
    t = cuda_median(lambda: a @ b, reps=10)       # the median, seconds
    t = back_to_back(lambda: a @ b, target_s=0.02)  # seconds per call, calls issued back to back
    t = graph_time(lambda: a @ b)                  # device seconds per call, host launch cost removed
    t = host_per_call(lambda: a @ b, 50, 50)       # host seconds per call (median over batches)
"""

from __future__ import annotations

import statistics
import time

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


def back_to_back(fn, target_s: float) -> float:
    """Seconds per call with calls issued back to back (host launch cost included where it exceeds
    the kernel): one call sizes a batch of n calls filling about ``target_s`` (3 <= n <= 200); the
    median over 3 such batches."""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    n = max(3, min(200, int(target_s / max(s.elapsed_time(e) / 1e3, 1e-6))))
    ts = []
    for _ in range(3):
        s.record()
        for _ in range(n):
            fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3 / n)
    return statistics.median(ts)


def graph_time(fn, reps: int = 20, target_s: float = 0.03) -> float:
    """Device seconds per call without the host: ``fn`` captured ``reps`` times in one CUDA graph,
    the graph replayed back to back (how the serving engine runs a decode step)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return back_to_back(g.replay, target_s) / reps


def host_per_call(fn, batches: int, per: int) -> float:
    """Host seconds per call: the median over ``batches`` batches of ``per`` back-to-back calls, the
    device synchronised before each batch (and once at the end) so no batch waits on another."""
    ts = []
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        ts.append((time.perf_counter() - t0) / per)
    torch.cuda.synchronize()
    return statistics.median(ts)
