"""`v4stack bench serve` / `python -m bench.serve`: N concurrent streaming clients with a shared-prefix
workload against a real `v4stack serve` process; the load generator runs here, in another process
(its own interpreter and GIL), so the client's work does not slow the server down; writes JSON.

Reported: output tokens/s, requests/s, TTFT and inter-token latency p50 / p99 client side (from the
SSE stream) and server side (the server's /metrics histograms: the upper bound of the bucket holding
the quantile), prefix hit rate. The engine alone, with a decode roofline on CUDA, is
`bench serve-engine`.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import torch

from bench.runner import write_result
from v4stack.config import ModelConfig
from v4stack.serve.engine import Engine


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


def matmul_rate(device: str, n: int = 8192) -> float | None:
    """FLOP/s of a large bf16 matrix product (``n`` cubed), the device's dense rate as measured."""
    if device != "cuda":
        return None
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for _ in range(10):
        a @ b
    ev1.record()
    torch.cuda.synchronize()
    return 10 * 2 * n ** 3 / (ev0.elapsed_time(ev1) / 1e3)


async def _client(c, model: str, prompt: list[int], max_tokens: int, out: list):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    times = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    out.append((t0, times))


def _scrape(base: str) -> dict:
    """Counters and histogram buckets of the server's /metrics."""
    import httpx

    vals: dict = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        k, v = line.rsplit(" ", 1)
        vals[k] = float(v)
    return vals


def _hist_q(before: dict, after: dict, name: str, q: float) -> float | None:
    """Quantile ``q`` of histogram ``name`` over the observations between two scrapes."""
    pre = f"{name}_bucket{{le=\""
    rows = sorted(((float("inf") if k[len(pre):-2] == "+Inf" else float(k[len(pre):-2]), v - before.get(k, 0.0))
                   for k, v in after.items() if k.startswith(pre)))
    total = rows[-1][1] if rows else 0
    if not total:
        return None
    for bound, cum in rows:
        if cum >= q * total:
            return bound
    return None


def _serve_child(spec: str) -> None:
    """The server process: the config (with overrides) is rebuilt here from ``spec`` (JSON)."""
    from v4stack.config import ModelConfig
    from v4stack.serve.engine import EngineConfig
    from v4stack.serve.limits import ServerOptions
    from v4stack.serve.server import serve

    d = json.loads(spec)
    cfg = ModelConfig.from_dict(d["config"])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[d["dtype"]]
    ecfg = EngineConfig(n_blocks=d["n_blocks"], n_slots=d["clients"], max_running=d["clients"],
                        token_budget=max(256, d["clients"]), ops_mode=d["ops_mode"])
    serve(cfg, None, "bench", "127.0.0.1", d["port"], ecfg, seed=d["seed"], dtype=dtype, device=d["device"],
          options=ServerOptions(max_queue=max(256, d["requests"])))


def bench_serve(cfg: ModelConfig, *, clients: int = 16, requests: int = 64, prefixes: int = 4,
                prefix_len: int = 64, suffix_len: int = 16, max_tokens: int = 16, device: str = "cpu",
                dtype: torch.dtype = torch.float32, ops_mode: str = "invariant", n_blocks: int = 512,
                seed: int = 0, out: str | None = None, label: str = "") -> dict:
    import subprocess
    import sys

    import httpx

    port = _port()
    spec = json.dumps({"config": cfg.to_dict(), "dtype": str(dtype).replace("torch.", ""), "n_blocks": n_blocks,
                       "clients": clients, "requests": requests, "ops_mode": ops_mode, "port": port, "seed": seed,
                       "device": device})
    proc = subprocess.Popen([sys.executable, "-c", f"import bench.serve as b; b._serve_child({spec!r})"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"bench server exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
            if time.time() > deadline:
                raise RuntimeError("bench server did not come up")
        rng = random.Random(seed)
        heads = [[rng.randrange(256) for _ in range(prefix_len)] for _ in range(prefixes)]
        work = [rng.choice(heads) + [rng.randrange(256) for _ in range(rng.randrange(1, suffix_len + 1))]
                for _ in range(requests)]
        results: list = []

        async def drive():
            sem = asyncio.Semaphore(clients)
            async with httpx.AsyncClient(base_url=base, timeout=None,
                                         limits=httpx.Limits(max_connections=clients)) as c:
                async def one(p):
                    async with sem:
                        await _client(c, "bench", p, max_tokens, results)

                await asyncio.gather(*(one(p) for p in work))

        before = _scrape(base)
        t0 = time.perf_counter()
        asyncio.run(drive())
        wall = time.perf_counter() - t0
        after = _scrape(base)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    lab = '{model_name="bench"}'
    n_out = after[f"vllm:generation_tokens_total{lab}"] - before[f"vllm:generation_tokens_total{lab}"]
    ttft_client = [ts[0] - s for s, ts in results if ts]
    itl_client = [b - a for _, ts in results for a, b in zip(ts, ts[1:])]
    hits = after[f"vllm:prefix_cache_hits_total{lab}"] - before[f"vllm:prefix_cache_hits_total{lab}"]
    queries = after[f"vllm:prefix_cache_queries_total{lab}"] - before[f"vllm:prefix_cache_queries_total{lab}"]
    res = {
        "label": label, "device": device, "dtype": str(dtype).replace("torch.", ""), "ops_mode": ops_mode,
        "client": "separate process (httpx, asyncio)",
        "config": {"hidden_size": cfg.hidden_size, "layers": cfg.num_hidden_layers, "experts": cfg.n_routed_experts},
        "workload": {"clients": clients, "requests": requests, "prefixes": prefixes, "prefix_len": prefix_len,
                     "suffix_len_max": suffix_len, "max_tokens": max_tokens},
        "wall_s": wall,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / wall,
        "requests_per_s": requests / wall,
        "ttft_s": {"client_p50": _q(ttft_client, .5), "client_p99": _q(ttft_client, .99),
                   "server_p50_bucket": _hist_q(before, after, "v4stack_time_to_first_token_seconds", .5),
                   "server_p99_bucket": _hist_q(before, after, "v4stack_time_to_first_token_seconds", .99)},
        "itl_s": {"client_p50": _q(itl_client, .5), "client_p99": _q(itl_client, .99),
                  "server_p50_bucket": _hist_q(before, after, "v4stack_inter_token_latency_seconds", .5),
                  "server_p99_bucket": _hist_q(before, after, "v4stack_inter_token_latency_seconds", .99)},
        "queue_s": {"server_p50_bucket": _hist_q(before, after, "v4stack_request_queue_time_seconds", .5)},
        "prefix_hit_rate": hits / queries if queries else 0.0,
    }
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
        print(f"{r['label']:<28} {r['output_tokens_per_s']:8.1f} tok/s  TTFT p50 {r['ttft_s']['client_p50']:.3f}s "
              f"ITL p50 {r['itl_s']['client_p50']:.3f}s  hit {r['prefix_hit_rate']:.2f}")
    if "invariant_over_fast_throughput" in summary:
        print(f"invariant / fast throughput: {summary['invariant_over_fast_throughput']:.2f}")


if __name__ == "__main__":
    main()
