"""Muon (V4 split: Muon on matrices, AdamW on the rest) vs AdamW alone, same data, same budget.

Both runs see the same byte batches in the same order for the same number of steps (so the same
tokens); each optimizer gets a small learning-rate sweep and the best final validation loss is
kept, so neither side is judged at a rate chosen for the other.

    python -m bench.muon_vs_adamw [--steps 300] [--device cuda] [--jobs 6]

``--jobs N`` runs the sweep's configurations as N parallel processes (each one is a plain
single-process training run; they share nothing but the machine).

Writes bench/results/muon_vs_adamw.json and bench/results/train_muon_vs_adamw.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.runner import write_result
from v4stack.train.log import LossLog, plot_curves
from v4stack.train.trainer import TrainConfig, train

RESULTS = Path(__file__).resolve().parent / "results"


def run(opt: str, lr: float, args, workdir: Path) -> dict:
    out = workdir / f"{opt}_{lr:g}"
    cfg = TrainConfig(preset="tiny", out=str(out), steps=args.steps, batch_size=args.batch_size,
                      seq_len=args.seq_len, optimizer=opt, warmup=args.warmup, ckpt_every=args.steps,
                      eval_batches=8, seed=args.seed, device=args.device, progress=False,
                      threads=args.threads, muon_lr=lr if opt == "muon" else 0.02,
                      adamw_lr=args.adamw_lr_for_muon if opt == "muon" else lr)
    t = time.perf_counter()
    summary = train(cfg)
    doc = LossLog.read(out / "loss.json")
    return {"optimizer": opt, "lr": lr, "summary": summary, "wall_s": round(time.perf_counter() - t, 1),
            "curve": [(r["step"], r["loss"]) for r in doc["records"]]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--muon-lrs", default="0.01,0.02,0.04")
    ap.add_argument("--adamw-lrs", default="0.001,0.003,0.01")
    ap.add_argument("--adamw-lr-for-muon", type=float, default=3e-3,
                    help="AdamW rate of the non-matrix parameters inside the Muon runs")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--single", nargs=3, metavar=("OPT", "LR", "RESULT"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    if args.single:  # one configuration, as a worker of --jobs
        opt, lr, result = args.single
        with tempfile.TemporaryDirectory() as tmp:
            r = run(opt, float(lr), args, Path(tmp))
        Path(result).write_text(json.dumps(r))
        return

    configs = [(opt, float(x)) for opt, lrs in (("muon", args.muon_lrs), ("adamw", args.adamw_lrs))
               for x in lrs.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        pending = list(enumerate(configs))
        live: list[tuple[subprocess.Popen, Path]] = []
        passthrough = list(sys.argv[1:] if argv is None else argv)
        while pending or live:
            while pending and len(live) < max(args.jobs, 1):
                i, (opt, lr) = pending.pop(0)
                res = Path(tmp) / f"run{i}.json"
                cmd = [sys.executable, "-m", "bench.muon_vs_adamw", *passthrough, "--single", opt, str(lr), str(res)]
                live.append((subprocess.Popen(cmd), res))
            proc, res = live.pop(0)
            if proc.wait() != 0:
                raise SystemExit(f"run {res.name} failed with exit code {proc.returncode}")
            r = json.loads(res.read_text())
            print(f"{r['optimizer']:<6} lr {r['lr']:<6g} final {r['summary']['final_loss']:.4f} "
                  f"val {r['summary']['val_loss']:.4f} ({r['wall_s']}s)", flush=True)
            runs.append(r)
    best = {opt: min((r for r in runs if r["optimizer"] == opt), key=lambda r: r["summary"]["val_loss"])
            for opt in ("muon", "adamw")}
    unigram = runs[0]["summary"]["unigram_nats"]
    doc = {
        "bench": "muon_vs_adamw", "preset": "tiny", "steps": args.steps,
        "tokens": runs[0]["summary"]["tokens"], "batch_size": args.batch_size, "seq_len": args.seq_len,
        "device": args.device, "torch": torch.__version__, "host": platform.node(),
        "unigram_nats": unigram,
        "best": {opt: {"lr": r["lr"], "final_loss": r["summary"]["final_loss"],
                       "val_loss": r["summary"]["val_loss"]} for opt, r in best.items()},
        "sweep": [{"optimizer": r["optimizer"], "lr": r["lr"], "final_loss": r["summary"]["final_loss"],
                   "val_loss": r["summary"]["val_loss"], "wall_s": r["wall_s"]} for r in runs],
        "curves": {f"{opt} lr={r['lr']:g}": r["curve"] for opt, r in best.items()},
        "command": "python -m bench.muon_vs_adamw " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "single")),
    }
    out = Path(args.out)
    write_result(out / "muon_vs_adamw.json", doc)
    plot_curves(doc["curves"], out / "train_muon_vs_adamw.png",
                f"tiny preset, {args.steps} steps x {args.batch_size}x{args.seq_len} bytes", baseline=unigram)
    print(json.dumps(doc["best"]))


if __name__ == "__main__":
    main()
