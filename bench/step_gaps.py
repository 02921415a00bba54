"""Where a decode step's wall time goes beyond its kernels (one H200 call), flash4 at batch 256:
the engine's step p50 over 32 steps back to back (overlap on, as ``bench/serve_roofline.py`` times
them), the step's CUDA graph replayed 20 times back to back with nothing else (its device time,
launch gaps inside it included), and 12 consecutive steps under the profiler: the device's busy
time (kernel and copy intervals merged) and idle time per step, and the idle gaps over 3 us by the
pair of operations around them. The profiler slows the host, so its idle time is an upper bound.
In fast mode also ``sequences``: the shipped graph (the whole step, draw and copies inside)
against the former form (the step alone in a graph, copies and draw around it) on the same layout.

    python -m bench.step_gaps bench/results/step_gaps_h200.json
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.runner import write_result
from bench.serve_roofline import build_config, fill, random_model
from v4stack.serve.engine import Engine, EngineConfig

POINTS = (("fast", 256, 1024), ("fast", 256, 16384), ("invariant", 256, 1024))


def _gaps(prof, steps: int) -> dict:
    """Busy and idle device time per step from the profile's device intervals, and the idle gaps
    over 3 us summed per (operation before, operation after)."""
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in evs)
    busy, (s0, e0, prev), pairs = 0.0, ks[0], {}
    for s, e, name in ks[1:]:
        if s > e0:
            busy += e0 - s0
            if s - e0 > 3:
                k = (prev[:40], name[:40])
                n, t = pairs.get(k, (0, 0.0))
                pairs[k] = (n + 1, t + s - e0)
            s0, e0 = s, e
        else:
            e0 = max(e0, e)
        prev = name
    busy += e0 - s0
    span = ks[-1][1] - ks[0][0]
    return {"profiled_span_per_step_us": span / steps, "busy_per_step_us": busy / steps,
            "idle_per_step_us": (span - busy) / steps,
            "gaps_over_3us": sorted(([list(k), n, t / steps] for k, (n, t) in pairs.items()), key=lambda z: -z[2])[:25]}


def point(model, cfg, mode: str, batch: int, ctx: int) -> dict:
    per = -(-(ctx + 120) // cfg.block_tokens) + 1
    eng = Engine(model, EngineConfig(n_blocks=batch * per, n_slots=batch, n_snapshots=batch,
                                     token_budget=max(batch, 256), max_running=batch, ops_mode=mode, overlap=True))
    fill(eng, batch, ctx, 110, seed=batch * 7 + ctx)
    for _ in range(8):  # graph captures, kernel builds
        eng.step()
    torch.cuda.synchronize()
    ts = []
    for _ in range(32):
        t0 = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(12):
            eng.step()
        torch.cuda.synchronize()
    gaps = _gaps(prof, 12)
    graphs = eng.runner.graphs
    g = next(iter(graphs.graphs.values()))[0].graph  # the first captured shape: a step where no entry closes
    eng.drain()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        g.replay()
    e.record()
    e.synchronize()
    seq = sequences(eng, batch) if mode == "fast" else {}
    ts.sort()
    r = {"mode": mode, "batch": batch, "context": ctx, "step_us_p50": ts[len(ts) // 2] * 1e6,
         "step_us_mean": statistics.mean(ts) * 1e6, **gaps,
         "graph_replay_back_to_back_us": s.elapsed_time(e) / 20 * 1e3, "n_graphs": len(graphs.graphs),
         "sequences_us_per_step": seq}
    print(r, flush=True)
    del eng
    torch.cuda.empty_cache()
    return r


def _timed(fn, n: int = 20) -> float:
    """Device-paced time per call of ``fn`` over ``n`` calls back to back (us)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def sequences(eng, batch: int) -> dict:
    """The device time per step of the shipped graph (layout copy, feed, step, draw, read-back all
    inside) replayed back to back, with the engine's event after each and its wait one step
    behind; the same body with the layout copy and the read-back around the replay (``around``:
    ``DecodeGraphs.copies_inside`` off); and the former form - the step alone in a graph, with the
    layout copy, the ids copy, the draw's two kernels and the read-back around it - built from the
    same layout, with its parts added one by one."""
    from v4stack.ops.mode import mode as ops_mode
    from v4stack.serve.sampling import greedy_rows

    graphs = eng.runner.graphs
    found = next(((k, p) for k, p in graphs.graphs.items() if k[3]), None)  # a drawing step's graphs
    if found is None:
        return {"error": "no drawing graph", "draw_error": graphs.draw_error, "graph_error": graphs.error}
    key, pair = found
    rows, width, caps, _ = key
    entry = pair[0]
    n = batch
    r = {"key": list(key[:2]) + [list(key[2])]}
    last = []

    def one_behind(fn):
        def go():
            fn()
            e = torch.cuda.Event()
            e.record()
            last.append(e)
            if len(last) > 1:
                last.pop(0).synchronize()
        return go

    with ops_mode(eng.config.ops_mode):
        r["graph"] = _timed(entry.graph.replay)
        r["graph_event"] = _timed(lambda: (entry.graph.replay(), entry.done.record()))
        r["graph_wait_one_behind"] = _timed(one_behind(entry.graph.replay))
        last.clear()
        # the same body with the layout copy and the read-back around the replay instead of inside
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        batch_ = eng.runner.decode_batch(entry.buf, rows, width, caps)
        with torch.cuda.stream(side):
            graphs._body(eng.runner, entry.buf, batch_, rows, True)
        torch.cuda.current_stream().wait_stream(side)
        ga = torch.cuda.CUDAGraph()
        with torch.cuda.graph(ga, pool=graphs.pool):
            _, _, out_a = graphs._body(eng.runner, entry.buf, batch_, rows, True)

        def around():
            entry.buf.copy_(entry.staging, non_blocking=True)
            ga.replay()
            entry.host.copy_(out_a, non_blocking=True)
            torch.cuda.Event().record()

        r["around_full"] = _timed(around)
        r["around_wait_one_behind"] = _timed(one_behind(around))
        last.clear()
        del ga
        # the former form from the same layout
        buf = entry.buf
        staging = entry.staging.clone().pin_memory()
        staging[:n] = 0  # the former layout carried its ids; the shipped one's fed rows hold -1 (PLACEHOLDER)
        ids = torch.zeros(n, dtype=torch.long, device="cuda")
        pinned = torch.empty(n, 3, dtype=torch.float64).pin_memory()
        dev_staging = staging.to("cuda")
        batch_ = eng.runner.decode_batch(buf, rows, width, caps)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = eng.model.step_paged(batch_, eng.cache.paged)
            greedy_rows(out[:n])
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=graphs.pool):
            out = eng.model.step_paged(batch_, eng.cache.paged)

        def greedy(back: bool = True):
            tok, o = greedy_rows(out[:n])
            if back:
                pinned.copy_(o, non_blocking=True)
            return tok

        def full():
            buf.copy_(staging, non_blocking=True)
            buf[:n].copy_(ids)
            g.replay()
            greedy()
            torch.cuda.Event().record()

        r["former_step_graph"] = _timed(g.replay)
        r["former_htod"] = _timed(lambda: (buf.copy_(staging, non_blocking=True), g.replay()))
        r["former_dtod_layout"] = _timed(lambda: (buf.copy_(dev_staging), g.replay()))
        r["former_htod_ids"] = _timed(lambda: (buf.copy_(staging, non_blocking=True), buf[:n].copy_(ids), g.replay()))
        r["former_draw"] = _timed(lambda: (g.replay(), greedy(False)))
        r["former_draw_dtoh"] = _timed(lambda: (g.replay(), greedy()))
        r["former_full"] = _timed(full)
        r["former_full_wait_one_behind"] = _timed(one_behind(full))
        del g
    print("sequences", r, flush=True)
    return r


def main(argv=None) -> None:
    out = (argv or sys.argv[1:])[0]
    cfg = build_config("flash4")
    model = random_model(cfg, "cuda", torch.bfloat16)
    with torch.no_grad():  # the captures outside the engine run as the engine's own steps do
        points = [point(model, cfg, m, b, c) for m, b, c in POINTS]
    write_result(out, {"config": "flash4", "points": points})


if __name__ == "__main__":
    main()
