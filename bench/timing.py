"""Timing a GPU call with CUDA events: warm-up calls, then one event pair around each timed call.

    from bench.timing import cuda_times, cuda_median
    ts = cuda_times(lambda: a @ b, reps=10)       # seconds, one sample per call
    t = cuda_median(lambda: a @ b, reps=10)       # the median, seconds
    t = back_to_back(lambda: a @ b, target_s=0.02)  # seconds per call, calls issued back to back
    t = graph_time(lambda: a @ b)                  # device seconds per call, host launch cost removed
    t = host_per_call(lambda: a @ b, 50, 50)       # host seconds per call (median over batches)
    r = graph_variants(call, {"a": 1, "b": 2}, set_it)  # one call under two settings: bits and graph times
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


def interleaved(fns: dict, target_s: float, rounds: int = 7, contexts: dict | None = None) -> dict:
    """``back_to_back`` for several calls at once: each call's batch size fills about ``target_s``,
    then ``rounds`` rounds time one batch of every call, the order reversed every other round; the
    median per call. Host drift (clocks, other load) lands on all of them alike, which two
    ``back_to_back`` runs one after the other do not promise. ``contexts[key]``: a context factory
    entered around that call's batches (e.g. an ops mode)."""
    import contextlib

    ctx = contexts or {}
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = {}
    for k, fn in fns.items():
        with ctx.get(k, contextlib.nullcontext)():
            fn()
            torch.cuda.synchronize()
            s.record()
            fn()
            e.record()
            e.synchronize()
        n[k] = max(3, min(200, int(target_s / max(s.elapsed_time(e) / 1e3, 1e-6))))
    ts = {k: [] for k in fns}
    keys = list(fns)
    for r in range(rounds):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            with ctx.get(k, contextlib.nullcontext)():
                s.record()
                for _ in range(n[k]):
                    fns[k]()
                e.record()
                e.synchronize()
            ts[k].append(s.elapsed_time(e) / 1e3 / n[k])
    return {k: statistics.median(v) for k, v in ts.items()}


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


def graph_variants(call, variants: dict, use, outs=None, rounds: int = 3, timed: bool = True) -> dict:
    """One call under several settings: ``use(value)`` before each run of ``call`` with variant
    ``name``'s value. Each variant runs once, its outputs (``outs()``, else what ``call`` returns; a
    tensor or a tuple of them) compared bit for bit with the first variant's; then ``rounds``
    interleaved rounds of ``graph_time`` (none where not ``timed``, e.g. a CPU check). -> ``{name:
    {"bits_equal_first", "us_rounds", "us" (the median, NaN untimed)}}``."""
    def run():
        got = call()
        got = outs() if outs is not None else got
        return [t.clone() for t in (got if isinstance(got, (tuple, list)) else (got,))]

    rec, ref = {}, None
    for name, value in variants.items():
        use(value)
        now = run()
        ref = now if ref is None else ref
        rec[name] = {"bits_equal_first": all(torch.equal(u, v) for u, v in zip(now, ref)), "us_rounds": []}
    for _ in range(rounds if timed else 0):
        for name, value in variants.items():
            use(value)
            rec[name]["us_rounds"].append(graph_time(call) * 1e6)
    for r in rec.values():
        r["us"] = statistics.median(r["us_rounds"]) if r["us_rounds"] else float("nan")
    return rec


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


def time_tile(r: dict, run, ref, bits_key: str) -> dict:
    """One tile of a kernel sweep: ``run()`` once, its result against ``ref`` bit for bit as
    ``r[bits_key]``, then its device time per call in a graph as ``r["us"]`` (``graph_time``); a tile
    this GPU cannot build or launch is recorded as ``r["error"]``. Prints and returns ``r``."""
    try:
        y = run()
        torch.cuda.synchronize()
        r[bits_key] = bool(torch.equal(y, ref))
        r["us"] = graph_time(run) * 1e6
    except Exception as e:  # noqa: BLE001  (recorded, the sweep goes on)
        r["error"] = repr(e)[:300]
    print(r, flush=True)
    return r
