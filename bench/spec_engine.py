"""MTP speculative decoding through the serving engine vs the plain engine, end to end.

    # CPU: the loop's supervised tiny policy, its MTP block trained on the policy's own corpus
    python -m bench.spec_engine --ckpt RUN_DIR --mtp-steps 150 --tokens 48 --out ...
    # H200: V4-Flash widths (a few layers, random weights), bf16, fast mode
    python -m bench.spec_engine --preset flash --layers 4 --experts 16 --batch 8 --context 512 \
        --tokens 64 --oracle 0.7 --device cuda --out ...

Each configuration runs the same prompts through ``Engine`` (plain: CUDA graphs on and off where
CUDA is used; ``speculative="mtp"``) and times every ``engine.step()``. Decode steps are those
after every request has its first token; decode tok/s = tokens produced in them / their time.

``--mtp-steps N``: the checkpoint's trunk and head stay frozen (the policy's tokens do not change)
and only its MTP block is trained, N AdamW steps of next-next-token loss on the checkpoint's own
training text (the loop's policy was trained without MTP loss, so its MTP block is untrained).

Random weights draft nothing useful, so on the Flash slice the real MTP run shows the cost side
(acceptance ~0) and ``--oracle a`` runs the same engine with each draft replaced by the plain
run's token at that index with probability ``a`` (else a wrong token): verify steps, rollbacks
and the MTP forward all run for real; only the draft's quality is set.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.runner import write_result
from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams
from v4stack.serve.spec_step import MTPStep

RESULTS = Path(__file__).resolve().parent / "results"


class OracleStep(MTPStep):
    """Drafts the reference token at each output index with probability ``a`` (hash-decided)."""

    def __init__(self, engine, expected: dict, a: float):
        super().__init__(engine)
        self.expected, self.a = expected, a

    def _draft(self, plan, starts, kept, cu, hidden, ready):
        super()._draft(plan, starts, kept, cu, hidden, ready)
        for req, _ in plan:
            d = getattr(req, "mtp_draft", None)
            exp = self.expected.get(tuple(req.prompt))
            i = len(req.output)
            if d is None or exp is None or i >= len(exp) or d[0] != len(req.prompt) + i:
                continue
            h = hashlib.blake2b(f"{req.prompt[:4]}:{i}".encode(), digest_size=8).digest()
            ok = int.from_bytes(h, "little") / 2.0**64 < self.a
            req.mtp_draft = (d[0], exp[i] if ok else (exp[i] + 1) % self.engine_vocab)

    @property
    def engine_vocab(self) -> int:
        return self.e.model.cfg.vocab_size


def run(model, prompts, n_tokens, cfg: EngineConfig, step_cls=None, **kw) -> dict:
    eng = Engine(model, cfg)
    if step_cls is not None:
        eng.spec = step_cls(eng, **kw)
        eng.scheduler.draft_tokens = eng.spec.draft_tokens
    sp = SamplingParams(max_tokens=n_tokens)
    reqs = [eng.add_request(p, sp) for p in prompts]
    times, decode = [], []
    while eng.has_work():
        started = all(r.first_token_at is not None for r in reqs)
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
        decode.append(started)
    dec_t = sum(t for t, d in zip(times, decode) if d)
    dec_tokens = sum(len(r.output) for r in reqs) - len(reqs)
    s = eng.stats
    out = {"outputs": [r.output for r in reqs], "steps": s.steps, "decode_steps": sum(decode),
           "s_total": sum(times), "s_decode": dec_t, "decode_tok_s": dec_tokens / dec_t if dec_t else None,
           "ms_per_decode_step": 1e3 * dec_t / max(1, sum(decode)),
           "tokens_per_request_step": dec_tokens / max(1, sum(decode)) / len(reqs)}
    if eng.spec is not None:
        out.update(drafted=s.drafted, accepted=s.accepted, acceptance=s.accepted / s.drafted if s.drafted else 0.0)
    if eng.runner.graphs is not None:
        out["graph_replays"] = eng.runner.graphs.replays
    return out


def train_mtp(model: V4Model, text: bytes, steps: int, batch: int = 8, seq: int = 64, lr: float = 3e-3) -> dict:
    """Train only the MTP block (next-next-token loss); everything else frozen."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(model.mtp.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(1)
    losses = []
    model.train()
    for _ in range(steps):  # (ops run in the process default mode, fast)
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        tokens = torch.stack([data[s : s + seq] for s in starts.tolist()])
        segs, positions = model._fresh_segments(batch, seq, tokens.device)
        with torch.no_grad():
            h = model._trunk(tokens.reshape(-1), positions, segs)
        logits = model.mtp_logits(h, tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 2:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    k = max(1, steps // 10)
    return {"steps": steps, "loss_first": sum(losses[:k]) / k, "loss_last": sum(losses[-k:]) / k}


def _load_ckpt(path: Path) -> tuple[V4Model, dict, bytes]:
    from v4stack.train import checkpoint as ckpt

    d = ckpt.latest(path / "ckpt")
    state, _, meta = ckpt.load(d, 0)
    model = V4Model(preset("tiny"), seed=None)
    model.load_state_dict(state["model"] if "model" in state else state)
    conf = json.loads((path / "loss.json").read_text())["meta"]["config"]
    text = b"".join((path / Path(p).name).read_bytes() for p in conf["data"])
    return model.float().eval(), {"source": str(d), "step": meta["step"], "train_mtp_weight": conf["mtp_weight"]}, text


def _flash(args, dev) -> V4Model:
    from bench.spec_flash import _init

    cfg = preset("flash")
    L = args.layers
    cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_hash_layers = L, args.experts, min(3, L)
    hca = max(r for r in cfg.compress_ratios)
    cfg.compress_ratios = ([0, 0] + [4, hca] * L)[:L] + [0]
    cfg.validate()
    with torch.device(dev):
        model = V4Model(cfg, seed=None)
    _init(model)
    return model.cast(torch.bfloat16).eval()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=None, help="a trainer run directory (tiny)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--mtp-steps", type=int, default=0)
    ap.add_argument("--save-model", default=None, help="write the (MTP-trained) model here (save_model)")
    ap.add_argument("--model", default=None, help="a saved model directory (with --ckpt: its MTP block)")
    ap.add_argument("--train-only", action="store_true")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--oracle", default="", help="comma list of draft acceptance rates to impose")
    ap.add_argument("--mode", default=None, help="ops modes, comma list (default: invariant on CPU, fast on CUDA)")
    ap.add_argument("--runs", default="plain,plain_eager,mtp", help="which of plain, plain_eager, mtp to run "
                    "(plain always runs: it is the reference)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--single", action="store_true", help="also run each prompt alone")
    ap.add_argument("--repeat", type=int, default=1, help="interleaved runs of each configuration; the "
                    "fastest decode is kept (load on a shared machine hits all alike)")
    ap.add_argument("--out", default=str(RESULTS / "spec_engine_cpu_tiny.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    modes = (args.mode or ("fast" if dev.type == "cuda" else "invariant")).split(",")
    res: dict = {"bench": "spec_engine", "device": str(dev), "ops_modes": modes, "tokens": args.tokens,
                 "batch": args.batch, "context": args.context}
    rng = random.Random(0)
    if args.ckpt:
        model, res["model"], text = _load_ckpt(Path(args.ckpt))
        if args.model:  # the same policy with an MTP block trained earlier by this bench
            from v4stack.model.weights import load_model

            trained = load_model(args.model)
            model.mtp.load_state_dict(trained.mtp.state_dict())
            res["mtp_training"] = json.loads((Path(args.model) / "mtp_training.json").read_text())
        if args.mtp_steps:
            t0 = time.perf_counter()
            res["mtp_training"] = {**train_mtp(model, text, args.mtp_steps), "s": time.perf_counter() - t0}
            print(json.dumps(res["mtp_training"]))
        if args.save_model:
            from v4stack.atomic import atomic_write
            from v4stack.model.weights import save_model

            save_model(model, args.save_model)
            atomic_write(Path(args.save_model) / "mtp_training.json", json.dumps(res.get("mtp_training")).encode())
        if args.train_only:
            return
        offs = [rng.randrange(len(text) - args.context) for _ in range(args.batch)]
        prompts = [list(text[o : o + args.context]) for o in offs]
    else:
        model = _flash(args, dev) if args.preset == "flash" else V4Model(preset(args.preset), seed=0).to(dev).eval()
        res["model"] = {"preset": args.preset, "layers": model.cfg.num_hidden_layers,
                        "routed_experts": model.cfg.n_routed_experts, "weights": "random", "dtype": str(model.dtype)}
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, model.cfg.vocab_size, (args.context,), generator=g).tolist()
                   for _ in range(args.batch)]
    blocks = args.batch * (-(-(args.context + args.tokens + 2) // model.cfg.block_tokens) + 1) + 8
    groups = [("batch", prompts)] + ([(f"single{i}", [p]) for i, p in enumerate(prompts)] if args.single else [])
    res["runs"] = {}
    which = set(args.runs.split(","))
    for mode, (name, ps) in [(m, g) for m in modes for g in groups]:
        base = dict(n_blocks=blocks, n_slots=args.batch + 1, max_running=args.batch, ops_mode=mode,
                    token_budget=max(256, args.batch * 2 + args.context))
        name = f"{mode}/{name}"
        run(model, ps, 4, EngineConfig(**base))  # warm-up (graph capture, kernel builds)
        run(model, ps, 4, EngineConfig(**base, speculative="mtp"))
        configs = {"plain": (EngineConfig(**base), None, {})}
        if dev.type == "cuda" and "plain_eager" in which:
            configs["plain_eager"] = (EngineConfig(**base, cuda_graphs=False), None, {})
        if "mtp" in which:
            configs["mtp"] = (EngineConfig(**base, speculative="mtp"), None, {})
        runs: dict = {k: [] for k in configs}
        for rep in range(args.repeat):
            for k, (ec, cls, kw) in list(configs.items()):
                runs[k].append(run(model, ps, args.tokens, ec, cls, **kw))
            if rep == 0:  # oracle drafts follow the plain run's tokens
                expected = {tuple(p): o for p, o in zip(ps, runs["plain"][0]["outputs"])}
                for a in [float(x) for x in args.oracle.split(",") if x]:
                    configs[f"oracle_{a}"] = (EngineConfig(**base, speculative="mtp"), OracleStep,
                                              dict(expected=expected, a=a))
                    runs[f"oracle_{a}"] = [run(model, ps, args.tokens, *configs[f"oracle_{a}"][:2],
                                               **configs[f"oracle_{a}"][2])]
        rows = {}
        for k, rs in runs.items():
            rows[k] = {**min(rs, key=lambda r: r["s_decode"]), "s_decode_all": [r["s_decode"] for r in rs]}
        ref = rows["plain"]
        for k, r in rows.items():
            r["identical_to_plain"] = r["outputs"] == ref["outputs"]
            r["decode_speedup_vs_plain"] = r["decode_tok_s"] / ref["decode_tok_s"] if r["decode_tok_s"] else None
        for r in rows.values():
            r["sample_output"] = r.pop("outputs")[0][:16]
        res["runs"][name] = rows
        print(name, json.dumps({k: {kk: v for kk, v in r.items() if kk != "sample_output"} for k, r in rows.items()}))
        write_result(args.out, res)  # partial results as each group finishes
    write_result(args.out, res)


if __name__ == "__main__":
    main()
