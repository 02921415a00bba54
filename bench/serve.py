"""Serving benchmark: the same shared-prefix workload in invariant and fast ops modes, side by side.

    python bench/serve.py [--device cuda --hidden 1024 --out bench/results/serve_gpu.json]
"""

import argparse
import json
from pathlib import Path

import torch

from v4stack.config import preset
from v4stack.serve.bench import bench_serve

ap = argparse.ArgumentParser()
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
a = ap.parse_args()
cfg = preset(a.preset)
over = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
if a.hidden:
    over["hidden_size"] = a.hidden
if over:
    from v4stack.config import ModelConfig

    cfg = ModelConfig.from_dict({**cfg.to_dict(), **over})
dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
runs = [bench_serve(cfg, clients=a.clients, requests=a.requests, max_tokens=a.max_tokens, device=a.device,
                    dtype=dt, ops_mode=m, label=f"{a.preset}/{a.device}/{m}") for m in a.modes.split(",")]
summary = {"overrides": over, "runs": runs}
if len(runs) == 2:
    summary["invariant_over_fast_throughput"] = runs[0]["output_tokens_per_s"] / runs[1]["output_tokens_per_s"]
Path(a.out).parent.mkdir(parents=True, exist_ok=True)
Path(a.out).write_text(json.dumps(summary, indent=2) + "\n")
for r in runs:
    print(f"{r['label']:<28} {r['output_tokens_per_s']:8.1f} tok/s  TTFT p50 {r['ttft_s']['server_p50']:.3f}s "
          f"ITL p50 {r['itl_s']['server_p50']:.3f}s  hit {r['prefix_hit_rate']:.2f}")
if "invariant_over_fast_throughput" in summary:
    print(f"invariant / fast throughput: {summary['invariant_over_fast_throughput']:.2f}")
for r in runs:
    if "roofline" in r:
        print(json.dumps(r["roofline"]))
