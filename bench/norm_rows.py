"""RMSNorm with several rows a program, against the library's one-row-a-program kernel, under a CUDA graph.

    python -m bench.norm_rows --out bench/results/norm_rows_h200.json

The decode step's norms at flash widths (the per-head query norm ``[T * 64, 512]``, ``q_norm``
``[T, 1024]``, ``kv_norm`` ``[T, 512]``, the block norms ``[T, 4096]``): each ``ROWS`` / warp count,
its time and whether every row's bits equal the library kernel's (a row's sum-of-squares tree
follows the register layout, so a layout that differs changes bits; only equal ones could replace it).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from bench.decode_kernels import graph_time
from bench.runner import write_result


@triton.jit
def norm_rows_kernel(X, W, Y, R, N, Nf, s_x, s_y, eps, HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    rm = (r < R)[:, None]
    o = tl.arange(0, BLOCK)
    acc = tl.zeros([ROWS, BLOCK], tl.float32)
    for c in range(0, N, BLOCK):
        m = rm & (c + o < N)[None, :]
        x = tl.load(X + r[:, None] * s_x + c + o[None, :], mask=m, other=0.0).to(tl.float32)
        acc += x * x
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(acc, 1), Nf) + eps))
    for c in range(0, N, BLOCK):
        m = rm & (c + o < N)[None, :]
        x = tl.load(X + r[:, None] * s_x + c + o[None, :], mask=m, other=0.0).to(tl.float32)
        y = x * inv[:, None]
        if HAS_W:
            y = y * tl.load(W + c + o, mask=c + o < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + r[:, None] * s_y + c + o[None, :], y.to(Y.dtype.element_ty), mask=m)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/norm_rows_h200.json")
    a = ap.parse_args(argv)
    from v4stack.kernels import triton_rows as trw
    from v4stack.kernels.launch import launch, next_pow2

    res = []
    dev = "cuda"
    for T in (64, 256):
        g = torch.Generator(device=dev).manual_seed(T)
        for rows, N, hw in ((T * 64, 512, False), (T, 1024, True), (T, 512, True), (T, 4096, True)):
            x = torch.randn(rows, N, device=dev, dtype=torch.bfloat16, generator=g) * 3
            w = torch.randn(N, device=dev, dtype=torch.bfloat16, generator=g)
            ref = trw.rms_norm(x, w if hw else None, 1e-6)
            lib = graph_time(lambda: trw.rms_norm(x, w if hw else None, 1e-6))
            res.append({"T": T, "rows": rows, "N": N, "kernel": "library", "us": lib * 1e6})
            print(res[-1], flush=True)
            block = min(4096, next_pow2(N))
            for R in (1, 2, 4, 8, 16):
                for nw in (1, 2, 4, 8):
                    if R * block > 16384:
                        continue
                    y = torch.empty_like(x)

                    def f(R=R, nw=nw, y=y):
                        launch(norm_rows_kernel, (triton.cdiv(rows, R),), x, w, y, rows, N, float(N), x.stride(0),
                               y.stride(0), 1e-6, HAS_W=hw, ROWS=R, BLOCK=block, num_warps=nw)
                    try:
                        f()
                        eq = bool(torch.equal(y, ref))
                        t = graph_time(f)
                        res.append({"T": T, "rows": rows, "N": N, "kernel": "norm_rows", "ROWS": R, "num_warps": nw,
                                    "us": t * 1e6, "bits_equal": eq})
                    except Exception as e:  # noqa: BLE001
                        res.append({"T": T, "rows": rows, "N": N, "ROWS": R, "num_warps": nw, "error": repr(e)[:200]})
                    print(res[-1], flush=True)
    write_result(a.out, {"results": res})


if __name__ == "__main__":
    main()
