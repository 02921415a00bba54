"""The whole-model check on one GPU, alone: one model build shared by both modes, then

- decode step time in each ops mode through the serving engine (decode steps replay CUDA graphs,
  as served): ``decode[mode]``, and ``decode_ratio`` = invariant / fast per batch size;
- ``v4stack.check.check_invariance`` in invariant mode and in fast mode (the control), each with
  its wall time per phase; if invariant mode differs, one CUDA kernel family at a time is taken
  off the dispatch table to find the culprit;
- ``mixed_rope`` (a phase to ask for): invariant mode with the copying rotations on their torch
  compositions and the in-place one on its kernel - the control that shows the check catches two
  implementations of one op whose bits differ serving the paged and the reference paths.

The JSON is rewritten after every phase, so a run cut short keeps what it measured.

    python -m bench.model_check --preset flash --set num_hidden_layers=4 \\
        --set 'compress_ratios=[0,0,4,128]' --set n_routed_experts=8 --set num_nextn_predict_layers=0 \\
        --prompts 8 --out bench/results/model_invariance_flash4_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
import traceback

import torch

from bench.runner import write_result
from v4stack import check, ops

BISECT = ("none", "linear", "grouped_linear", "sparse_attention", "attention_with_sink", "indexer_scores", "hc_mix",
          "rms_norm", "softmax", "hc_read", "hc_read_norm", "hc_head_pre", "hc_write", "weighted_pool", "moe_combine")


@contextlib.contextmanager
def without_cuda_kernels(op: str):
    """The table with ``op``'s CUDA kernels taken off (its torch references serve), for one block."""
    from v4stack.ops import dispatch

    saved = {k: v for k, v in dispatch._table.items() if k[0] == op and k[3] == "cuda"}
    for k in saved:
        del dispatch._table[k]
    dispatch._resolved.clear()
    try:
        yield
    finally:
        dispatch._table.update(saved)
        dispatch._resolved.clear()


def decode_time(model, mode: str, batch: int, prompt_len: int = 16, steps: int = 12, seed: int = 0) -> dict:
    """Seconds per decode step of ``batch`` requests through the engine in ops mode ``mode`` (device
    synchronised around each step; the first two decode steps, which capture, left out)."""
    from v4stack.serve.engine import Engine, EngineConfig
    from v4stack.serve.sampling import SamplingParams

    sync = torch.cuda.synchronize if model.embed.weight.is_cuda else (lambda: None)
    eng = Engine(model, EngineConfig(n_blocks=512, n_slots=batch, max_running=batch,
                                     token_budget=max(256, batch * prompt_len), ops_mode=mode))
    rng = random.Random(seed)
    sp = SamplingParams(max_tokens=steps + 3, ignore_eos=True)
    for _ in range(batch):
        eng.add_request([rng.randrange(model.cfg.vocab_size) for _ in range(prompt_len)], sp)
    times = []
    while eng.has_work():
        run = eng.scheduler.running
        decode = not eng.scheduler.waiting and len(run) == batch and all(r.pending <= 1 and r.cache is not None
                                                                         for r in run)
        sync()
        t0 = time.perf_counter()
        eng.step()
        sync()
        if decode:
            times.append(time.perf_counter() - t0)
    g = eng.runner.graphs
    kept = times[2:] or times
    return {"mode": mode, "batch": batch, "prompt_len": prompt_len, "decode_steps": len(kept),
            "decode_step_s_p50": statistics.median(kept) if kept else None,
            "decode_step_s_min": min(kept) if kept else None,
            "graph_replays": g.replays if g is not None else 0, "graph_error": (g.error or "")[-300:] if g else None}


@contextlib.contextmanager
def mixed_rope():
    """The copying rotations (``rope``, ``rope_into``) served by their torch compositions while the
    in-place one keeps its kernel, for one block: the state the tree was in from be8757e to 8813765,
    when the light launcher refused the copying forms' calls. The kernel's rotation and the
    composition's differ in the last bit, and the engine's paged steps rotate in place while the
    reference path copies - so this is the control that shows the check catches such a mix."""
    with without_cuda_kernels("rope"), without_cuda_kernels("rope_into"):
        yield


