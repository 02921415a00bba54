"""`v4stack train --preset tiny` on the CPU for a few minutes: loss against the unigram baseline.

    python -m bench.train_tiny [--minutes 5] [--threads 2]

Writes bench/results/train_tiny.json (the run's loss log plus a summary) and train_tiny.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
from pathlib import Path

import torch

from bench.runner import write_result
from v4stack.train.log import LossLog
from v4stack.train.trainer import TrainConfig, train

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(preset="tiny", out=tmp, steps=args.steps, batch_size=args.batch_size,
                          seq_len=args.seq_len, max_minutes=args.minutes, threads=args.threads,
                          mtp_weight=args.mtp_weight, ckpt_every=25, eval_every=25, eval_batches=4)
        summary = train(cfg)
        doc = LossLog.read(Path(tmp) / "loss.json")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(tmp) / "loss.png", out / "train_tiny.png")
    doc["bench"] = "train_tiny"
    doc["host"] = {"node": platform.node(), "torch": torch.__version__, "threads": args.threads,
                   "device": "cpu"}
    doc["below_unigram_nats"] = summary["unigram_nats"] - summary["val_loss"]
    doc["command"] = "python -m bench.train_tiny " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
    write_result(out / "train_tiny.json", doc)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
