"""`v4stack bench serve`: N concurrent streaming clients with a shared-prefix workload against a
real HTTP server (in this process, on loopback); writes JSON.

Reported: output tokens/s, requests/s, TTFT and inter-token latency p50 / p99 (client side from
the SSE stream and server side from the engine's token timestamps), prefix hit rate, cache bytes
per token per kind, state bytes per request, and on CUDA a decode roofline: the bytes one decode
step must read (weights touched + cache) over the measured copy bandwidth.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from pathlib import Path

import torch

from v4stack.config import ModelConfig
from v4stack.model import V4Model
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.runner import EngineRunner
from v4stack.serve.sampling import SamplingParams


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_bandwidth(device: str) -> float | None:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    if device != "cuda":
        return None
    a = torch.empty(512 * 1024 * 1024 // 4, dtype=torch.float32, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for _ in range(10):
        b.copy_(a)
    ev1.record()
    torch.cuda.synchronize()
    return 10 * 2 * a.numel() * 4 / (ev0.elapsed_time(ev1) / 1e3)


async def _client(base: str, model: str, prompt: list[int], max_tokens: int, out: list):
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    times = []
    async with httpx.AsyncClient(timeout=None) as c:
        async with c.stream("POST", base + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.perf_counter())
    out.append((t0, times))


def bench_serve(cfg: ModelConfig, *, clients: int = 16, requests: int = 64, prefixes: int = 4,
                prefix_len: int = 64, suffix_len: int = 16, max_tokens: int = 16, device: str = "cpu",
                dtype: torch.dtype = torch.float32, ops_mode: str = "invariant", n_blocks: int = 512,
                seed: int = 0, out: str | None = None, label: str = "") -> dict:
    import uvicorn

    from v4stack.serve.api import build_app

    model = V4Model(cfg, seed=seed).cast(dtype).to(device)
    engine = Engine(model, EngineConfig(n_blocks=n_blocks, n_slots=clients, max_running=clients,
                                        token_budget=max(256, clients), ops_mode=ops_mode))
    runner = EngineRunner(engine).start()
    port = _port()
    server = uvicorn.Server(uvicorn.Config(build_app(runner, "bench"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)
    rng = random.Random(seed)
    heads = [[rng.randrange(256) for _ in range(prefix_len)] for _ in range(prefixes)]
    work = [rng.choice(heads) + [rng.randrange(256) for _ in range(rng.randrange(1, suffix_len + 1))]
            for _ in range(requests)]
    results: list = []

    async def drive():
        sem = asyncio.Semaphore(clients)
        base = f"http://127.0.0.1:{port}"

        async def one(p):
            async with sem:
                await _client(base, "bench", p, max_tokens, results)

        await asyncio.gather(*(one(p) for p in work))

    gen0 = engine.stats.tokens_generated
    t0 = time.perf_counter()
    asyncio.run(drive())
    wall = time.perf_counter() - t0
    n_out = engine.stats.tokens_generated - gen0
    server.should_exit = True
    th.join(timeout=10)
    runner.stop()

    ttft_client = [ts[0] - s for s, ts in results if ts]
    itl_client = [b - a for _, ts in results for a, b in zip(ts, ts[1:])]
    log = engine.stats.log
    ttft_server = [f - a for a, f, *_ in log if f is not None]
    itl_server = [b - a for _, _, tt, *_ in log for a, b in zip(tt, tt[1:])]
    step_times = runner.step_times
    cs = engine.cache.stats()
    res = {
        "label": label, "device": device, "dtype": str(dtype).replace("torch.", ""), "ops_mode": ops_mode,
        "config": {"hidden_size": cfg.hidden_size, "layers": cfg.num_hidden_layers,
                   "experts": cfg.n_routed_experts, "block_tokens": engine.cache.B},
        "workload": {"clients": clients, "requests": requests, "prefixes": prefixes, "prefix_len": prefix_len,
                     "suffix_len_max": suffix_len, "max_tokens": max_tokens},
        "wall_s": wall,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / wall,
        "requests_per_s": requests / wall,
        "ttft_s": {"client_p50": _q(ttft_client, .5), "client_p99": _q(ttft_client, .99),
                   "server_p50": _q(ttft_server, .5), "server_p99": _q(ttft_server, .99)},
        "itl_s": {"client_p50": _q(itl_client, .5), "client_p99": _q(itl_client, .99),
                  "server_p50": _q(itl_server, .5), "server_p99": _q(itl_server, .99)},
        "engine_step_s": {"p50": _q(step_times, .5), "p99": _q(step_times, .99), "steps": len(step_times)},
        "prefix_hit_rate": cs["prefix_hit_rate"],
        "cache_bytes_per_token": cs["bytes_per_token"],
        "state_bytes_per_request": cs["state_bytes_per_request"],
        "preemptions": engine.scheduler.preemptions,
    }
    if device == "cuda":
        res["roofline"] = _roofline(model, engine, clients, prefix_len + suffix_len / 2 + max_tokens / 2,
                                    _q(itl_server, .5))
    if out:
        p = Path(out)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(res, indent=2) + "\n")
    return res


def _roofline(model, engine: Engine, batch: int, ctx: float, step_s: float | None) -> dict:
    """Bytes one decode step must read (every weight, as a batch touches all experts, plus each
    request's state slot and compressed cache) over the measured copy bandwidth."""
    bw = copy_bandwidth("cuda")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    spec = engine.cache.spec
    cache_read = batch * (spec.slot_bytes() + ctx * sum(spec.bytes_per_token().values()))
    floor = (weight_bytes + cache_read) / bw
    return {"copy_bandwidth_GBps": bw / 1e9, "weight_bytes": weight_bytes, "cache_bytes_per_step": cache_read,
            "decode_step_floor_s": floor, "decode_tokens_per_s_roofline": batch / floor,
            "decode_step_measured_s": step_s,
            "decode_tokens_per_s_measured": batch / step_s if step_s else None,
            "fraction_of_roofline": (floor / step_s) if step_s else None}


def bench_engine(cfg: ModelConfig, *, batch: int = 16, prefixes: int = 4, prefix_len: int = 64,
                 suffix_len: int = 16, max_tokens: int = 32, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, ops_mode: str = "fast", seed: int = 0,
                 n_blocks: int = 512) -> dict:
    """The engine alone (no HTTP): ``batch`` requests decoded together; decode-only steps timed
    with device synchronisation, against the decode roofline on CUDA."""
    model = V4Model(cfg, seed=seed).cast(dtype).to(device)
    engine = Engine(model, EngineConfig(n_blocks=n_blocks, n_slots=batch, max_running=batch,
                                        token_budget=max(512, batch * (prefix_len + suffix_len)), ops_mode=ops_mode))
    rng = random.Random(seed)
    heads = [[rng.randrange(256) for _ in range(prefix_len)] for _ in range(prefixes)]
    sp = SamplingParams(max_tokens=max_tokens)

    def run_once() -> tuple[list[float], float]:
        for _ in range(batch):
            engine.add_request(rng.choice(heads) + [rng.randrange(256) for _ in range(rng.randrange(1, suffix_len + 1))], sp)
        decode, t_all = [], time.perf_counter()
        while engine.has_work():
            plan_is_decode = all(r.pending <= 1 and r.cache is not None for r in engine.scheduler.running) \
                and not engine.scheduler.waiting
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step()
            if device == "cuda":
                torch.cuda.synchronize()
            if plan_is_decode:
                decode.append(time.perf_counter() - t0)
        return decode, time.perf_counter() - t_all

    run_once()  # warm-up: allocator, kernels, first-call costs
    decode, wall = run_once()
    step = _q(decode, 0.5)
    res = {"device": device, "dtype": str(dtype).replace("torch.", ""), "ops_mode": ops_mode, "batch": batch,
           "config": {"hidden_size": cfg.hidden_size, "layers": cfg.num_hidden_layers,
                      "experts": cfg.n_routed_experts, "vocab": cfg.vocab_size},
           "params": sum(p.numel() for p in model.parameters()),
           "decode_steps": len(decode), "decode_step_s_p50": step, "decode_step_s_p99": _q(decode, 0.99),
           "decode_tokens_per_s": batch / step if step else None, "wall_s": wall,
           "prefix_hit_rate": engine.cache.stats()["prefix_hit_rate"]}
    if device == "cuda":
        res["roofline"] = _roofline(model, engine, batch, prefix_len + suffix_len / 2 + max_tokens / 2, step)
    return res
