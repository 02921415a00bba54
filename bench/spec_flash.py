"""Step costs of MTP speculative decoding at V4-Flash widths on one GPU (random weights).

    python -m bench.spec_flash [--layers 4] [--experts 16] [--batch 8] [--acceptance 0.8]

Flash widths (d 4096, 64 heads x 512, q rank 1024, 8 output groups, window 128, CSA m 4 / HCA
m' 128, expert inner 2048, top-6, vocab 129280), a few layers (SWA, SWA, CSA, HCA, ...) and fewer
routed experts so it fits and initialises fast; bf16, fast ops mode. Measured per decode step of
a batch: the plain one-token step, the two-token verify step, and the MTP draft (one row per
request). Random weights make the MTP drafts useless, so the speedup at a given acceptance rate
``a`` is computed from the measured costs: ``(1 + a) * t_plain / (t_verify + t_mtp)``; the rate
itself comes from the CPU run on a trained model (bench/results/spec_decode_cpu_tiny.json).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.runner import write_result
from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.model.attention import Segment
from v4stack.model.state import LayerState
from v4stack.ops.mode import mode

RESULTS = Path(__file__).resolve().parent / "results"


@torch.no_grad()
def _init(model: V4Model) -> None:
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif leaf.endswith("_fn") or p.dim() == 2:
            p.normal_(0.0, p.shape[-1] ** -0.5)
        elif leaf.endswith("_scale"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.1)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.randint(0, model.cfg.n_routed_experts, b.shape, device=b.device))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, iters: int) -> float:
    fn()
    _sync()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--acceptance", type=float, default=None, help="rate to project the speedup at")
    ap.add_argument("--preset", default="flash", help="tiny: a CPU smoke run of this script")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=str(RESULTS / "spec_flash_h200.json"))
    args = ap.parse_args(argv)
    cfg = preset(args.preset)
    L = args.layers
    cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_hash_layers = L, args.experts, min(3, L)
    hca = max(r for r in cfg.compress_ratios)
    cfg.compress_ratios = ([0, 0] + [4, hca] * L)[:L] + [0]
    cfg.validate()
    dev = torch.device(args.device)
    with torch.device(dev):
        model = V4Model(cfg, seed=None)
    _init(model)
    model.cast(torch.bfloat16).eval()
    B, T = args.batch, args.context
    g = torch.Generator().manual_seed(0)
    states = [model.new_state() for _ in range(B)]
    with torch.no_grad(), mode("fast"):
        for s in states:
            model.step([(torch.randint(0, cfg.vocab_size, (T,), generator=g).to(dev), s)])
        one = [torch.randint(0, cfg.vocab_size, (1,), generator=g).to(dev) for _ in range(B)]
        two = [torch.randint(0, cfg.vocab_size, (2,), generator=g).to(dev) for _ in range(B)]

        def snapshot():
            return [(s.pos, [(ls.swa_kv.clone(), ls.compressed_kv, ls.index_keys,
                              ls.tail and (ls.tail.kv.clone(), ls.tail.score.clone()),
                              ls.index_tail and (ls.index_tail.kv.clone(), ls.index_tail.score.clone()))
                             for ls in s.layers]) for s in states]

        def restore(snap):
            for s, (pos, layers) in zip(states, snap):
                s.pos = pos
                for ls, (w, c, ik, t, it) in zip(s.layers, layers):
                    ls.swa_kv.copy_(w)
                    ls.compressed_kv, ls.index_keys = c, ik
                    if t:
                        ls.tail.kv.copy_(t[0]), ls.tail.score.copy_(t[1])
                    if it:
                        ls.index_tail.kv.copy_(it[0]), ls.index_tail.score.copy_(it[1])

        snap = snapshot()

        def plain():
            restore(snap)
            model.step(list(zip(one, states)))

        def verify():
            restore(snap)
            model.step(list(zip(two, states)), hidden=True)

        t_plain, t_verify = _time(plain, args.iters), _time(verify, args.iters)
        h = torch.randn(B, cfg.hc_mult, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
        mtp_states = [[None] * L + [LayerState(swa_kv=torch.zeros(cfg.sliding_window, cfg.head_dim, device=dev,
                                                                  dtype=torch.bfloat16))] for _ in range(B)]
        ids = torch.cat(one)

        def draft():
            segs = [Segment(start=i, length=1, pos0=T, state=mtp_states[i]) for i in range(B)]
            y = model.mtp[0].predict(h, model.embed(ids), torch.full((B,), T, device=dev), segs, ids)
            model.head(y).argmax(-1)

        t_mtp = _time(draft, args.iters)
    res = {"bench": "spec_flash", "layers": L, "routed_experts": args.experts, "batch": B, "context": T,
           "dtype": "bf16", "ops_mode": "fast", "s_plain_step": t_plain, "s_verify_step": t_verify,
           "s_mtp_draft": t_mtp, "verify_cost_ratio": (t_verify + t_mtp) / t_plain,
           "break_even_acceptance": (t_verify + t_mtp) / t_plain - 1}
    if args.acceptance is not None:
        res["acceptance_assumed"] = args.acceptance
        res["projected_speedup"] = (1 + args.acceptance) * t_plain / (t_verify + t_mtp)
    print(res)
    write_result(args.out, res)


if __name__ == "__main__":
    main()
