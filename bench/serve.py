"""`v4stack bench serve` / `python -m bench.serve`: N concurrent streaming clients with a shared-prefix workload against a
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

import torch

from bench.runner import write_result
from v4stack.config import ModelConfig
from v4stack.model import V4Model
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.runner import EngineRunner


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
        write_result(out, res)
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


def _config_from_args(a):
    from v4stack.config import ModelConfig, preset

    over = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
    if getattr(a, "hidden", None):
        over["hidden_size"] = a.hidden
    cfg = preset(a.preset)
    return (ModelConfig.from_dict({**cfg.to_dict(), **over}) if over else cfg), over


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="bench/results/serve_cpu_tiny.json")
    ap.add_argument("--modes", default="invariant,fast")
    ap.add_argument("--set", action="append", default=[], help="config override key=json-value")
    a = ap.parse_args(argv)
    cfg, over = _config_from_args(a)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    runs = [bench_serve(cfg, clients=a.clients, requests=a.requests, max_tokens=a.max_tokens, device=a.device,
                        dtype=dt, ops_mode=m, label=f"{a.preset}/{a.device}/{m}", out=None)
            for m in a.modes.split(",")]
    summary = {"overrides": over, "runs": runs}
    if len(runs) == 2:
        summary["invariant_over_fast_throughput"] = runs[0]["output_tokens_per_s"] / runs[1]["output_tokens_per_s"]
    write_result(a.out, summary)
    for r in runs:
        print(f"{r['label']:<28} {r['output_tokens_per_s']:8.1f} tok/s  TTFT p50 {r['ttft_s']['server_p50']:.3f}s "
              f"ITL p50 {r['itl_s']['server_p50']:.3f}s  hit {r['prefix_hit_rate']:.2f}")
    if "invariant_over_fast_throughput" in summary:
        print(f"invariant / fast throughput: {summary['invariant_over_fast_throughput']:.2f}")


if __name__ == "__main__":
    main()
