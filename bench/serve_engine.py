"""Decode throughput of the engine alone (no HTTP) against the memory-bandwidth roofline.

    python -m bench.serve_engine --device cuda --dtype bfloat16 --preset flash \\
        --set num_hidden_layers=4 --set 'compress_ratios=[0,0,4,128]' --set n_routed_experts=8 \\
        --set num_nextn_predict_layers=0 --out bench/results/serve_gpu_engine.json
"""

from __future__ import annotations

import random
import time

import torch

from bench.runner import write_result
from bench.serve import _config_from_args, _q, _roofline
from v4stack.config import ModelConfig
from v4stack.model import V4Model
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams


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


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="bench serve-engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--modes", default="fast")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--set", action="append", default=[], help="config override key=json-value")
    ap.add_argument("--out", default="bench/results/serve_engine_cpu_tiny.json")
    a = ap.parse_args(argv)
    cfg, over = _config_from_args(a)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    runs = []
    for mode in a.modes.split(","):
        for b in map(int, a.batches.split(",")):
            r = bench_engine(cfg, batch=b, device=a.device, dtype=dt, ops_mode=mode, max_tokens=a.max_tokens,
                             n_blocks=max(512, 8 * b))
            runs.append(r)
            roof = r.get("roofline", {})
            print(f"{mode:<9} batch {b:>3}: decode step p50 {r['decode_step_s_p50'] * 1e3:8.2f} ms, "
                  f"{r['decode_tokens_per_s']:9.1f} tok/s"
                  + (f", roofline {roof['decode_tokens_per_s_roofline']:9.1f} tok/s "
                     f"({100 * roof['fraction_of_roofline']:.1f}%)" if roof else ""), flush=True)
    write_result(a.out, {"overrides": over, "preset": a.preset, "runs": runs})


if __name__ == "__main__":
    main()
