"""Fast mode's small-row bf16 linears against a split-K launch of the project's slice kernel, on one
GPU, writing stamped JSON.

A flash4 decode step at batch 256 runs linears with few output tiles and a long K: the packed
projections of a layer's input (``x_linears``: 4096 -> 1536 / 2560 / 4160 for a window / HCA / CSA
layer) and ``wo_b`` (8192 -> 4096). cuBLAS takes 10-21 us for the first three on an H100, where
their weights alone need 4-11 us (a program walks the whole K of its tile). Here the same product
with K cut into slices of ``split`` spread over the grid (``triton_slices.run``'s grid form: each
program one slice of one output tile, the tile's last program adds the fp32 partials in slice
order), against ``torch.nn.functional.linear``: device time per call under CUDA graphs
(interleaved rounds, median) and the error of each against float64. On an H100 cuBLAS was faster at
every shape (``bench/results/splitk_linear_h100_998536d.json``), so fast mode has no split-K launch.

    python -m bench.splitk_linear --out bench/results/splitk_linear_h100.json
"""

from __future__ import annotations

import argparse

import torch

from bench.runner import write_result
from bench.timing import graph_variants
from v4stack.kernels import triton_slices as ts

SHAPES = (("x_window", 4096, 1536), ("x_hca", 4096, 2560), ("x_csa", 4096, 4160), ("wo_b", 8192, 4096))


def _t(bm, bn, bk, split, w=4, s=4, unroll=8):
    return dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=s, grid=True, unroll=unroll, split=split)


VARIANTS = {
    "64x128x64_k512": _t(64, 128, 64, 512),
    "64x128x64_k1024": _t(64, 128, 64, 1024),
    "64x64x128_k512": _t(64, 64, 128, 512, s=3),
    "64x64x128_k1024": _t(64, 64, 128, 1024, s=3),
    "128x64x64_k512": _t(128, 64, 64, 512, w=8),
    "128x128x64_k1024": _t(128, 128, 64, 1024, w=8, s=3),
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/splitk_linear_h100.json")
    ap.add_argument("--rows", default="256,64")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    dev = "cuda"
    out = []
    for M in map(int, a.rows.split(",")):
        for name, K, N in SHAPES:
            g = torch.Generator(device=dev).manual_seed(M + N)
            x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
            w = (torch.randn(N, K, device=dev, generator=g) * K ** -0.5).to(torch.bfloat16)
            want = x.double() @ w.double().T
            scale = want.abs().max().item()
            y = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
            cur = {}

            def use(v):
                cur["v"] = v

            def call():
                v = cur["v"]
                if v == "framework":
                    return torch.nn.functional.linear(x, w)
                t = VARIANTS[v]
                ts.run(x, w, y, t, t["split"], False)
                return y

            names = ["framework", *VARIANTS]
            rec = graph_variants(call, {n: n for n in names}, use, rounds=a.rounds)
            for n in names:
                use(n)
                rec[n]["rel_err"] = (call().double() - want).abs().max().item() / scale
            row = {"rows": M, "linear": name, "K": K, "N": N, "weight_bytes": N * K * 2, "variants": rec}
            out.append(row)
            best = min(names[1:], key=lambda n: rec[n]["us"])
            print(f"{M:4d} {name:9s} framework {rec['framework']['us']:6.1f} us  best {best} {rec[best]['us']:6.1f} us  "
                  + "  ".join(f"{n} {rec[n]['us']:.1f}" for n in names[1:]), flush=True)
    write_result(a.out, {"bench": "splitk_linear", "device_name": torch.cuda.get_device_name(),
                         "variants": VARIANTS, "rows": out})


if __name__ == "__main__":
    main()
