"""Launch shapes of the in-place rotation of a decode step's queries ``[T, 64, 512]`` (bf16), under a CUDA graph.

    python -m bench.rope_shapes --out bench/results/rope_shapes_h200.json

``rope_kernel`` at several rows-per-program / warp counts, and ``pairs_kernel`` (the tail read as
one contiguous ``[BM, 2 HALF]`` block and split into its pairs in registers, so the loads and
stores are vectors), each checked bit for bit against the kernel the library launches.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from bench.decode_kernels import graph_time
from bench.runner import write_result


@triton.jit
def pairs_kernel(X, CS, M, D, SIGN: tl.constexpr, HALF: tl.constexpr, BM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    mr = tl.program_id(1) * BM + tl.arange(0, BM)
    okm = (mr < M)[:, None]
    base = (t * M + mr[:, None]) * D + (D - 2 * HALF)
    c2 = tl.arange(0, 2 * HALF)
    x = tl.load(X + base + c2[None, :], mask=okm, other=0.0).to(tl.float32)
    a, b = tl.split(tl.reshape(x, [BM, HALF, 2]))
    i = tl.arange(0, HALF)
    cos = tl.load(CS + t * (2 * HALF) + i)[None, :]
    sin = (tl.load(CS + t * (2 * HALF) + HALF + i) * SIGN)[None, :]
    ya = a * cos - b * sin
    yb = a * sin + b * cos
    y = tl.reshape(tl.join(ya, yb), [BM, 2 * HALF])
    tl.debug_barrier()
    tl.store(X + base + c2[None, :], y.to(X.dtype.element_ty), mask=okm)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/rope_shapes_h200.json")
    a = ap.parse_args(argv)
    from v4stack.kernels import triton_mhc as tm
    from v4stack.kernels.launch import launch

    res = []
    dev = "cuda"
    freqs = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64, device=dev) / 64))
    for T in (64, 256):
        g = torch.Generator(device=dev).manual_seed(T)
        pos = torch.randint(0, 16384, (T,), device=dev, generator=g)
        q = torch.randn(T, 64, 512, device=dev, dtype=torch.bfloat16, generator=g)
        tab = tm.rope_table(pos, freqs)
        ref = tm.rope_(q.clone(), pos, freqs, False, tab)
        qt = q.clone()  # the timed calls rotate this one over and over; the bits are checked on copies of q
        M, D = 64, 512
        for bm in (1, 2, 4, 8, 16, 32, 64):
            for nw in (1, 2, 4, 8):
                def f(bm=bm, nw=nw, x=qt):
                    launch(tm.rope_kernel, (T, triton.cdiv(M, bm)), x, x, pos, freqs, tab, pos, M, D, SIGN=1.0, HALF=32,
                           BM=bm, BD=128, HAS_DEST=False, COPY=False, BARRIER=True, TABLE=True, num_warps=nw)
                y = q.clone()
                f(x=y)
                t = graph_time(f)
                res.append({"rows": T, "kernel": "rope_kernel", "BM": bm, "num_warps": nw, "us": t * 1e6,
                            "bits_equal": bool(torch.equal(y, ref))})
                print(res[-1], flush=True)
                def p(bm=bm, nw=nw, x=qt):
                    launch(pairs_kernel, (T, triton.cdiv(M, bm)), x, tab, M, D, SIGN=1.0, HALF=32, BM=bm, num_warps=nw)
                y = q.clone()
                try:
                    p(x=y)
                    t = graph_time(p)
                    res.append({"rows": T, "kernel": "pairs_kernel", "BM": bm, "num_warps": nw, "us": t * 1e6,
                                "bits_equal": bool(torch.equal(y, ref))})
                except Exception as e:  # noqa: BLE001
                    res.append({"rows": T, "kernel": "pairs_kernel", "BM": bm, "num_warps": nw, "error": repr(e)[:300]})
                print(res[-1], flush=True)
        tail = qt[..., 448:]
        res.append({"rows": T, "kernel": "torch tail mul_", "us": graph_time(lambda: tail.mul_(1.0)) * 1e6})
        print(res[-1], flush=True)
    write_result(a.out, {"results": res})


if __name__ == "__main__":
    main()
