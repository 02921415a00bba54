"""FP8 (128x128 block-scaled) linear vs bf16 linear at V4-Flash widths; FP4 expert weights too.

    python -m bench.quant_linear [--out bench/results/quant_linear_h200.json] [--iters 30]

Paths timed per shape and token count M:
- ``bf16``: ``F.linear`` on a bf16 weight (cuBLAS);
- ``ops_cached``: ``ops.linear(x, QuantizedWeight)`` as the model calls it, served by whatever the
  dispatch table holds for the format on CUDA (up to commit dd0edee: dequantise once, cache the
  dense weight, dense GEMM; since 4a6c593 FP8 runs the Triton block-scaled FP8 GEMM);
- ``dequant_per_call``: dequantise then GEMM on every call (what a cache-less fallback costs);
- ``fp8_scaled_mm``: ``torch._scaled_mm`` with 1x128 activation and 128x128 weight block scales,
  activation quantisation included, where this torch/GPU supports it (else the error is recorded);
- ``fp4_triton`` (the FP4 expert row): the packed-FP4 Triton GEMM (``kernels/triton_fp4.py``),
  with its error against dequantise-then-GEMM (fp32 reference).
``impl`` records which implementation ``ops.linear`` dispatched to (the ops counters).

``--grouped``: the routed-expert GEMM at Flash widths (w1: 2048 x 4096 per expert, ``--experts``
experts, rows spread evenly): bf16 ``ops.grouped_linear`` on stacked dense weights vs the FP4
grouped kernel on packed weights vs dequantise-then-grouped-GEMM per call; resident weight bytes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.runner import write_result
from bench.timing import cuda_median
from v4stack import ops
from v4stack.ops import dispatch
from v4stack.ops.quantized import QuantizedWeight, dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8

RESULTS = Path(__file__).resolve().parent / "results"
# (name, out N, in K) of V4-Flash's FP8 projections and one FP4 routed expert
FLASH = [("attn.wq_a", 1024, 4096), ("attn.wq_b", 32768, 1024), ("attn.wkv", 512, 4096),
         ("attn.wo_a (one group)", 1024, 4096), ("attn.wo_b", 4096, 8192),
         ("shared_experts.w1", 2048, 4096), ("shared_experts.w2", 4096, 2048)]
EXPERT = ("experts.w1 (fp4)", 2048, 4096)


def _time(fn, iters: int) -> float:
    """Median microseconds per call."""
    return cuda_median(fn, iters) * 1e6


def _act_quant(x: torch.Tensor):
    """1x128 FP8 activation blocks with float32 power-of-two scales (the official act_quant)."""
    M, K = x.shape
    xb = x.float().view(M, K // 128, 128)
    s = xb.abs().amax(-1).clamp(min=1e-4) / 448.0
    s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (xb / s.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).view(M, K)
    return q, s


def _scaled_mm_fn(x, q, sw, variant: int):
    """Blockwise-scaled FP8 GEMM; ``variant`` picks the scale memory layout tried."""
    sb = sw.float() if sw.dtype != torch.float8_e8m0fnu else torch.exp2(sw.view(torch.uint8).float() - 127)
    sb = (sb.t().contiguous(), sb.t(), sb.contiguous().t().contiguous().t())[variant]

    def run():
        xq, sa = _act_quant(x)
        return torch._scaled_mm(xq, q.t(), scale_a=sa.t().contiguous().t(), scale_b=sb, out_dtype=torch.bfloat16)

    return run


def _grouped(args, dev, g) -> list[dict]:
    from v4stack.kernels import triton_fp4
    from v4stack.ops.mode import mode

    E, (name, N, K) = args.experts, EXPERT
    packed, scales, dense = [], [], []
    for _ in range(E):
        d, s = quantize_fp4((torch.randn(N, K, generator=g) * K ** -0.5).to(dev))
        packed.append(d)
        scales.append(s)
        dense.append(dequantize_fp4(d, s).to(torch.bfloat16))
    packed, scales, wb = torch.stack(packed), torch.stack(scales), torch.stack(dense)
    del dense
    out = []
    for R in [int(r) for r in args.grouped.split(",")]:
        counts = torch.full((E,), R // E)
        counts[: R % E] += 1
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(dev)
        x = torch.randn(R, K, generator=g).to(dev, torch.bfloat16)
        r = {"name": f"{name} grouped", "experts": E, "rows": R, "N": N, "K": K,
             "weight_bytes": {"bf16": wb.numel() * 2, "fp4_packed": packed.numel() + scales.numel()}}
        with torch.no_grad(), mode("fast"):
            ref = torch.cat([x[int(offsets[e]) : int(offsets[e + 1])].float() @ wb[e].float().T for e in range(E)])
            y4 = triton_fp4.grouped_fp4_linear(x, packed, scales, offsets)
            yb = ops.grouped_linear(x, wb, offsets)
            r["fp4_rel_err"] = ((y4.float() - ref).norm() / ref.norm()).item()
            r["bf16_rel_err"] = ((yb.float() - ref).norm() / ref.norm()).item()
            dispatch.reset_counters()
            ops.grouped_linear(x, wb, offsets)
            r["bf16_impl"] = dispatch.counters()
            r["us_bf16_grouped"] = _time(lambda: ops.grouped_linear(x, wb, offsets), args.iters)
            r["us_fp4_grouped"] = _time(lambda: triton_fp4.grouped_fp4_linear(x, packed, scales, offsets), args.iters)

            def deq():
                w = torch.stack([dequantize_fp4(packed[e], scales[e]) for e in range(E)]).to(torch.bfloat16)
                return ops.grouped_linear(x, w, offsets)

            r["us_dequant_grouped_per_call"] = _time(deq, max(3, args.iters // 4))
        r["speedup_fp4_vs_bf16"] = r["us_bf16_grouped"] / r["us_fp4_grouped"]
        out.append(r)
        print(json.dumps(r))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(RESULTS / "quant_linear_h200.json"))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--m", default="1,128,4096")
    ap.add_argument("--grouped", default="", help="comma list of routed rows for the grouped expert GEMM")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--only", default="", help="run only the shapes whose name contains this")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    grouped = _grouped(args, dev, g) if args.grouped else []
    if grouped:
        write_result(args.out, {"bench": "quant_linear", "iters": args.iters, "rows": [], "grouped": grouped,
                                "note": "partial: grouped only so far"})
    for name, N, K in [sh for sh in FLASH + [EXPERT] if args.only in sh[0]]:
        w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dev)
        fp4 = name == EXPERT[0]
        data, scale = quantize_fp4(w) if fp4 else quantize_fp8(w)
        qw = QuantizedWeight("fp4" if fp4 else "fp8", data, scale)
        wq_dense = qw.dequantize()
        wb = wq_dense.to(torch.bfloat16)
        for M in [int(m) for m in args.m.split(",")]:
            x = torch.randn(M, K, generator=g).to(dev, torch.bfloat16)
            r = {"name": name, "N": N, "K": K, "M": M, "format": qw.fmt,
                 "weight_bytes": {"bf16": N * K * 2, "stored": data.numel() * data.element_size()
                                  + scale.numel() * scale.element_size()}}
            r["us_bf16"] = _time(lambda: F.linear(x, wb), args.iters)
            dispatch.reset_counters()
            ops.linear(x, qw)
            r["impl"] = dispatch.counters()
            r["us_ops_cached"] = _time(lambda: ops.linear(x, qw), args.iters)
            ref = F.linear(x.float(), wq_dense)
            r["ops_rel_err"] = ((ops.linear(x, qw).float() - ref).norm() / ref.norm()).item()
            if fp4:
                from v4stack.kernels import triton_fp4

                y4 = triton_fp4.fp4_linear(x, qw)
                r["fp4_triton_rel_err"] = ((y4.float() - ref).norm() / ref.norm()).item()
                r["fp4_triton_max_abs_err"] = (y4.float() - ref).abs().max().item()
                r["us_fp4_triton"] = _time(lambda: triton_fp4.fp4_linear(x, qw), args.iters)
                r["speedup_fp4_triton_vs_bf16"] = r["us_bf16"] / r["us_fp4_triton"]
            deq = (lambda: dequantize_fp4(data, scale)) if fp4 else (lambda: dequantize_fp8(data, scale))
            r["us_dequant_per_call"] = _time(lambda: F.linear(x, deq().to(torch.bfloat16)), args.iters)
            if not fp4:
                errors = []
                for variant in range(3):
                    try:
                        fn = _scaled_mm_fn(x, data, scale, variant)
                        y = fn()
                        ref = F.linear(x.float(), wq_dense)
                        r["fp8_scaled_mm_rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
                        r["us_fp8_scaled_mm"] = _time(fn, args.iters)
                        r["fp8_scaled_mm_variant"] = variant
                        break
                    except Exception as e:  # unsupported layout / arch on this torch build
                        errors.append(f"{type(e).__name__}: {str(e)[:160]}")
                if errors and "us_fp8_scaled_mm" not in r:
                    r["fp8_scaled_mm_error"] = errors
            r["speedup_fp8_vs_bf16"] = r["us_bf16"] / r["us_fp8_scaled_mm"] if "us_fp8_scaled_mm" in r else None
            rows.append(r)
            print(json.dumps(r))
        write_result(args.out, {"bench": "quant_linear", "iters": args.iters, "rows": rows, "grouped": grouped,
                                "note": f"partial: through {name}"})
    write_result(args.out, {"bench": "quant_linear", "iters": args.iters, "rows": rows, "grouped": grouped,
                            "note": "us = median microseconds per call (CUDA events)"})


if __name__ == "__main__":
    main()
