"""MTP speculative decoding vs plain decoding on a trained model: accepted drafts per step,
tokens per step, decode time and speedup; the greedy tokens must be identical.

    python -m bench.spec_decode --ckpt DIR [--tokens 48] [--prompts 4] [--mode invariant] [--repeat 2]

``--ckpt``: a trainer checkpoint root (``v4stack train --out``; its newest step is used) or a
saved model directory. Prompts are 32-byte slices of the trainer's generated corpus drawn with a
seed the training run did not use. Writes bench/results/spec_decode_cpu_tiny.json.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from bench.runner import write_result
from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.model.weights import load_model
from v4stack.ops.mode import mode
from v4stack.serve.sampling import SamplingParams
from v4stack.serve.speculative import SpeculativeDecoder

RESULTS = Path(__file__).resolve().parent / "results"


def _load(path: Path) -> tuple[V4Model, dict]:
    if (path / "config.json").exists():
        return load_model(path).eval(), {"source": str(path)}
    from v4stack.train import checkpoint as ckpt  # a trainer run directory

    d = ckpt.latest(path / "ckpt" if (path / "ckpt").exists() else path)
    state, _, meta = ckpt.load(d, 0)
    model = V4Model(preset("tiny"), seed=None)
    model.load_state_dict(state["model"] if "model" in state else state)
    last = meta["records"][-1] if meta.get("records") else {}
    return model.float().eval(), {"source": str(d), "step": meta["step"], "last_record": last}


def plain_greedy(model: V4Model, prompts: list[list[int]], n: int, ops_mode: str) -> list[list[int]]:
    """One token per request per step, all requests in each step (the engine's decode)."""
    with torch.no_grad(), mode(ops_mode):
        states = [model.new_state() for _ in prompts]
        logits = model.step([(torch.tensor(p), s) for p, s in zip(prompts, states)])
        outs = [[int(torch.argmax(lg[-1]))] for lg in logits]
        while len(outs[0]) < n:
            logits = model.step([(torch.tensor(o[-1:]), s) for o, s in zip(outs, states)])
            for o, lg in zip(outs, logits):
                o.append(int(torch.argmax(lg[-1])))
    return outs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--mode", default="invariant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="interleaved runs of each; the minimum is kept")
    ap.add_argument("--out", default=str(RESULTS / "spec_decode_cpu_tiny.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, source = _load(Path(args.ckpt))
    from v4stack.train.corpus import generate_corpus

    text = generate_corpus(1 << 16, seed=12345).encode()
    rng = random.Random(0)
    prompts = [list(text[i : i + 32]) for i in (rng.randrange(len(text) - 32) for _ in range(args.prompts))]
    rows = []
    for batch in ([[p] for p in prompts] + [prompts]):
        plain_greedy(model, batch, 2, args.mode)  # warm up
        t_plain, t_spec = [], []
        for _ in range(args.repeat):  # interleaved, so load on a shared machine hits both alike
            t0 = time.perf_counter()
            ref = plain_greedy(model, batch, args.tokens, args.mode)
            t_plain.append(time.perf_counter() - t0)
            dec = SpeculativeDecoder(model, ops_mode=args.mode)
            t0 = time.perf_counter()
            out = dec.generate(batch, SamplingParams(max_tokens=args.tokens))
            t_spec.append(time.perf_counter() - t0)
        s = dec.stats
        rows.append({"batch": len(batch), "tokens_per_request": args.tokens, "identical": out == ref,
                     "verify_steps_per_request": s.steps / len(batch), "plain_steps_per_request": args.tokens,
                     "acceptance_rate": s.accepted / s.drafted, "tokens_per_step": s.tokens_per_step,
                     "s_plain": min(t_plain), "s_spec": min(t_spec), "speedup": min(t_plain) / min(t_spec),
                     "s_plain_all": t_plain, "s_spec_all": t_spec,
                     "sample": bytes(out[0][:24]).decode("utf-8", "replace")})
        print(json.dumps(rows[-1]))
    summary = {"all_identical": all(r["identical"] for r in rows),
               "mean_acceptance": sum(r["acceptance_rate"] for r in rows) / len(rows),
               "mean_speedup_single": sum(r["speedup"] for r in rows[:-1]) / max(1, len(rows) - 1),
               "speedup_batched": rows[-1]["speedup"]}
    write_result(args.out, {"bench": "spec_decode", "model": source, "ops_mode": args.mode,
                            "threads": args.threads, "rows": rows, "summary": summary})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
