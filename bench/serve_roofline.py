"""Decode speed of the engine against the memory-bandwidth roofline, per mode x batch x context.

    python -m bench.serve_roofline --device cuda --out bench/results/serve_engine_h200.json

Two configs (bf16): ``flash4`` = the V4-Flash preset cut to 4 layers (compress ratios 0, 0, 4,
128; 8 routed experts; no MTP) and ``flash8`` = 8 layers of V4-Flash width (ratios 0, 0, 4, 128,
4, 128, 4, 128; 64 routed experts; no MTP). Weights are random (drawn on the device).

Each point: ``batch`` requests whose caches hold ``ctx`` tokens of history - blocks allocated
through the cache manager and the pools filled with random values instead of running a prefill
(a decode step reads the same bytes either way; the prefill path itself is covered by the tests) -
then decode steps of one token per request through ``Engine.step`` (scheduling, the model runner,
the model, sampling). After ``--warmup`` untimed steps (graph capture, kernel builds; not counted
against the point's time budget) the steps run back to back as a server runs them, with no device
sync between them (``--overlap 1``, the default: the engine launches each step before it reads the
previous step's tokens); ``step_s_p50`` is the median wall time of one ``Engine.step`` call and
``step_s_mean`` the window's wall time (synchronised at both ends) over its steps, of which
``device_wait_s_mean`` the host spent waiting for sampled tokens and ``host_s_mean`` doing its own
work (``host_s_p50``: the median over steps of a step's wall time less its wait; when the wait
is near zero the host, not the device, sets the step time), and
``replay_launch_s_mean`` the host time of one ``CUDAGraph.replay`` call (part of the host's); a step where
compressed entries close (every 4th for CSA, every 128th for HCA) costs more than the others, so
``fraction`` (from the p50) is the typical step's and ``fraction_mean`` the window's average.

Roofline: the bytes one decode step must read, over the measured device copy bandwidth:
- weights: every parameter except the embedding table (only ``batch`` rows of it are read) and
  the routed experts a step does not touch (expected touched: ``E (1 - (1 - k/E)^batch)``);
- cache per request and layer: the window (``n_win`` rows), and for a CSA layer the indexer keys
  of every closed entry (in the format the engine stores them: ``--index-keys``) plus
  ``min(top-k, entries)`` compressed entries, for an HCA layer every closed entry.
``fraction = roofline step time / measured step time``.

Compute floor: the step's matrix work (``step_flops``: two FLOPs per weight element per token for
every matrix but the embedding, the routed experts at ``k / E`` of theirs, the attention's scores
and values over each layer's candidates, the indexer's scores over its entries) at the measured
dense bf16 rate (``matmul_rate``, an 8192-cube product). Where it exceeds the bandwidth floor
(flash4 at batch 256) the step is compute-bound and no kernel reaches the bandwidth roofline:
``roofline_max_step_s = max(both floors)`` and ``fraction_of_max`` say how far the step is from the
floor that binds.
"""

from __future__ import annotations

import time

import torch

from bench.runner import write_result
from bench.serve import copy_bandwidth, matmul_rate
from v4stack.config import ModelConfig, preset
from v4stack.model import V4Model
from v4stack.model.init import is_fp32_param
from v4stack.ops import fp8_keys
from v4stack.serve.engine import INDEX_KEY_FORMATS, Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams

CONFIGS = {
    "tiny": dict(),  # CPU smoke runs of this bench
    "flash4": dict(num_hidden_layers=4, compress_ratios=[0, 0, 4, 128], n_routed_experts=8,
                   num_nextn_predict_layers=0),
    "flash8": dict(num_hidden_layers=8, compress_ratios=[0, 0, 4, 128, 4, 128, 4, 128], n_routed_experts=64,
                   num_nextn_predict_layers=0),
}


def build_config(name: str) -> ModelConfig:
    return ModelConfig.from_dict({**preset("tiny" if name == "tiny" else "flash").to_dict(), **CONFIGS[name]})


