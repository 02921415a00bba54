"""The decode step's dense projections at batch 256 against a split-K Triton GEMM (one GPU call).

At flash4 batch 256 the attention projections run on cuBLAS at 55-65% of the dense rate with
~128 output tiles a call (``wq_b`` 256 x 1024 -> 32768, ``wo_a`` eight groups of 4096 -> 1024,
``wo_b`` 8192 -> 4096). This bench asks whether cutting K gives a faster form: a plain Triton tile
GEMM over ``(m, n, s)`` programs, each summing its share of K into an fp32 partial ``[S, M, N]``,
and a second launch adding the S partials in slice order (deterministic, row-local). Every shape is
timed under CUDA graphs against the framework's call (``F.linear``, and ``torch.bmm`` for the
grouped ``wo_a``), with the error of both against float64. The kernel lives here, not in the
package: it is a measurement, and the package takes it only if it wins.

    python -m bench.decode_gemms --out bench/results/decode_gemms_h100.json
"""

from __future__ import annotations

import argparse
import traceback

import torch
import triton
import triton.language as tl

from bench.runner import write_result
from bench.timing import graph_time

# (name, groups, M, N, K): flash widths at batch 256
SHAPES = [("wq_b", 1, 256, 32768, 1024), ("wo_a", 8, 256, 1024, 4096), ("wo_b", 1, 256, 4096, 8192),
          ("head", 1, 256, 129280, 4096), ("wq_b b64", 1, 64, 32768, 1024), ("wo_b b64", 1, 64, 4096, 8192),
          # a layer's packed projections of its input (``Attention.x_linears``): window, CSA and HCA layers
          ("x proj", 1, 256, 1536, 4096), ("x proj csa", 1, 256, 4160, 4096), ("x proj hca", 1, 256, 2560, 4096)]
TILES = [dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=4), dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3),
         dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4), dict(BM=128, BN=64, BK=64, num_warps=4, num_stages=4),
         dict(BM=64, BN=256, BK=64, num_warps=8, num_stages=3)]
SPLITS = (1, 2, 4, 8)


@triton.jit
def splitk_kernel(X, W, P, Y, M, N, K, KS, s_xg, s_wg, s_pg, s_yg, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, ONE: tl.constexpr):
    """Program ``(m, n, g * S + s)``: rows ``m``, columns ``n`` of group ``g`` over K slice ``s`` (``KS``
    columns) -> ``P[g, s]`` (or ``Y[g]`` straight when ``ONE``)."""
    pm, pn, gs = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    S = tl.cdiv(K, KS)
    g, s = gs // S, gs % S
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    x0 = X + g.to(tl.int64) * s_xg
    w0 = W + g.to(tl.int64) * s_wg
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(s * KS, tl.minimum(s * KS + KS, K), BK):
        a = tl.load(x0 + rows[:, None].to(tl.int64) * K + (k + kk)[None, :], mask=(rows < M)[:, None], other=0.0)
        b = tl.load(w0 + cols[None, :].to(tl.int64) * K + (k + kk)[:, None], mask=(cols < N)[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    if ONE:
        tl.store(Y + g.to(tl.int64) * s_yg + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=ok)
    else:
        tl.store(P + (g.to(tl.int64) * S + s) * s_pg + rows[:, None].to(tl.int64) * N + cols[None, :], acc, mask=ok)


@triton.jit
def sum_kernel(P, Y, MN, S, s_pg, s_yg, B: tl.constexpr):
    g = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    acc = tl.zeros([B], tl.float32)
    for s in range(S):
        acc += tl.load(P + (g * S + s) * s_pg + i, mask=i < MN, other=0.0)
    tl.store(Y + g * s_yg + i, acc.to(Y.dtype.element_ty), mask=i < MN)


def slices(K: int, S: int, BK: int) -> tuple[int, int]:
    """(columns a slice, whole K steps; slices) for K cut in ``S`` (fewer where K has fewer steps)."""
    ks = triton.cdiv(triton.cdiv(K, S), BK) * BK
    return ks, triton.cdiv(K, ks)


def splitk(x, w, S: int, t: dict, p=None, y=None):
    """``x [G, M, K] @ w[G, N, K]^T`` -> ``[G, M, N]`` (bf16), K in ``S`` slices; ``p`` / ``y`` the
    partials and output buffers where the caller keeps them (a graph capture)."""
    G, M, K = x.shape
    N = w.shape[1]
    y = torch.empty(G, M, N, dtype=x.dtype, device=x.device) if y is None else y
    ks, s_real = slices(K, S, t["BK"])
    if s_real > 1 and p is None:
        p = torch.empty(G, s_real, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, t["BM"]), triton.cdiv(N, t["BN"]), G * s_real)
    splitk_kernel[grid](x, w, p if p is not None else y, y, M, N, K, ks, M * K, N * K, M * N, M * N, BM=t["BM"],
                        BN=t["BN"], BK=t["BK"], ONE=s_real == 1, num_warps=t["num_warps"], num_stages=t["num_stages"])
    if s_real > 1:
        sum_kernel[(triton.cdiv(M * N, 1024), G)](p, y, M * N, s_real, M * N, M * N, B=1024, num_warps=4)
    return y


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    out = []
    pick = set(filter(None, a.shapes.split(",")))
    for name, G, M, N, K in SHAPES:
        if pick and name not in pick:
            continue
        x = torch.randn(G, M, K, device="cuda").bfloat16()
        w = (torch.randn(G, N, K, device="cuda") / K ** 0.5).bfloat16()
        exact = torch.einsum("gmk,gnk->gmn", x.double(), w.double())
        if G == 1:
            fw = lambda: torch.nn.functional.linear(x[0], w[0])  # noqa: E731
        else:
            wt = w.transpose(1, 2)
            fw = lambda: torch.bmm(x, wt)  # noqa: E731
        ref = fw().view(G, M, N)
        case = {"shape": name, "G": G, "M": M, "N": N, "K": K, "framework_graph_s": graph_time(fw),
                "framework_max_abs_err": float((ref.double() - exact).abs().max()),
                "flops": 2 * G * M * N * K, "candidates": []}
        for t in TILES:
            for S in SPLITS:
                rec = {"tile": t, "S": S}
                try:
                    y = torch.empty(G, M, N, dtype=x.dtype, device="cuda")
                    sr = slices(K, S, t["BK"])[1]
                    p = torch.empty(G, sr, M, N, dtype=torch.float32, device="cuda") if sr > 1 else None
                    got = splitk(x, w, S, t, p, y)
                    rec["max_abs_err"] = float((got.double() - exact).abs().max())
                    rec["graph_s"] = graph_time(lambda: splitk(x, w, S, t, p, y))
                    rec["vs_framework"] = case["framework_graph_s"] / rec["graph_s"]
                except Exception:  # noqa: BLE001  (a tile this build refuses)
                    rec["error"] = traceback.format_exc()[-600:]
                case["candidates"].append(rec)
        ok = [c for c in case["candidates"] if "graph_s" in c]
        best = min(ok, key=lambda c: c["graph_s"]) if ok else None
        case["best"] = best
        print(name, f"framework {case['framework_graph_s'] * 1e6:.1f} us",
              f"({case['flops'] / case['framework_graph_s'] / 1e12:.0f} TFLOP/s)",
              "best split-K" if best else "", f"{best['graph_s'] * 1e6:.1f} us S={best['S']} {best['tile']}" if best else "",
              flush=True)
        out.append(case)
    write_result(a.out, {"device_name": torch.cuda.get_device_name(), "shapes": out})


if __name__ == "__main__":
    main()
