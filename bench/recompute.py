"""Peak activation memory against step time: the recompute planner at several budgets, next to
no recompute, whole-block recompute and torch's selective checkpointing (save every matmul).

    python -m bench.recompute --device cuda --out bench/results/recompute_h200.json   # 2-layer V4-Flash width
    python -m bench.recompute --preset tiny --seq-len 128                             # CPU: estimates only

On CUDA the memory is measured (peak allocated during forward + backward, over what was allocated
before); on the CPU only the planner's own accounting (bytes its cache holds) is reported. Each
block gets its own plan: a budget is a fraction of the bytes that saving every savable output of
that block would hold.
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
from v4stack.train.recompute import Checkpointed, make_plan, matmul_plan, profile, sac_matmul_policy

FLASH_2 = {"num_hidden_layers": 2, "compress_ratios": [4, 128], "n_routed_experts": 8,
           "num_nextn_predict_layers": 0, "num_hash_layers": 1}


class _Profiled(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block, self.records = block, None

    def forward(self, *args):
        self.records = profile(self.block, *args)
        return self.block(*args)


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _measure(model, tokens, dev, reps: int) -> dict:
    times, peaks = [], []
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
    return {"step_s_p50": statistics.median(times), "peak_activation_bytes": max(peaks) if peaks else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench recompute", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budgets", default="0,0.05,0.1,0.2,0.3,0.5,0.7,1.0")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--form", choices=("rule", "index"), default="rule",
                    help="how a plan runs: rule (decided per op from its output; robust to op-sequence "
                         "changes between torch versions) or index (the profiled op sequence, checked)")
    ap.add_argument("--out", default="bench/results/recompute.json")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    cfg = preset(a.preset)
    if a.preset == "flash":
        cfg = ModelConfig.from_dict({**cfg.to_dict(), **FLASH_2})
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[a.dtype]
    model = V4Model(cfg, seed=0).cast(dtype).to(dev)
    tokens = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len), generator=torch.Generator().manual_seed(0)).to(dev)
    blocks = list(model.layers)
    prof = [_Profiled(b) for b in blocks]
    for i, p in enumerate(prof):
        model.layers[i] = p
    lm_loss(model(tokens), None, tokens)[0].backward()  # one profiled forward (and a warm-up)
    records = [p.records for p in prof]

    from bench.runner import save_figure, write_result

    def form(plan):
        return plan.rule() if a.form == "rule" else plan.policy()

    def result(rows):
        return {"preset": a.preset, "overrides": FLASH_2 if a.preset == "flash" else {}, "seq_len": a.seq_len,
                "batch": a.batch, "dtype": a.dtype, "plan_form": a.form, "rows": rows,
                "ops_per_block": [len(r) for r in records]}

    rows = []

    def run(name: str, contexts, plans=None) -> dict:
        for i, b in enumerate(blocks):
            model.layers[i] = b if contexts is False else Checkpointed(b, contexts[i] if contexts else None)
        row = {"policy": name, **_measure(model, tokens, dev, a.reps)}
        if plans:
            row["planned_saved_bytes"] = sum(p.saved_bytes for p in plans)
            row["planned_recompute_cost"] = sum(p.recompute_cost for p in plans)
            if a.form == "rule" and name.startswith("planner"):  # the rule's decisions, summed over the forwards run
                row["rule_saved_ops"] = sum(p.rule_stats.get("saved", 0) for p in plans)
                row["rule_recomputed_ops"] = sum(p.rule_stats.get("recomputed", 0) for p in plans)
        print(json.dumps(row), flush=True)
        rows.append(row)
        write_result(a.out, result(rows))  # after every row: a cut-off run keeps what it measured
        return row

    run("none", False)
    run("full", None)
    mm = [matmul_plan(r) for r in records]
    run("torch-sac-matmuls", [sac_matmul_policy() for _ in blocks], mm)
    same_mem = [make_plan(r, p.saved_bytes) for r, p in zip(records, mm)]
    run("planner@torch-sac-memory", [form(p) for p in same_mem], same_mem)
    for f in (float(x) for x in a.budgets.split(",")):
        plans = [make_plan(r, int(f * make_plan(r, 1 << 62).full_bytes)) for r in records]
        run(f"planner@{f:g}", [form(p) for p in plans], plans)
    for i, b in enumerate(blocks):
        model.layers[i] = b
    if dev.type == "cuda":
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        pts = [(r["peak_activation_bytes"] / 2**30, r["step_s_p50"] * 1e3, r["policy"]) for r in rows]
        plan_pts = sorted((x, y) for x, y, n in pts if n.startswith("planner@") and "torch" not in n)
        ax.plot(*zip(*plan_pts), "o-", label="planner (budgets)")
        for x, y, n in pts:
            if not n.startswith("planner@") or "torch" in n:
                ax.plot(x, y, "s", label=n)
        ax.set_xlabel("peak activation memory (GiB)")
        ax.set_ylabel("forward + backward (ms)")
        ax.set_title(f"recompute on a 2-layer {a.preset} slice, T={a.seq_len}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        save_figure(fig, a.out.replace(".json", ".png"))


if __name__ == "__main__":
    main()
