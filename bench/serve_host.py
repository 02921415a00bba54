"""The engine's host time per decode step, with the model's device work taken out.

    python -m bench.serve_host --batches 64,256 --context 1024 --out bench/results/serve_host_cpu.json
    python -m bench.serve_host --batches 256 --context 3000 --steps 160 --out bench/results/serve_host_gc_cpu.json

A decode step under ``overlap`` costs the device its kernels and the host its Python: scheduling,
the model runner's layout, the cache manager's book-keeping, sampling's launch and read-back,
the engine's per-request stop checks and events. When the host's part is the longer one the
device waits for it, so at large batches the host's time per step bounds the step. This bench
measures that part alone: the tiny preset on the CPU, every request's cache holding ``context``
tokens (``serve_roofline.fill``), and ``V4Model.step_paged`` answering with a fixed logits tensor
of the right shape (so the step's device work - here CPU kernels - is nothing; everything else is
the engine's own code, the static decode layout included). Before the requests arrive it calls
``serve.heap.settle()`` as a serving entry point does (``--no-settle``: the interpreter's own
collector policy); the requests' own lists stay under the collector. ``host_s_p50`` is the median wall time of one ``Engine.step``;
``gc_full_collections_ms`` the Python full collections (generation 2) that ran during the timed
steps and how long each took; ``--profile`` adds the top functions by own time. ``--set`` overrides
the tiny preset's fields (flash's cache layout: window 128, ratios 4 and 128, 128-token blocks).
"""

from __future__ import annotations

import cProfile
import gc
import io
import json
import pstats
import time

import torch

from bench.runner import write_result
from bench.serve_roofline import build_config, fill, random_model
from v4stack.config import ModelConfig
from v4stack.serve import heap
from v4stack.serve.engine import Engine, EngineConfig


def _full_collections(out: list):
    """A ``gc.callbacks`` hook appending each full (generation 2) collection's duration in ms to ``out``."""
    t0 = [0.0]

    def cb(phase, info):
        if phase == "start":
            t0[0] = time.perf_counter()
        elif info["generation"] == 2:
            out.append((time.perf_counter() - t0[0]) * 1e3)

    return cb


def host_point(batch: int, ctx: int, steps: int, mode: str, profile: bool, over: dict | None = None,
               settle: bool = True) -> dict:
    cfg = build_config("tiny")
    if over:
        cfg = ModelConfig.from_dict({**cfg.to_dict(), **over}).validate()
    model = random_model(cfg, "cpu", torch.float32)
    B = cfg.block_tokens
    per = -(-(ctx + steps + 16) // B) + 1
    eng = Engine(model, EngineConfig(n_blocks=batch * per, n_slots=batch, n_snapshots=batch,
                                     token_budget=max(batch, 256), max_running=batch, ops_mode=mode, overlap=True))
    fixed = torch.randn(batch, cfg.vocab_size)

    def answer(step, cache, hidden=False):  # the device's part of a step, taken out
        n = step.ids.shape[0] if step.out_rows is None else step.out_rows.shape[0]
        return fixed[:n] if n <= batch else torch.randn(n, cfg.vocab_size)

    model.step_paged = answer
    frozen = heap.settle() if settle else 0  # what a serving entry point does before it takes requests
    fill(eng, batch, ctx, steps + 12, seed=batch + ctx)
    for _ in range(4):
        eng.step()
    times, full = [], []
    prof = cProfile.Profile() if profile else None
    hook = _full_collections(full)
    gc.callbacks.append(hook)
    for _ in range(steps):
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        eng.step()
        if prof is not None:
            prof.disable()
        times.append(time.perf_counter() - t0)
    gc.callbacks.remove(hook)
    times.sort()
    res = {"batch": batch, "context": ctx, "mode": mode, "steps": steps, "host_s_p50": times[len(times) // 2],
           "host_s_min": times[0], "host_s_mean": sum(times) / len(times), "host_s_max": times[-1],
           "gc_full_collections_ms": full, "gc_frozen": frozen, "steps_ahead": eng.stats.ahead}
    if settle:
        heap.thaw()
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        res["profile_top"] = s.getvalue()[-6000:]
    return res


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="bench serve-host", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--mode", default="fast")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-settle", dest="settle", action="store_false",
                    help="leave the collector as the interpreter has it (no serve.heap.settle() after warm-up)")
    ap.add_argument("--set", action="append", default=[],
                    help="tiny-preset override key=json-value (e.g. flash's cache layout: "
                         "'compress_ratios=[0,0,4,128]' sliding_window=128 max_position_embeddings=32768)")
    ap.add_argument("--out", default="bench/results/serve_host_cpu.json")
    a = ap.parse_args(argv)
    over = {k: json.loads(v) for k, v in (x.split("=", 1) for x in a.set)}
    runs = [{**host_point(b, a.context, a.steps, a.mode, a.profile, over, a.settle), "overrides": over}
            for b in map(int, a.batches.split(","))]
    for r in runs:
        print(f"batch {r['batch']:4d} ctx {r['context']}: host p50 {r['host_s_p50'] * 1e3:.3f} ms "
              f"(min {r['host_s_min'] * 1e3:.3f}, ahead {r['steps_ahead']})")
        if "profile_top" in r:
            print(r["profile_top"])
    write_result(a.out, {"runs": runs})


if __name__ == "__main__":
    main()
