"""Decode throughput of the engine alone (no HTTP) against the memory-bandwidth roofline.

    python bench/serve_engine.py --device cuda --dtype bfloat16 --preset flash \\
        --set num_hidden_layers=4 --set 'compress_ratios=[0,0,4,128]' --set n_routed_experts=8 \\
        --set num_nextn_predict_layers=0 --out bench/results/serve_gpu_engine.json
"""

import argparse
import json
from pathlib import Path

import torch

from v4stack.config import ModelConfig, preset
from v4stack.serve.bench import bench_engine

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="tiny")
ap.add_argument("--device", default="cpu")
ap.add_argument("--dtype", default="float32")
ap.add_argument("--batches", default="1,16,64")
ap.add_argument("--modes", default="fast")
ap.add_argument("--max-tokens", type=int, default=32)
ap.add_argument("--set", action="append", default=[], help="config override key=json-value")
ap.add_argument("--out", default="bench/results/serve_engine_cpu_tiny.json")
a = ap.parse_args()
over = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
cfg = ModelConfig.from_dict({**preset(a.preset).to_dict(), **over})
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
Path(a.out).parent.mkdir(parents=True, exist_ok=True)
Path(a.out).write_text(json.dumps({"overrides": over, "preset": a.preset, "runs": runs}, indent=2) + "\n")
