"""Launch shapes of the mHC split kernel (``triton_mhc.hc_split``: rows a program, warps) on one GPU
at 64 and 256 rows (the flash4 engine's decode steps), writing stamped JSON: each shape's device
time under CUDA graphs and whether it gives the bits of 16 rows, one warp (``bits_equal_default``: the
default shape when this was measured; the default is now one row, one warp).

    python -m bench.hc_split_rows --out bench/results/hc_split_rows_h200.json
"""

from __future__ import annotations

import argparse

import torch

from bench.runner import write_result
from bench.timing import graph_time
from v4stack.kernels import triton_mhc as tm


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench hc-split-rows", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/hc_split_rows_h200.json")
    a = ap.parse_args(argv)
    out = []
    for N in (64, 256):
        g = torch.Generator(device="cuda").manual_seed(0)
        mix = torch.randn(N, 24, device="cuda", generator=g) * 2
        scale = torch.rand(3, device="cuda", generator=g) + 0.5
        base = torch.randn(24, device="cuda", generator=g)
        ref = tm.hc_split(mix, scale, base, 4, 20, 1e-6, dict(rows=16, warps=1))
        for rows in (1, 2, 4, 8, 16, 32):
            for warps in (1, 2, 4):
                sh = dict(rows=rows, warps=warps)
                r = dict(N=N, **sh)
                try:
                    got = tm.hc_split(mix, scale, base, 4, 20, 1e-6, sh)
                    r["bits_equal_default"] = all(torch.equal(x, y) for x, y in zip(got, ref))
                    r["us"] = graph_time(lambda: tm.hc_split(mix, scale, base, 4, 20, 1e-6, sh)) * 1e6
                    print(f"{N:>4} rows {sh}: {r['us']:6.2f} us, bits equal {r['bits_equal_default']}", flush=True)
                except Exception as e:  # noqa: BLE001  (a shape the compiler refuses is a result)
                    r["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(f"{N:>4} rows {sh}: {r['error'][:120]}", flush=True)
                out.append(r)
    write_result(a.out, {"sweep": out, "device_name": torch.cuda.get_device_name()})


if __name__ == "__main__":
    main()
