"""The experts' gate / up GEMMs and activation as one launch (``fused.grouped_swiglu``) against the
three kernels it replaces, on one GPU, writing stamped JSON.

At the flash4 serving engine's decode calls: hidden 4096, moe_intermediate 2048, 8 routed experts
with top-6 routing plus the shared expert joined as expert 9 (every token routed to it), at 16,
64 and 256 tokens. Per row count: the unfused path (two ``ops.grouped_linear`` then
``fused.swiglu_act``, in invariant mode: the project's grouped kernel, by the tile table) and every
candidate tile of ``triton_grouped_swiglu`` under CUDA graphs, each candidate's output compared
bit for bit with the unfused path's, and which implementation ``fused.grouped_swiglu`` runs in
each mode.

    python -m bench.grouped_swiglu --out bench/results/grouped_swiglu_h200.json
"""

from __future__ import annotations

import argparse
import traceback

import torch

from bench.runner import write_result
from bench.timing import graph_time
from v4stack import ops
from v4stack.kernels import triton_grouped_swiglu as tgs
from v4stack.ops import fused

HIDDEN, INTER, ROUTED, TOPK, LIMIT = 4096, 2048, 8, 6, 10.0


def case(tokens: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    picks = torch.rand(tokens, ROUTED, device="cuda", generator=g).argsort(1)[:, :TOPK]
    counts = torch.bincount(picks.flatten(), minlength=ROUTED).tolist() + [tokens]
    off = torch.tensor([0] + counts, device="cuda").cumsum(0)
    T = int(off[-1])
    x = torch.randn(T, HIDDEN, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(ROUTED + 1, INTER, HIDDEN, device="cuda", generator=g) / 64).bfloat16()
    w3 = (torch.randn(ROUTED + 1, INTER, HIDDEN, device="cuda", generator=g) / 64).bfloat16()
    ws = torch.rand(T, device="cuda", generator=g)
    return x, w1, w3, off, ws, counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench grouped-swiglu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/grouped_swiglu_h200.json")
    ap.add_argument("--tokens", default="16,64,128,192,256")
    a = ap.parse_args(argv)
    rows = []
    for tokens in map(int, a.tokens.split(",")):
        x, w1, w3, off, ws, counts = case(tokens)

        def unfused():
            return fused.swiglu_act(ops.grouped_linear(x, w1, off), ops.grouped_linear(x, w3, off), LIMIT, ws,
                                    torch.bfloat16)

        with ops.mode("invariant"):
            want = unfused()
            unfused_us = graph_time(unfused) * 1e6
        runs = {}
        for mode in ("invariant", "fast"):
            with ops.mode(mode):
                ops.reset_counters()
                fused.grouped_swiglu(x, w1, w3, off, LIMIT, ws, torch.bfloat16)
                runs[mode] = ops.counters().get("grouped_swiglu")
        row = dict(tokens=tokens, rows=int(x.shape[0]), rows_per_expert=counts, unfused_us=unfused_us,
                   dispatch=runs, tiles=[])
        print(f"{tokens:>4} tokens ({x.shape[0]} rows): unfused {unfused_us:7.1f} us; dispatch {runs}", flush=True)
        for t in tgs.CANDIDATES:
            r = dict(tile=t)
            try:
                got = tgs.grouped_swiglu(x, w1, w3, off, LIMIT, ws, torch.bfloat16, tile=t)
                r["bits_equal_unfused"] = bool(torch.equal(got, want))
                r["max_abs_diff"] = float((got.float() - want.float()).abs().max())
                r["us"] = graph_time(lambda: tgs.grouped_swiglu(x, w1, w3, off, LIMIT, ws, torch.bfloat16,
                                                                tile=t)) * 1e6
                print(f"      {t}: {r['us']:7.1f} us, bits equal {r['bits_equal_unfused']}", flush=True)
            except Exception as e:  # noqa: BLE001  (a tile the compiler refuses is a result)
                r["error"] = f"{type(e).__name__}: {e}"[:400]
                print(f"      {t}: {r['error'][:200]}", flush=True)
                traceback.print_exc()
            row["tiles"].append(r)
        rows.append(row)
        write_result(a.out, {"widths": dict(hidden=HIDDEN, inter=INTER, routed=ROUTED, top_k=TOPK, limit=LIMIT),
                             "cases": rows, "default_tile": tgs.TILE, "device_name": torch.cuda.get_device_name()})


if __name__ == "__main__":
    main()
