"""Where a decode step's time goes: a torch.profiler trace of one engine step (graphed) and of
the same step run eagerly, per config x mode x batch x context.

    python -m bench.serve_profile --device cuda --out bench/results/serve_profile_h200.json

For each point the engine is filled as in ``bench/serve_roofline.py`` (synthetic history), a few
steps run (graph capture), then:

- ``step``: wall time of ``Engine.step`` (p50 of ``--steps`` run back to back, no sync between
  them), and one profiled step (with overlap: the next step's launch, then the in-flight one's read): device
  kernels launched (inside the graph replay too), their summed device time, host time spent in
  named regions (scheduling, layout, graph input copies, replay launch, sampling), host syncs;
- ``eager``: one ``V4Model.step_paged`` over the same static decode layout, profiled: kernel
  count per step, summed device time, and kernels and device time per model region (mHC
  coefficients / read / write, attention, rope, indexer selection, MoE, head), top kernels.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.runner import write_result
from bench.serve_roofline import build_config, fill, random_model
from v4stack.serve.engine import Engine, EngineConfig


def _kernels(ev) -> list:
    """Device kernels launched under a profiler CPU event (its subtree)."""
    out = list(getattr(ev, "kernels", []) or [])
    for c in ev.cpu_children:
        out.extend(_kernels(c))
    return out


def _is_kernel(e) -> bool:
    return e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))


def _summarise(prof, regions: tuple[str, ...], top: int = 60) -> dict:
    evs = prof.events()
    dev = [e for e in evs if _is_kernel(e) and e.name not in regions]  # not the regions' device-side marks
    by_name = defaultdict(lambda: [0, 0.0])
    for e in dev:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.device_time
    tops = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    mem = [e for e in evs if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("Memcpy")]
    host = defaultdict(lambda: [0, 0.0, 0, 0.0])  # calls, host us, kernels, device us
    for e in evs:
        if e.name in regions and e.device_type == torch.autograd.DeviceType.CPU:
            ks = _kernels(e)
            h = host[e.name]
            h[0] += 1
            h[1] += e.cpu_time_total
            h[2] += len(ks)
            h[3] += sum(k.duration for k in ks)
    syncs = sum(1 for e in evs if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"))
    # every kernel in launch order (name, device us): where the step's time goes, call by call
    seq = [[e.name[:60], round(e.device_time, 2)] for e in sorted(dev, key=lambda e: e.time_range.start)]
    return {
        "kernels": len(dev), "kernel_device_us": sum(e.device_time for e in dev),
        "kernel_span_us": (max(e.time_range.end for e in dev) - min(e.time_range.start for e in dev)) if dev else 0.0,
        "memcpy": len(mem), "memcpy_device_us": sum(e.device_time for e in mem), "host_syncs": syncs,
        "graph_launches": sum(1 for e in evs if e.name == "cudaGraphLaunch"),
        "kernel_launches": sum(1 for e in evs if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                           "cuLaunchKernelEx")),
        "regions": {k: {"calls": v[0], "host_us": v[1], "kernels": v[2], "kernel_device_us": v[3]}
                    for k, v in host.items()},
        "top_kernels": [{"name": n[:160], "count": c, "device_us": t} for n, (c, t) in tops],
        "sequence": seq,
    }


@contextlib.contextmanager
def _annotated(pairs):
    """Wrap ``(owner, attribute, label)`` callables in ``record_function(label)`` for the block."""
    saved = []
    for owner, attr, label in pairs:
        fn = getattr(owner, attr)
        saved.append((owner, attr, fn))

        def wrap(*a, __fn=fn, __label=label, **kw):
            with record_function(__label):
                return __fn(*a, **kw)

        setattr(owner, attr, wrap)
    try:
        yield
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)


def _model_regions():
    from v4stack.model import attention, block, compressor, indexer, mhc, model, moe, rope

    return (
        (block, "hc_coefficients", "mhc.coefficients"), (block, "read_norm", "mhc.read_norm"),
        (block, "coefficients_read_norm", "mhc.coefficients_read_norm"),
        (block, "hc_write", "mhc.write"), (model, "head_input", "mhc.head"),
        (attention.Attention, "forward", "attention"), (attention.Attention, "_close", "attention.close"),
        (rope.Rotary, "apply", "rope"), (indexer.Indexer, "select_rows", "indexer.select"),
        (compressor.Compressor, "project", "compressor.project"),
        (moe.MoE, "forward", "moe"), (moe.Gate, "forward", "moe.gate"),
        (model.V4Model, "_head", "head"), (block.Block, "forward", "block"),
    )


def _step_regions(engine):
    from v4stack.serve import engine as eng_mod
    from v4stack.serve import overlap as ov_mod

    r = engine.runner
    pairs = [(engine.scheduler, "schedule", "engine.schedule"), (r, "build_decode", "runner.build_decode"),
             (r, "build", "runner.build"), (eng_mod, "sample_async", "engine.sample_launch"),
             (ov_mod, "sample_async", "ahead.sample_launch"), (eng_mod, "sample_greedy_async", "engine.greedy_launch"),
             (ov_mod, "sample_greedy_async", "ahead.greedy_launch"), (eng_mod, "launch_ahead", "engine.launch_ahead"),
             (engine, "_collect", "engine.collect"),
             (engine.cache, "plan_captures", "cache.plan_captures"), (engine.cache, "advance_all", "cache.advance")]
    if r.graphs is not None:
        pairs += [(r.graphs, "run", "graphs.run"), (r, "decode_layout", "runner.decode_layout")]
    return [(o, a, label) for o, a, label in pairs if hasattr(o, a)]


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def profile_point(model, cfg, mode: str, batch: int, ctx: int, steps: int, overlap: bool = True,
                  warmup: int = 6, stagger: int = 0) -> dict:
    B, dev = cfg.block_tokens, model.embed.weight.device.type
    per = -(-(ctx + stagger + steps + warmup + 16) // B) + 1
    engine = Engine(model, EngineConfig(n_blocks=batch * per, n_slots=batch, n_snapshots=batch,
                                        token_budget=max(batch, 256), max_running=batch, ops_mode=mode,
                                        overlap=overlap))
    reqs = fill(engine, batch, ctx, steps + warmup + 12, seed=batch * 7 + ctx, stagger=stagger)
    t0 = time.perf_counter()
    for _ in range(warmup):  # publish the synthetic history, capture the graph
        engine.step()
    _sync(dev)
    warm = time.perf_counter() - t0
    times = []
    for _ in range(steps):  # back to back, as the roofline bench times them
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    _sync(dev)
    times.sort()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    step_regions = tuple(label for _, _, label in _step_regions(engine))
    _sync(dev)
    with _annotated(_step_regions(engine)), profile(activities=acts) as prof:
        t0 = time.perf_counter()
        engine.step()  # with overlap: launches the next step, then reads the one in flight
        _sync(dev)
        wall = time.perf_counter() - t0
    step = {"wall_us_p50": times[len(times) // 2] * 1e6, "profiled_wall_us": wall * 1e6, "warmup_s": warm,
            "overlap": overlap, "steps_ahead": engine.stats.ahead,
            **_summarise(prof, step_regions)}
    g = engine.runner.graphs
    step["graph_replays"] = g.replays if g is not None else 0
    step["graph_error"] = g.error if g is not None else None
    engine.drain()
    # the same decode layout eagerly (re-running a decode step rewrites the same rows)
    chunks = [(r.cache, [r.output[-1] if r.output else 0]) for r in reqs if r.cache is not None]
    from v4stack.serve.graphs import _next_pow2, _width
    from v4stack.ops.mode import mode as ops_mode

    rows = _next_pow2(len(chunks))
    width = _width(max(len(rc.blocks) for rc, _ in chunks))
    layout = engine.runner.build_decode(chunks, rows, width)
    with torch.no_grad(), ops_mode(mode):
        model.step_paged(layout, engine.cache.paged)  # warm
        _sync(dev)
        t0 = time.perf_counter()
        model.step_paged(layout, engine.cache.paged)
        _sync(dev)
        eager_wall = time.perf_counter() - t0
        labels = tuple(label for _, _, label in _model_regions())
        with _annotated(_model_regions()), profile(activities=acts) as prof:
            model.step_paged(layout, engine.cache.paged)
            _sync(dev)
    eager = {"wall_us": eager_wall * 1e6, **_summarise(prof, labels)}
    del engine
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {"mode": mode, "batch": batch, "context": ctx, "step": step, "eager": eager}


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="bench serve-profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--configs", default="flash4")
    ap.add_argument("--modes", default="fast,invariant")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--overlap", type=int, default=1)
    ap.add_argument("--stagger", type=int, default=0,
                    help="request i holds context + i %% stagger tokens (serve_roofline.fill)")
    ap.add_argument("--out", default="bench/results/serve_profile_h200.json")
    a = ap.parse_args(argv)
    payload = {"points": []}
    for name in a.configs.split(","):
        cfg = build_config(name)
        dt = torch.bfloat16 if a.device == "cuda" else torch.float32
        model = random_model(cfg, a.device, dt)
        for mode in a.modes.split(","):
            for ctx in map(int, a.contexts.split(",")):
                for b in map(int, a.batches.split(",")):
                    try:
                        r = profile_point(model, cfg, mode, b, ctx, a.steps, bool(a.overlap), a.warmup, a.stagger)
                        r["stagger"] = a.stagger
                    except Exception:
                        import traceback

                        r = {"mode": mode, "batch": b, "context": ctx, "error": traceback.format_exc()[-2000:]}
                    r["config"] = name
                    payload["points"].append(r)
                    if "error" in r:
                        print(f"{name} {mode} b{b} ctx{ctx}: ERROR {r['error']}", flush=True)
                    else:
                        s, e = r["step"], r["eager"]
                        print(f"{name} {mode:<9} b{b:<3} ctx{ctx}: step {s['wall_us_p50']:8.0f} us "
                              f"({s['kernels']} kernels, {s['kernel_device_us']:.0f} us device in a {s['kernel_span_us']:.0f} us span, "
                              f"{s['host_syncs']} syncs) | eager {e['wall_us']:8.0f} us "
                              f"({e['kernels']} kernels, {e['kernel_device_us']:.0f} us device)", flush=True)
                    from v4stack.kernels.fused_gpu import refused

                    payload["fused_kernels_refused"] = dict(refused)  # fused ops served by their reference
                    write_result(a.out, payload)
        del model


if __name__ == "__main__":
    main()
