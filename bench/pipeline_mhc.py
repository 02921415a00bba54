"""What mHC costs a pipeline: the 1F1B step time of a model with ``hc_mult`` residual streams
against the same model with one stream (a plain residual of the same width, gated), on ``pp``
ranks (one GPU each, NCCL), plus a determinism check of the gradients on one device.

    torchrun --nproc-per-node 2 -m bench.pipeline_mhc --device cuda \\
        --out bench/results/pipeline_mhc_h200x2.json
    torchrun --nproc-per-node 2 -m bench.pipeline_mhc --preset tiny --seq-len 64    # CPU, gloo

Per configuration: the step's forwards and backwards over ``micro`` micro-batches (no optimizer
step), timed from a barrier to a barrier on every rank, median over ``steps`` after ``warmup``;
the bytes one boundary carries per micro-batch; and the overhead ``t(hc) / t(1) - 1``.
The determinism check runs a 2-layer slice twice on the same batch (gradients must be bitwise
equal) and once with the batch's sequences in reverse order (reported, not required).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from v4stack.config import ModelConfig, preset
from v4stack.model import V4Model
from v4stack.train.mesh import build_mesh
from v4stack.train.pipeline import Stage, lm_loss, run_1f1b

FLASH_SLICE = {"num_hidden_layers": 4, "compress_ratios": [0, 0, 4, 128], "n_routed_experts": 8,
               "num_nextn_predict_layers": 0}


def _config(name: str, hc: int, over: dict) -> ModelConfig:
    base = preset(name).to_dict()
    extra = FLASH_SLICE if name == "flash" else {"num_nextn_predict_layers": 0,
                                                 "compress_ratios": base["compress_ratios"][:-1]}
    return ModelConfig.from_dict({**base, **extra, **over, "hc_mult": hc})


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def _materialise(model: V4Model, stage: Stage, dev) -> None:
    """Only the stage's own weights, drawn on the device at the init's scales (timing needs no
    particular values, only finite ones of realistic magnitude); the rest stay empty."""
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        t = torch.empty(p.shape if stage.owns(name) else (0,), device=dev)
        if not stage.owns(name):
            pass
        elif name.endswith("norm.weight"):
            t.fill_(1.0)
        elif leaf.endswith("_scale"):
            t.uniform_(0.2, 0.4)
        elif leaf.endswith("_base") or leaf in ("attn_sink", "ape") or name.endswith("gate.bias"):
            t.normal_(0.0, 0.1)
        else:
            t.normal_(0.0, p.shape[-1] ** -0.5)
        p.data = t
    for name, b in list(model.named_buffers()):
        parent, leaf = name.rsplit(".", 1)
        if stage.owns(name) and b.dtype in (torch.int32, torch.int64):
            new = torch.randint(0, model.cfg.n_routed_experts, b.shape, device=dev, dtype=b.dtype)
        else:
            new = torch.zeros(b.shape if stage.owns(name) else (0,), device=dev, dtype=b.dtype)
        model.get_submodule(parent)._buffers[leaf] = new


def time_pipeline(cfg: ModelConfig, dev, dtype, micro: int, batch: int, seq: int, steps: int, warmup: int) -> dict:
    mesh = build_mesh(dist.get_world_size())
    model = V4Model(cfg, seed=None)  # uninitialised host memory: only the stage's part is drawn
    stage = Stage.build(model, mesh, mtp=False)
    _materialise(model, stage, dev)
    model.cast(dtype)
    stage.stream_dtype = model.embed.weight.dtype
    g = torch.Generator().manual_seed(1)
    mbs = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(dev) for _ in range(micro)]
    times = []
    for i in range(warmup + steps):
        _sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        run_1f1b(stage, mbs, 0.0, 1.0 / micro)
        _sync(dev)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        for p in model.parameters():
            p.grad = None
    elem = torch.empty(0, dtype=stage.stream_dtype).element_size()
    return {"hc_mult": cfg.hc_mult, "step_s_p50": statistics.median(times), "step_s_all": times,
            "boundary_bytes_per_micro": batch * seq * cfg.hc_mult * cfg.hidden_size * elem,
            "stage_layers": [list(r) for r in [stage.layers]]}


def determinism(cfg: ModelConfig, dev, dtype, batch: int, seq: int) -> dict:
    cfg = ModelConfig.from_dict({**cfg.to_dict(), "num_hidden_layers": 2, "num_hash_layers": min(cfg.num_hash_layers, 1),
                                 "vocab_size": min(cfg.vocab_size, 8192),
                                 "compress_ratios": cfg.compress_ratios[:2]})
    model = V4Model(cfg, seed=0).cast(dtype).to(dev)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(dev)

    def grads(t: torch.Tensor) -> dict:
        for p in model.parameters():
            p.grad = None
        lm_loss(model(t), None, t)[0].backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    a, b, r = grads(tokens), grads(tokens), grads(tokens.flip(0))
    differ = sorted(n for n in a if not torch.equal(a[n], b[n]))
    differ_order = sorted(n for n in a if not torch.equal(a[n], r[n]))
    return {"tensors": len(a), "differ_between_two_runs": len(differ), "examples": differ[:5],
            "differ_with_reversed_batch_order": len(differ_order), "examples_order": differ_order[:5]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench pipeline-mhc", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hc", type=int, nargs="+", default=[4, 1])
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="config override key=json-value")
    ap.add_argument("--out", default="bench/results/pipeline_mhc.json")
    a = ap.parse_args(argv)
    over = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[a.dtype]
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dev = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    rows = [time_pipeline(_config(a.preset, hc, over), dev, dtype, a.micro, a.batch, a.seq_len, a.steps, a.warmup)
            for hc in a.hc]
    det = determinism(_config(a.preset, a.hc[0], over), dev, dtype, 2, min(a.seq_len, 512)) \
        if dist.get_rank() == 0 else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        per_hc = {}
        for ranks_rows in zip(*gathered):  # the step time is the slowest stage's
            per_hc[ranks_rows[0]["hc_mult"]] = {"step_s_p50": max(r["step_s_p50"] for r in ranks_rows),
                                                "boundary_bytes_per_micro": ranks_rows[0]["boundary_bytes_per_micro"],
                                                "per_stage": ranks_rows}
        base = per_hc.get(1)
        for hc, v in per_hc.items():
            v["overhead_vs_one_stream"] = (v["step_s_p50"] / base["step_s_p50"] - 1) if base else None
        from bench.runner import write_result

        write_result(a.out, {"preset": a.preset, "overrides": over, "pp": dist.get_world_size(), "micro": a.micro,
                             "batch": a.batch, "seq_len": a.seq_len, "dtype": a.dtype, "results": per_hc,
                             "gradient_determinism": det})
        print(json.dumps({hc: {k: v[k] for k in ("step_s_p50", "overhead_vs_one_stream")}
                          for hc, v in per_hc.items()}), json.dumps(det))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
