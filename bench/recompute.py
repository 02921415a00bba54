"""Peak memory against step time and recomputed FLOPs: the recompute planner at several budgets and
at the memory of each torch selective-checkpoint policy, next to no recompute, whole-block
recompute and torch's selective checkpointing (save nothing / matmuls / matmuls + softmax, top-k,
sort / every computing op).

    python -m bench.recompute --device cuda --out bench/results/recompute_h200.json   # 2-layer V4-Flash width
    python -m bench.recompute --preset tiny --seq-len 64 --dtype float32 --threads 1   # CPU dry run

On CUDA the memory is measured (peak allocated during forward + backward, over what was allocated
before); everywhere the plans' own accounting is reported too (bytes cached, FLOPs and ops the
recompute runs again). Each block gets its own plan. ``same_memory`` compares, at equal memory,
the planner against torch's policies: pairwise (the planner given the bytes the policy caches) and
against the torch curve interpolated at the planner's measured peak. Gradients of every row are
compared bit for bit with the plain backward's (``grads_equal_none``; the ``none`` row compares
two plain runs: the control). ``counted_recompute_flops``: what was really recomputed - the FLOPs
torch's ``FlopCounterMode`` counts in one more (untimed) forward + backward, minus the plain run's
(the ops it has formulas for: matmuls, attention, convolutions); the planner's ``stats`` include
that call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from v4stack.config import ModelConfig, preset
from v4stack.model import V4Model
from v4stack.train.pipeline import lm_loss
from v4stack.train.recompute import (SAC_VARIANTS, Checkpointed, as_run, make_plan, policy_plan, sac_policy,
                                     trace_layers)
from v4stack.train.recompute_trace import candidates

FLASH_2 = {"num_hidden_layers": 2, "compress_ratios": [4, 128], "n_routed_experts": 8,
           "num_nextn_predict_layers": 0, "num_hash_layers": 1}


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _measure(model, tokens, dev, reps: int, ref: list | None) -> tuple[dict, list]:
    times, peaks, grads = [], [], None
    for i in range(reps + 1):
        for p in model.parameters():
            p.grad = None
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        t0 = time.perf_counter()
        lm_loss(model(tokens), None, tokens)[0].backward()
        _sync(dev)
        if i:
            times.append(time.perf_counter() - t0)
            if dev.type == "cuda":
                peaks.append(torch.cuda.max_memory_allocated(dev) - base)
        if i == 1 and ref is None:  # the control: a second plain run compared with this one
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    last = [p.grad for p in model.parameters() if p.grad is not None]
    flops = _counted_flops(model, tokens)
    same = ref is not None and len(ref) == len(last) and all(torch.equal(a, b) for a, b in zip(ref, last))
    if ref is None:
        same = len(grads) == len(last) and all(torch.equal(a, b) for a, b in zip(grads, last))
    return {"step_s_p50": statistics.median(times), "step_s": times, "counted_flops": flops,
            "peak_activation_bytes": max(peaks) if peaks else None, "grads_equal_none": same}, grads


def _counted_flops(model, tokens) -> int:
    """FLOPs torch's counter sees in one more forward + backward (matmuls, attention, convolutions:
    the ops it has formulas for), recomputation included; gradients restored afterwards."""
    from torch.utils.flop_counter import FlopCounterMode

    held = {p: p.grad for p in model.parameters()}
    for p in model.parameters():
        p.grad = None
    counter = FlopCounterMode(display=False)
    with counter:
        lm_loss(model(tokens), None, tokens)[0].backward()
    for p, g in held.items():
        p.grad = g
    return counter.get_total_flops()


def _interp(points: list[tuple[float, float]], x: float) -> float | None:
    """Piecewise-linear interpolation through ``points`` (by x), None outside their range."""
    pts = sorted(points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def same_memory(rows: list[dict]) -> dict:
    by = {r["policy"]: r for r in rows}
    pairs = []
    for name in SAC_VARIANTS:
        t, p = by.get(f"torch-sac-{name}"), by.get(f"planner@sac-{name}")
        if t and p:
            pairs.append({"torch": t["policy"], "planner": p["policy"],
                          **{f"{k}_{w}": r.get(k) for w, r in (("torch", t), ("planner", p))
                             for k in ("peak_activation_bytes", "step_s_p50", "planned_recompute_flops",
                                       "counted_recompute_flops", "planned_recompute_ops")}})
    torch_rows = [r for r in rows if r["policy"].startswith("torch-sac-") and r["peak_activation_bytes"]]
    curve = []
    for r in rows:
        if not r["policy"].startswith("planner") or not r["peak_activation_bytes"]:
            continue
        m = r["peak_activation_bytes"]
        t = _interp([(q["peak_activation_bytes"], q["step_s_p50"]) for q in torch_rows], m)
        f = _interp([(q["peak_activation_bytes"], q["planned_recompute_flops"]) for q in torch_rows], m)
        c = _interp([(q["peak_activation_bytes"], q["counted_recompute_flops"]) for q in torch_rows], m)
        curve.append({"planner": r["policy"], "peak_activation_bytes": m, "step_s_p50": r["step_s_p50"],
                      "torch_step_s_at_same_peak": t, "planned_recompute_flops": r["planned_recompute_flops"],
                      "torch_recompute_flops_at_same_peak": f,
                      "counted_recompute_flops": r["counted_recompute_flops"],
                      "torch_counted_recompute_flops_at_same_peak": c})
    return {"pairs": pairs, "against_torch_curve": curve}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench recompute", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budgets", default="0,0.05,0.2,0.5,1.0",
                    help="fractions of each block's cacheable bytes")
    ap.add_argument("--reps", type=int, default=5, help="timed steps per row (median; the H200 showed ~25%% spread)")
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads (0: torch's default; 1 makes CPU gradients bitwise repeatable)")
    ap.add_argument("--out", default="bench/results/recompute.json")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    cfg = preset(a.preset)
    if a.preset == "flash":
        cfg = ModelConfig.from_dict({**cfg.to_dict(), **FLASH_2})
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[a.dtype]
    model = V4Model(cfg, seed=0).cast(dtype).to(dev)
    tokens = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len), generator=torch.Generator().manual_seed(0)).to(dev)
    blocks = list(model.layers)
    ids = list(range(len(blocks)))
    traces = [trace_layers(model, (tokens,), ids)[i] for i in ids]
    cands = [candidates(t) for t in traces]

    from bench.runner import save_figure, write_result

    def result(rows):
        return {"preset": a.preset, "overrides": FLASH_2 if a.preset == "flash" else {}, "seq_len": a.seq_len,
                "batch": a.batch, "dtype": a.dtype, "reps": a.reps, "rows": rows,
                "ops_per_block": [len(t) for t in traces], "recompute_stop_per_block": [t.stop for t in traces],
                "autograd_saved_bytes_per_block": [t.saved_bytes for t in traces],
                "cacheable_bytes_per_block": [c.total_bytes for c in cands],
                "same_memory": same_memory(rows)}

    rows: list[dict] = []
    ref: list = []
    base: list[int] = []  # the plain run's counted FLOPs

    def run(name: str, contexts, plans) -> dict:
        nonlocal ref
        for i, b in enumerate(blocks):
            model.layers[i] = b if contexts is False else Checkpointed(b, contexts[i] if contexts else None)
        m, grads = _measure(model, tokens, dev, a.reps, None if name == "none" else ref)
        if name == "none":
            ref, base[:] = grads, [m["counted_flops"]]
        row = {"policy": name, **m, "counted_recompute_flops": m["counted_flops"] - base[0],
               "planned_saved_bytes": sum(p.saved_bytes for p in plans),
               "planned_recompute_flops": sum(p.recompute_flops for p in plans),
               "planned_recompute_ops": sum(p.recompute_ops for p in plans),
               "planned_recompute_s": sum(p.recompute_s for p in plans)}
        if name.startswith("planner"):
            row["planned_saves_per_block"] = [len(p.save) for p in plans]
            row["cached_per_block_call"] = [p.stats["cached"] / max(1, p.stats["calls"]) for p in plans]
            row["diverged_calls"] = sum(p.stats["diverged"] for p in plans)
            row["diverged_at_per_block"] = [p.stats["diverged_at"] for p in plans]
            ran = [as_run(p) for p in plans]  # what was really cached (less where a call left the trace)
            row["run_saved_bytes"] = sum(p.saved_bytes for p in ran)
            row["run_recompute_flops"] = sum(p.recompute_flops for p in ran)
            row["run_recompute_ops"] = sum(p.recompute_ops for p in ran)
        print(json.dumps({k: v for k, v in row.items() if k != "step_s"}), flush=True)
        rows.append(row)
        write_result(a.out, result(rows))  # after every row: a cut-off run keeps what it measured
        return row

    nothing = [policy_plan(t, SAC_VARIANTS["nothing"]) for t in traces]
    empty = [make_plan(t, 0) for t in traces]
    run("none", False, [])
    run("full", None, nothing)
    for name, keep in SAC_VARIANTS.items():
        sac = [policy_plan(t, keep) for t in traces]
        run(f"torch-sac-{name}", [sac_policy(keep) for _ in blocks], sac)
        plans = [make_plan(t, p.saved_bytes) for t, p in zip(traces, sac)]
        run(f"planner@sac-{name}", [p.contexts() for p in plans], plans)
        if name == "matmuls":  # the same plan through torch's own selective-checkpoint modes
            plans = [make_plan(t, p.saved_bytes) for t, p in zip(traces, sac)]
            run("planner@sac-matmuls-in-torch-modes", [p.torch_contexts() for p in plans], plans)
    for f in (float(x) for x in a.budgets.split(",")):
        plans = [make_plan(t, int(f * c.total_bytes)) for t, c in zip(traces, cands)] if f else empty
        run(f"planner@{f:g}", [p.contexts() for p in plans], plans)
    for i, b in enumerate(blocks):
        model.layers[i] = b
    if dev.type == "cuda":
        _plot(rows, a, save_figure)


def _plot(rows, a, save_figure) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, scale, label in ((axes[0], "step_s_p50", 1e3, "forward + backward (ms)"),
                                  (axes[1], "counted_recompute_flops", 1e-12,
                                   "recomputed TFLOPs per step (counted by torch)")):
        def pts(pred):
            return sorted((r["peak_activation_bytes"] / 2**30, r[key] * scale) for r in rows if pred(r["policy"]))
        sweep = pts(lambda n: n.startswith("planner@") and not n.startswith("planner@sac"))
        ax.plot(*zip(*sweep), "o-", label="planner (budget sweep)")
        ax.plot(*zip(*pts(lambda n: n.startswith("planner@sac") and "torch-modes" not in n)), "D",
                label="planner at each torch policy's bytes")
        ax.plot(*zip(*pts(lambda n: n.startswith("torch-sac-"))), "s--", label="torch selective checkpointing")
        for r in rows:
            if r["policy"] in ("none", "full") or "torch-modes" in r["policy"]:
                ax.plot(r["peak_activation_bytes"] / 2**30, r[key] * scale, "x", label=r["policy"])
        ax.set_xlabel("peak activation memory (GiB)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(f"recompute on a 2-layer {a.preset} slice, T={a.seq_len}")
    fig.tight_layout()
    save_figure(fig, a.out.replace(".json", ".png"))


if __name__ == "__main__":
    main()