def main(argv: list[str] | None = None, meta: dict | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--set", action="append", default=[], help="model config override key=json-value")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--decode-batches", default="8", help="comma list of engine batch sizes for the decode timing")
    p.add_argument("--decode-steps", type=int, default=12, help="decode steps timed per mode (after 2 left out)")
    p.add_argument("--phases", default="decode,invariant,fast", help="comma list, run in this order")
    p.add_argument("--bisect-budget-s", type=float, default=150.0)
    p.add_argument("--act-rounding", action="store_true",
                   help="the model runs V4's activation rounding (model/quant.py), as a released checkpoint loads: the "
                        "serving path then keeps its indexer keys packed (EngineConfig.index_keys auto)")
    p.add_argument("--out", default="bench/results/model_invariance_tiny_h200.json")
    a = p.parse_args(argv)
    over = {k: json.loads(v) for k, v in (x.split("=", 1) for x in a.set)}
    dev_name = torch.cuda.get_device_name() if torch.device(a.device).type == "cuda" else "cpu"
    rep: dict = {"seconds": {}}
    payload = {**(meta or {}), "bench": "model_invariance", "preset": a.preset, "overrides": over, "dtype": a.dtype,
               "device_name": dev_name, "prompts": a.prompts, "act_rounding": a.act_rounding, "results": rep}
    t0 = time.time()
    model = check.build_model(a.preset, a.dtype, a.device, 0, over, a.act_rounding)
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    rep["seconds"]["build"] = round(time.time() - t0, 1)
    print("model built", rep["seconds"]["build"], "s", flush=True)
    for phase in a.phases.split(","):
        t1 = time.time()
        if phase == "decode":
            rep["decode"] = {}
            for m in ("invariant", "fast"):
                for b in map(int, a.decode_batches.split(",")):
                    try:
                        with torch.no_grad():
                            rep["decode"][f"{m}_b{b}"] = decode_time(model, m, b, steps=a.decode_steps)
                    except Exception as e:
                        rep["decode"][f"{m}_b{b}"] = {"error": repr(e)[:500]}
                        traceback.print_exc()
                    print("decode", m, b, rep["decode"][f"{m}_b{b}"], flush=True)
            rep["decode_ratio"] = {}
            for b in map(int, a.decode_batches.split(",")):
                i, f = rep["decode"][f"invariant_b{b}"], rep["decode"][f"fast_b{b}"]
                if i.get("decode_step_s_p50") and f.get("decode_step_s_p50"):
                    rep["decode_ratio"][str(b)] = i["decode_step_s_p50"] / f["decode_step_s_p50"]
        elif phase in ("invariant", "fast", "mixed_rope"):
            ops.reset_counters()
            try:
                with mixed_rope() if phase == "mixed_rope" else contextlib.nullcontext():
                    r = check.check_invariance(preset=a.preset, prompts=a.prompts,
                                               mode="fast" if phase == "fast" else "invariant",
                                               batch_sizes=(max(1, a.prompts // 2), a.prompts), model=model)
                rep[phase] = {k: v for k, v in r.items() if isinstance(v, (int, float, bool, str, dict))}
            except Exception as e:
                rep[phase] = {"error": repr(e)[:500]}
                traceback.print_exc()
            rep[phase]["served"] = ops.counters()
            print("model", phase, {k: v for k, v in rep[phase].items() if k != "served"}, flush=True)
            if phase == "invariant" and rep[phase].get("invariant") is False:
                rep["without"] = {}
                for op in BISECT:  # find the kernel family: take one off the table at a time
                    with without_cuda_kernels(op):
                        r = check.check_invariance(preset=a.preset, prompts=min(8, a.prompts), mode="invariant",
                                                   batch_sizes=(4, 8), model=model)
                    rep["without"][op] = {k: r[k] for k in ("steps_compared", "steps_differ", "invariant",
                                                            "chunking_invariant")}
                    print("model invariant without", op, rep["without"][op], flush=True)
                    if time.time() - t1 > a.bisect_budget_s:
                        break
        else:
            raise SystemExit(f"--phases: unknown phase {phase!r} (decode, invariant, fast, mixed_rope)")
        rep["seconds"][phase] = round(time.time() - t1, 1)
        write_result(a.out, payload)
    inv, fast = rep.get("invariant", {}), rep.get("fast", {})
    rep["must_show"] = {"invariant_steps_differ": inv.get("steps_differ"), "fast_steps_differ": fast.get("steps_differ"),
                        "mixed_rope_steps_differ": rep.get("mixed_rope", {}).get("steps_differ"),
                        "decode_ratio_le_1_3": (all(v <= 1.3 for v in rep["decode_ratio"].values())
                                               if rep.get("decode_ratio") else None)}
    write_result(a.out, payload)
    print("model done", round(time.time() - t0, 1), "s", rep["must_show"], flush=True)
    return payload


if __name__ == "__main__":
    main()
