"""The price of `--grad-chunks`: seconds per micro-batch (forward + backward) on one CPU process.

    python -m bench.grad_chunks [--seq-len 64] [--batch-size 2] [--units 8 16] [--repeats 3]

Tiny preset, invariant ops, MTP loss on (weight 0.3). ``plain``: the trainer's one-process path
(``lm_losses`` then backward). ``chunks_U``: the same micro-batch under ``--grad-chunks U`` (unit
pieces and chunk-ordered gradients, ``train/unit_shard.py``, one process = cp 1). Each variant
runs once untimed, then ``--repeats`` timed runs; the median is reported. Writes
bench/results/grad_chunks.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.runner import write_result
from v4stack import ops
from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.train.chunk_grads import ChunkGrads
from v4stack.train.mesh import Mesh
from v4stack.train.trainer import lm_losses
from v4stack.train.unit_shard import chunked_accumulate

RESULTS = Path(__file__).resolve().parent / "results"


def _plain(model, tokens, w):
    main, extra = lm_losses(model, tokens, True)
    (main + w * extra).backward()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--units", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokens = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(0))
    variants = {"plain": None, **{f"chunks_{u}": u for u in args.units}}
    rows = {}
    with ops.mode("invariant"):
        for name, units in variants.items():
            model = V4Model(preset("tiny"), seed=0)
            hook = ChunkGrads(dict(model.named_parameters()), units) if units else None
            times = []
            for r in range(args.repeats + 1):
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                if hook is None:
                    _plain(model, tokens, 0.3)
                else:
                    chunked_accumulate(model, hook, [tokens], 1.0, Mesh(0, 1, 1, 1), 0.3)
                if r:
                    times.append(time.perf_counter() - t0)
            rows[name] = {"seconds_median": statistics.median(times), "seconds": times}
            print(name, rows[name]["seconds_median"], flush=True)
    base = rows["plain"]["seconds_median"]
    for v in rows.values():
        v["vs_plain"] = v["seconds_median"] / base
    doc = {"bench": "grad_chunks", "preset": "tiny", "ops": "invariant", "mtp_weight": 0.3,
           "seq_len": args.seq_len, "batch_size": args.batch_size, "threads": args.threads,
           "repeats": args.repeats, "variants": rows,
           "command": "python -m bench.grad_chunks " + " ".join(
               f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
               for k, v in vars(args).items() if k != "out")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "grad_chunks.json", doc)


if __name__ == "__main__":
    main()
