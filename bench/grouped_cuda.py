"""The MoE layers' grouped GEMMs in CUDA C++ (``kernels/cuda_grouped.cu``) against the kernels they
would replace, on one GPU, writing stamped JSON.

Cases: the serving grid's MoE layers (``bench/serve_roofline.py``: flash4 = 8 routed experts + the
shared one joined as a ninth, flash8 = 64 + 1; top-6 routing drawn at random) at the given decode
batches; projections gate / up (N 2048, K 4096) and down (N 4096, K 2048). Per case, device time
under CUDA graphs of: fast mode's pick today (``ops.grouped_linear``), invariant mode's pick, and
the CUDA kernel with 128 columns a unit and 64 or 128 rows a consumer warpgroup (one or two accumulator tiles), with and without stream-K; the largest error of each against the fp32 reference relative to
the reference's largest magnitude; whether the CUDA kernel's bits equal invariant mode's kernel's
(then it can serve invariant mode too). And the gate-up-activation step: the two GEMMs and
``swiglu_act`` as fast mode runs them today, against the fused CUDA launch.

    python -m bench.grouped_cuda --out bench/results/grouped_cuda_h200.json
"""

from __future__ import annotations

import argparse

import torch

from bench.runner import write_result
from bench.timing import graph_time
from v4stack import ops
from v4stack.kernels import cubin
from v4stack.kernels import cuda_grouped as cg
from v4stack.ops.fused import moe_route, swiglu_act
from v4stack.ops.mode import mode as ops_mode

CONFIGS = {"flash4": 8, "flash8": 64}
TOP_K, HIDDEN, INNER, LIMIT = 6, 4096, 2048, 10.0


def routing(tokens: int, routed: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.rand(tokens, routed, device="cuda", generator=g).argsort(1)[:, :TOP_K]
    w = torch.rand(tokens, TOP_K, device="cuda", generator=g)
    return moe_route(idx, w / w.sum(1, keepdim=True), routed, True)  # the shared expert joined


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def reference(x, w, off):
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    o = off.tolist()
    for e in range(w.shape[0]):
        y[o[e]:o[e + 1]] = x[o[e]:o[e + 1]].float() @ w[e].float().T
    return y


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench grouped-cuda", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/grouped_cuda_h200.json")
    ap.add_argument("--tokens", default="64,256")
    ap.add_argument("--configs", default="flash4,flash8")
    a = ap.parse_args(argv)
    _, report = cubin.build(cg.SOURCE)
    torch.manual_seed(0)
    out, fused = [], []
    for cfg in a.configs.split(","):
        routed = CONFIGS[cfg]
        E = routed + 1
        w13 = {n: (torch.randn(E, INNER, HIDDEN, device="cuda") / HIDDEN**0.5).bfloat16() for n in ("w1", "w3")}
        w2 = (torch.randn(E, HIDDEN, INNER, device="cuda") / INNER**0.5).bfloat16()
        for T in map(int, a.tokens.split(",")):
            off, order, rank, tok, ws = routing(T, routed)
            rows = (torch.randn(T, HIDDEN, device="cuda")).bfloat16()[tok]
            for proj, w in (("gate", w13["w1"]), ("down", w2)):
                x = rows if proj == "gate" else torch.randn(rows.shape[0], INNER, device="cuda").bfloat16()
                want = reference(x, w, off)
                with ops_mode("fast"):
                    fast = ops.grouped_linear(x, w, off)
                    fast_us = graph_time(lambda: ops.grouped_linear(x, w, off)) * 1e6
                with ops_mode("invariant"):
                    inv = ops.grouped_linear(x, w, off)
                    inv_us = graph_time(lambda: ops.grouped_linear(x, w, off)) * 1e6
                row = dict(config=cfg, tokens=T, rows=x.shape[0], experts=E, projection=proj, N=w.shape[1],
                           K=w.shape[2], fast_us=fast_us, fast_rel_err=rel(fast, want), invariant_us=inv_us,
                           invariant_rel_err=rel(inv, want))
                flops = 2.0 * x.shape[0] * w.shape[1] * w.shape[2]
                for rw in (1, 2):
                    for sk in (False, True):
                        got = cg.grouped_linear(x, w, off, rw=rw, sk=sk)
                        us = graph_time(lambda: cg.grouped_linear(x, w, off, rw=rw, sk=sk)) * 1e6
                        again = cg.grouped_linear(x, w, off, rw=rw, sk=sk)
                        row[f"cuda_r{rw}" + ("_sk" if sk else "")] = dict(
                            us=us, TFLOPs=flops / us / 1e6, rel_err=rel(got, want),
                            bits_equal_invariant=bool(torch.equal(got, inv)), repeatable=bool(torch.equal(got, again)))
                row["fast_TFLOPs"] = flops / fast_us / 1e6
                out.append(row)
                vs = ("cuda_r1", "cuda_r2", "cuda_r1_sk", "cuda_r2_sk")
                print(f"{cfg} T={T:4d} {proj:5s} rows {x.shape[0]:5d}: fast {fast_us:6.1f} inv {inv_us:6.1f} | "
                      + " ".join(f"{v[5:]} {row[v]['us']:6.1f} ({row[v]['rel_err']:.0e}{'=' if row[v]['bits_equal_invariant'] else ''})"
                                 for v in vs) + f" (fast err {row['fast_rel_err']:.0e})", flush=True)
            # the gate-up-activation step
            with ops_mode("fast"):
                def unfused():
                    return swiglu_act(ops.grouped_linear(rows, w13["w1"], off), ops.grouped_linear(rows, w13["w3"], off),
                                      LIMIT, ws, torch.bfloat16)
                base = unfused()
                base_us = graph_time(unfused) * 1e6
            g = reference(rows, w13["w1"], off).bfloat16().float()
            u = reference(rows, w13["w3"], off).bfloat16().float()
            want = (torch.nn.functional.silu(g.clamp(max=LIMIT)) * u.clamp(-LIMIT, LIMIT) * ws[:, None])
            row = dict(config=cfg, tokens=T, rows=rows.shape[0], unfused_fast_us=base_us, unfused_rel_err=rel(base, want))
            for rw in (2,):
                for sk in (False, True):
                    got = cg.grouped_swiglu(rows, w13["w1"], w13["w3"], off, ws, LIMIT, rw=rw, sk=sk)
                    us = graph_time(lambda: cg.grouped_swiglu(rows, w13["w1"], w13["w3"], off, ws, LIMIT, rw=rw,
                                                              sk=sk)) * 1e6
                    row[f"cuda_r{rw}" + ("_sk" if sk else "")] = dict(us=us, rel_err=rel(got, want))
            fused.append(row)
            vs = ("cuda_r2", "cuda_r2_sk")
            print(f"{cfg} T={T:4d} gate+up+act: unfused {base_us:6.1f} us | "
                  + " ".join(f"{v[5:]} {row[v]['us']:6.1f} ({row[v]['rel_err']:.0e})" for v in vs)
                  + f" (unfused err {row['unfused_rel_err']:.0e})", flush=True)
    write_result(a.out, dict(cases=out, fused=fused, ptxas=report[-3000:]))


if __name__ == "__main__":
    main()
