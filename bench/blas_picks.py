"""The decode step's framework GEMMs under the framework's BLAS settings (one GPU call), writing
stamped JSON.

Fast mode runs the step's dense projections through ``F.linear`` (cuBLAS). The framework can
route the same call to cuBLASLt instead (``torch.backends.cuda.preferred_blas_library``, or the
environment's ``TORCH_BLAS_PREFER_CUBLASLT=1``) and can forbid reduced-precision split-K sums
(``allow_bf16_reduced_precision_reduction``); each picks its kernels by its own heuristics. Per
shape (flash widths at batch 256 and 64: the packed input projections, ``wq_b``, ``wo_a`` as its
batched product, ``wo_b``, the indexer's ``wq_b``, the head) and setting: the device time per call
under CUDA graphs (the median of interleaved rounds), and whether its output has the default's bits.

    python -m bench.blas_picks --out bench/results/blas_picks_h100.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.runner import write_result
from bench.timing import graph_variants

# (name, groups, M, N, K): a group count above 1 is a batched product (``wo_a``: eight groups)
SHAPES = [("x proj", 1, 256, 1536, 4096), ("x proj csa", 1, 256, 4160, 4096), ("x proj hca", 1, 256, 2560, 4096),
          ("wq_b", 1, 256, 32768, 1024), ("wo_a", 8, 256, 1024, 4096), ("wo_b", 1, 256, 4096, 8192),
          ("index wq_b", 1, 256, 8192, 1024), ("head", 1, 256, 129280, 4096),
          ("wq_b b64", 1, 64, 32768, 1024), ("wo_a b64", 8, 64, 1024, 4096), ("wo_b b64", 1, 64, 4096, 8192)]
SETTINGS = {"cublas": ("cublas", True), "cublaslt": ("cublaslt", True), "cublas_full_sums": ("cublas", False),
            "cublaslt_full_sums": ("cublaslt", False)}


def use(setting) -> None:
    lib, reduced = setting
    torch.backends.cuda.preferred_blas_library(lib)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/blas_picks_h100.json")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    default = (str(torch.backends.cuda.preferred_blas_library()).split(".")[-1].lower(),
               torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, G, M, N, K in SHAPES:
        if G == 1:
            x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
            w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)
            call = lambda x=x, w=w: F.linear(x, w)  # noqa: E731
        else:
            x = torch.randn(G, M, K, device="cuda", generator=g).to(torch.bfloat16)
            w = (torch.randn(G, N, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)
            call = lambda x=x, w=w: torch.bmm(x, w.transpose(1, 2))  # noqa: E731
        rec = graph_variants(call, SETTINGS, use, rounds=a.rounds)
        use(default)
        flops = 2 * G * M * N * K
        row = {"shape": name, "groups": G, "M": M, "N": N, "K": K, "settings": rec,
               "tflops": {k: flops / v["us"] / 1e6 for k, v in rec.items()}}
        best = min(rec, key=lambda k: rec[k]["us"])
        print(f"{name:12s} " + "  ".join(f"{k} {v['us']:7.1f} us{'' if v['bits_equal_first'] else '*'}"
                                         for k, v in rec.items()) + f"  best {best}", flush=True)
        rows.append(row)
    write_result(a.out, {"bench": "blas_picks", "device_name": torch.cuda.get_device_name(), "default": list(default),
                         "rows": rows})


if __name__ == "__main__":
    main()