@torch.no_grad()
def random_model(cfg: ModelConfig, device: str, dtype: torch.dtype, seed: int = 0) -> V4Model:
    """The model with random weights drawn on ``device`` (the scales of model/init.py)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = V4Model(cfg, seed=None)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            p.normal_(1.0, 0.1)
        elif leaf in ("attn_sink",) or name == "embed.weight":
            p.normal_()
        elif leaf.endswith("_base") or leaf == "ape":
            p.normal_(0.0, 0.5)
        elif leaf.endswith("_scale"):
            p.uniform_(0.75, 1.25)
        elif name.endswith("gate.bias"):
            p.normal_(0.0, 0.1)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.rand(b.shape[0], cfg.n_routed_experts, device=device).argsort(1)[:, : b.shape[1]])
    for name, p in model.named_parameters():
        if not is_fp32_param(name):
            p.data = p.data.to(dtype)
    return model.eval()


def step_bytes(model: V4Model, cfg: ModelConfig, batch: int, ctx: int, es: int, key_bytes: int | None = None) -> dict:
    """``key_bytes``: one indexer key's bytes in the cache (default ``index_head_dim`` elements of
    ``es`` bytes; V4's packed keys are ``ops.fp8_keys.width(index_head_dim)``)."""
    kb = cfg.index_head_dim * es if key_bytes is None else key_bytes
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = E * (1 - (1 - k / E) ** batch)
    w = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if name == "embed.weight":
            n = batch * p.shape[1] * p.element_size()
        elif ".ffn.experts." in name:
            n = n * touched / E
        w += n
    cache = 0
    for r in cfg.layer_ratios:
        cache += cfg.sliding_window * cfg.head_dim * es
        if r and cfg.is_csa(r):
            ents = ctx // r
            cache += ents * kb + min(cfg.index_topk, ents) * cfg.head_dim * es
        elif r:
            cache += (ctx // r) * cfg.head_dim * es
    return {"weight_bytes": int(w), "cache_bytes_per_request": cache, "step_bytes": int(w + batch * cache),
            "experts_touched": touched}


def step_flops(model: V4Model, cfg: ModelConfig, batch: int, ctx: int) -> dict:
    """The matrix FLOPs of one decode step of ``batch`` tokens (see the module's compute floor)."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    dense = experts = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name == "embed.weight" or name.endswith(".ape"):
            continue
        if ".ffn.experts." in name:
            experts += p.numel()
        else:
            dense += p.numel()
    weights = 2 * batch * (dense + experts * k / E)
    attn = index = 0
    for r in cfg.layer_ratios:
        cands = cfg.sliding_window
        if r and cfg.is_csa(r):
            cands += min(cfg.index_topk, ctx // r)
            index += 2 * cfg.index_n_heads * cfg.index_head_dim * (ctx // r)
        elif r:
            cands += ctx // r
        attn += 4 * cfg.num_attention_heads * cfg.head_dim * cands
    return {"weight_flops": int(weights), "attention_flops": int(batch * attn), "indexer_flops": int(batch * index),
            "step_flops": int(weights + batch * (attn + index))}


def fill(engine: Engine, batch: int, ctx: int, max_tokens: int, seed: int, stagger: int = 0) -> list:
    """``batch`` running requests whose caches already hold ``ctx`` tokens (random pools); with
    ``stagger`` > 1 request ``i`` holds ``ctx + i % stagger`` (positions spread, so that entries and
    blocks close in different steps for different requests, as in a server's steady state)."""
    g = torch.Generator().manual_seed(seed)
    cm = engine.cache
    for t in list(cm.blocks.storage.values()):
        if fp8_keys.is_packed(t):  # V4's packed indexer keys: random keys, packed a block at a time
            for b in range(0, t.shape[0], 4096):
                n = min(4096, t.shape[0] - b)
                t[b : b + n] = fp8_keys.pack(torch.randn(n, t.shape[1], engine.model.cfg.index_head_dim, device=t.device))
        else:
            t.normal_()
    for ts in cm.slots.tensors.values():
        for t in ts:
            t.normal_()
    reqs = []
    sp = SamplingParams(max_tokens=max_tokens)
    for i in range(batch):
        c = ctx + (i % stagger if stagger > 1 else 0)
        prompt = torch.randint(0, engine.model.cfg.vocab_size, (c + 1,), generator=g).tolist()
        req = engine.add_request(prompt, sp)
        rc = cm.admit(prompt)
        if not cm.reserve(rc, c):
            raise RuntimeError("bench: cache too small")
        rc.pos, rc.tokens = c, prompt[:c]
        engine.attach(req, rc)
        reqs.append(req)
    return reqs


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_point(model, cfg, mode: str, batch: int, ctx: int, steps: int, bw: float | None, budget_s: float,
                overlap: bool = True, warmup: int = 6, rate: float | None = None, stagger: int = 0,
                layout: str = "kernel", pdl_rows: int | None = None, index_keys: str = "auto") -> dict:
    B, dev = cfg.block_tokens, model.embed.weight.device.type
    per = -(-(ctx + stagger + steps + warmup + 8) // B) + 1
    engine = Engine(model, EngineConfig(n_blocks=batch * per, n_slots=batch, n_snapshots=batch,
                                        token_budget=max(batch, 256), max_running=batch, ops_mode=mode,
                                        overlap=overlap, index_keys=index_keys))
    if engine.runner.graphs is not None:  # how a graph takes its layout in (DecodeGraphs.layout_kernel)
        engine.runner.graphs.layout_kernel = layout == "kernel"
        if pdl_rows is not None:  # graphs of up to this many rows launch programmatically (DecodeGraphs.pdl_rows)
            engine.runner.graphs.pdl_rows = pdl_rows
    fill(engine, batch, ctx, steps + warmup + 4, seed=batch * 7 + ctx, stagger=stagger)
    t0 = time.perf_counter()
    for _ in range(warmup):  # publish the synthetic history's blocks, capture the graph, build kernels
        engine.step()
    _sync(dev)
    warm_s = time.perf_counter() - t0
    # steps back to back, as a server runs them (no device sync between steps: with overlap the
    # next step is launched before this one's tokens are read); each step's wall time is one call
    wait0 = engine.stats.device_wait_s
    g = engine.runner.graphs
    replay0, nrep0 = (g.replay_s, g.replays) if g is not None else (0.0, 0)
    times, t_start = [], time.perf_counter()
    waits = []
    for _ in range(steps):
        t0, w0 = time.perf_counter(), engine.stats.device_wait_s
        engine.step()
        times.append(time.perf_counter() - t0)
        waits.append(engine.stats.device_wait_s - w0)
        if time.perf_counter() - t_start > budget_s and len(times) >= 2:
            break
    _sync(dev)
    mean = (time.perf_counter() - t_start) / len(times)
    wait = (engine.stats.device_wait_s - wait0) / len(times)
    replay = (g.replay_s - replay0) / max(1, g.replays - nrep0) if g is not None else None
    order, host_order = list(times), [t - w for t, w in zip(times, waits)]
    host = sorted(host_order)
    times.sort()
    p50 = times[len(times) // 2]
    keys = [g for g in engine.cache.spec.paged if g.kind == "index_keys"]
    key_bytes = keys[0].bytes // keys[0].rows if keys else None
    sb = step_bytes(model, cfg, batch, ctx, torch.empty((), dtype=model.dtype).element_size(), key_bytes)
    floor = sb["step_bytes"] / bw if bw else None
    sf = step_flops(model, cfg, batch, ctx)
    compute = sf["step_flops"] / rate if rate else None
    bound = max(floor, compute) if floor and compute else None
    res = {"mode": mode, "batch": batch, "context": ctx, "overlap": overlap, "layout_in": layout,
           "index_keys": index_keys, "index_key_bytes": key_bytes,
           "pdl_rows": engine.runner.graphs.pdl_rows if engine.runner.graphs is not None else None,
           "steps_timed": len(times),
           "step_s_p50": p50, "step_s_mean": mean, "device_wait_s_mean": wait, "host_s_mean": mean - wait,
           "host_s_p50": host[len(host) // 2],
           "replay_launch_s_mean": replay, "step_s_sorted": times, "step_s_order": order,
           "host_s_order": host_order, "stagger": stagger, "warmup_s": warm_s,
           "steps_ahead": engine.stats.ahead,
           "tok_s": batch / p50, "roofline_step_s": floor, "roofline_tok_s": batch / floor if floor else None,
           "fraction": floor / p50 if floor else None, "fraction_mean": floor / mean if floor else None, **sb,
           "compute_floor_s": compute, "roofline_max_step_s": bound, "fraction_of_max": bound / p50 if bound else None,
           **sf,
           "cache_bytes_written_last_step": engine.stats.last_step_cache_bytes,
           "cuda_graph_replays": engine.runner.graphs.replays if engine.runner.graphs else 0,
           "cuda_graph_error": engine.runner.graphs.error if engine.runner.graphs else None,
           **({"graph_draws": engine.runner.graphs.draws, "graph_fed_steps": engine.runner.graphs.fed_steps,
               "graph_settled": engine.runner.graphs.settled, "graph_copies_error": engine.runner.graphs.copies_error}
              if engine.runner.graphs else {})}
    del engine
    if dev == "cuda":
        torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="bench serve-roofline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--configs", default="flash4,flash8")
    ap.add_argument("--modes", default="fast,invariant")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="1024,16384")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--point-budget-s", type=float, default=6.0,
                    help="stop timing a point after this many seconds past its warm-up (>= 2 steps)")
    ap.add_argument("--warmup", type=int, default=6,
                    help="untimed steps first (graph captures - one per closing pattern, e.g. the first step where "
                         "ratio-4 entries close - and kernel builds)")
    ap.add_argument("--overlap", default="1", help="engine overlap: 1, 0, or 0,1 for both")
    ap.add_argument("--stagger", type=int, default=0,
                    help="request i holds context + i %% stagger tokens (0: every request at the same position, "
                         "so every row closes its entries in the same steps)")
    ap.add_argument("--layout-in", default="kernel",
                    help="how a decode graph takes its layout in: kernel (the shipped read of the pinned staging), "
                         "copy (a copy-engine transfer, then the feed), or kernel,copy for both (an A/B)")
    ap.add_argument("--pdl-rows", type=int, default=None,
                    help="decode graphs of up to this many rows launch programmatically (default: the engine's)")
    ap.add_argument("--index-keys", default="auto", choices=INDEX_KEY_FORMATS,
                    help="the cache's indexer keys (EngineConfig.index_keys): auto (V4's packed keys with "
                         "--act-rounding, else the model dtype), model, or fp8 (V4's packed e4m3 keys, 144 bytes a key; "
                         "without --act-rounding they round the keys, so the chosen entries may move)")
    ap.add_argument("--act-rounding", action="store_true",
                    help="the model runs V4's activation rounding (model/quant.py: FP8 KV rows and entries, Hadamard + FP4 "
                         "indexer queries and keys), as a released checkpoint loads; --index-keys auto then packs the keys")
    ap.add_argument("--out", default="bench/results/serve_engine_h200.json")
    a = ap.parse_args(argv)
    bw = copy_bandwidth(a.device)
    rate = matmul_rate(a.device)
    payload = {"copy_bandwidth_GBps": bw / 1e9 if bw else None, "matmul_TFLOPs": rate / 1e12 if rate else None,
               "configs": {}, "runs": []}
    models = {}
    for name in a.configs.split(","):
        cfg = build_config(name)
        t0 = time.perf_counter()
        dt = torch.bfloat16 if a.device == "cuda" else torch.float32
        models[name] = (cfg, random_model(cfg, a.device, dt))
        if a.act_rounding:
            from v4stack.model.quant import set_act_rounding

            set_act_rounding(models[name][1], True)
        payload["configs"][name] = {**CONFIGS[name], "hidden_size": cfg.hidden_size, "dtype": str(dt)[6:],
                                    "act_rounding": a.act_rounding,
                                    "params": sum(p.numel() for p in models[name][1].parameters()),
                                    "build_s": time.perf_counter() - t0}
    for mode in a.modes.split(","):  # every config's fast points first: they are the cheap ones
        for name, (cfg, model) in models.items():
            for ctx in map(int, a.contexts.split(",")):
                for b, ov, lay in ((b, ov, lay) for b in map(int, a.batches.split(","))
                                   for ov in map(int, a.overlap.split(",")) for lay in a.layout_in.split(",")):
                    try:
                        r = bench_point(model, cfg, mode, b, ctx, a.steps, bw, a.point_budget_s, bool(ov), a.warmup,
                                        rate, a.stagger, lay, a.pdl_rows, a.index_keys)
                    except Exception:  # record and go on: one failing point must not lose the rest
                        import traceback

                        r = {"mode": mode, "batch": b, "context": ctx, "overlap": bool(ov), "layout_in": lay,
                             "error": traceback.format_exc()[-1500:]}
                    r["config"] = name
                    payload["runs"].append(r)
                    if "error" in r:
                        print(f"{name} {mode:<9} ctx {ctx:>5} batch {b:>3} ov {ov} {lay}: ERROR {r['error']}", flush=True)
                    else:
                        roof = (f"  roofline {r['roofline_tok_s']:9.1f} tok/s ({100 * r['fraction']:.1f}%)"
                                if r["fraction"] else "")
                        if r["fraction_of_max"]:
                            roof += (f" compute floor {r['compute_floor_s'] * 1e3:.2f} ms"
                                     f" ({100 * r['fraction_of_max']:.1f}% of the binding floor)")
                        print(f"{name} {mode:<9} ctx {ctx:>5} batch {b:>3} ov {ov} {lay}: step p50 {r['step_s_p50'] * 1e3:8.2f} ms "
                              f"{r['tok_s']:9.1f} tok/s{roof} host p50 {r['host_s_p50'] * 1e3:.2f} ms/step", flush=True)
                    from v4stack.kernels.fused_gpu import refused

                    payload["fused_kernels_refused"] = dict(refused)  # fused ops served by their reference
                    write_result(a.out, payload)  # partial results survive a timeout


if __name__ == "__main__":
    main()
