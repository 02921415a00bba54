"""The per-rank compute side of MegaMoE on one GPU: the wave pipeline's grouped GEMMs against the
same GEMMs launched expert by expert, and the achieved fraction of the bf16 matmul peak.

Shapes are one rank of EP8 at V4-Flash sizes by default: hidden 4096, expert width 2048, 256
experts (32 on this rank), top-6. For ``tokens`` per rank, the rank receives the rows the
routing of ``8 * tokens`` tokens sends to its experts. Both variants compute
``Linear-1 (w1|w3 fused) -> SwiGLU with V4 clamps (fp32) -> x weight -> Linear-2`` in bf16 GEMMs.
Waves come from ``plan_waves`` with the H200's SM count; one wave = one grouped GEMM per
Linear (``torch._grouped_mm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from v4stack.megamoe.plan import H200, plan_waves
from v4stack.megamoe.routing import routing

from bench.timing import cuda_median


def _act(h13: torch.Tensor, w: torch.Tensor, inner: int, limit: float) -> torch.Tensor:
    gate, up = h13[:, :inner].float().clamp(max=limit), h13[:, inner:].float().clamp(-limit, limit)
    return (F.silu(gate) * up * w.unsqueeze(-1)).to(torch.bfloat16)


def matmul_peak(n: int = 8192, reps: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / cuda_median(lambda: a @ b, reps)


def bench_compute(tokens=(1, 32, 512, 4096, 8192), hidden=4096, inner=2048, n_experts=256, ep=8,
                  topk=6, limit=10.0, reps=10, seed=0) -> dict:
    dev = torch.device("cuda")
    nl = n_experts // ep
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(nl, 2 * inner, hidden, generator=g) * hidden**-0.5).to(dev, torch.bfloat16)
    w2 = (torch.randn(nl, hidden, inner, generator=g) * inner**-0.5).to(dev, torch.bfloat16)
    peak = matmul_peak()
    rows_out = []
    for t in tokens:
        idx, wts = routing("uniform", ep * t, n_experts, topk, g)
        flat, wflat = idx.reshape(-1), wts.reshape(-1)
        keep = flat < nl  # this rank owns experts [0, nl)
        e_of = flat[keep]
        order = torch.sort(e_of, stable=True).indices
        counts = torch.bincount(e_of, minlength=nl).tolist()
        m = int(keep.sum())
        x = torch.randn(m, hidden, generator=g).to(dev, torch.bfloat16)
        w = wflat[keep][order].to(dev)
        plan = plan_waves(counts, H200, tokens=ep * t, topk=topk, n_experts=n_experts,
                          expert_width=inner, ring_tiles=1 << 20)
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        waves = []
        for wave in plan.waves:
            lo, hi = starts[wave[0]], starts[wave[-1] + 1]
            offs = torch.tensor([starts[e + 1] - lo for e in wave], dtype=torch.int32, device=dev)
            waves.append((lo, hi, wave[0], wave[-1] + 1, offs))

        def grouped():
            for lo, hi, e0, e1, offs in waves:
                if hi == lo:
                    continue
                h13 = torch._grouped_mm(x[lo:hi], w13[e0:e1].transpose(-2, -1), offs=offs)
                a = _act(h13, w[lo:hi], inner, limit)
                torch._grouped_mm(a, w2[e0:e1].transpose(-2, -1), offs=offs)

        def per_expert():
            for e in range(nl):
                lo, hi = starts[e], starts[e + 1]
                if hi == lo:
                    continue
                a = _act(F.linear(x[lo:hi], w13[e]), w[lo:hi], inner, limit)
                F.linear(a, w2[e])

        # same numbers both ways (bf16 GEMMs may differ in the last bits between the kernels)
        err = None
        if m:
            lo, hi, e0, e1, offs = waves[0]
            if hi > lo:
                h13 = torch._grouped_mm(x[lo:hi], w13[e0:e1].transpose(-2, -1), offs=offs)
                ref = torch.cat([F.linear(x[starts[e]:starts[e + 1]], w13[e]) for e in range(e0, e1)])
                err = float((h13.float() - ref.float()).abs().max() / ref.float().abs().max())
        tg, te = cuda_median(grouped, reps), cuda_median(per_expert, reps)
        flops = 6 * hidden * inner * m
        rows_out.append(dict(tokens_per_rank=t, rows=m, active_experts=sum(c > 0 for c in counts),
                             waves=len(plan.waves), experts_per_wave=plan.experts_per_wave,
                             grouped_ms=tg * 1e3, per_expert_ms=te * 1e3, speedup=te / tg,
                             grouped_peak_frac=flops / tg / peak if m else 0.0,
                             per_expert_peak_frac=flops / te / peak if m else 0.0,
                             linear1_rel_err=err))
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "bf16_matmul_peak_tflops": peak / 1e12,
            "shape": dict(hidden=hidden, inner=inner, n_experts=n_experts, ep=ep, local_experts=nl, topk=topk),
            "results": rows_out}


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    from bench.runner import write_result

    ap = argparse.ArgumentParser(prog="bench megamoe-compute", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512, 4096, 8192])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="bench/results/megamoe_compute_h200.json")
    a = ap.parse_args(argv)
    report = bench_compute(tokens=a.tokens, reps=a.reps)
    write_result(a.out, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
