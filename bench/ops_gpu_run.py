"""One GPU session's worth of ops measurements, written under $OUT (or --out-dir):

- ops_gpu_invariance.json: per M, whether a row's bits match the row computed alone, for the
  invariant GEMM / RMSNorm and for the framework's (cuBLAS / torch) at V4-Flash width 4096;
- ops_check_gpu.json: ``check_invariance`` (tiny preset, 32 prompts, bf16) in both modes;
- ops_h200.json / ops_h200.png: ``bench_ops`` at V4-Flash widths, M in {1, 8, 64, 256, 4096}.

    python -m bench.ops_gpu_run --out-dir $OUT
"""

import argparse
import json
import os
import time

import torch

from v4stack import check, ops
from bench.ops import bench_ops, format_table
from bench.runner import write_result

MS = (1, 8, 64, 128, 256, 1024, 4096)


def rows_stable(fn, x, w, probe=8):
    alone = torch.cat([fn(x[i : i + 1], w) for i in range(probe)])
    out = {}
    for m in MS:
        n = min(m, probe)
        out[m] = bool(torch.equal(fn(x[:m], w)[:n].view(torch.int16), alone[:n].view(torch.int16)))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--skip", default="", help="comma list of phases to skip: inv,check,bench,tiles")
    a = p.parse_args(argv)
    skip = set(a.skip.split(","))
    os.makedirs(a.out_dir, exist_ok=True)
    t0 = time.time()
    print("device", torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    if "inv" not in skip:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(max(MS), 4096, device="cuda", generator=g).bfloat16()
        w = (torch.randn(4096, 4096, device="cuda", generator=g) / 64).bfloat16()
        nw = (torch.rand(4096, device="cuda", generator=g) + 0.5).bfloat16()
        res = {"K": 4096, "N": 4096, "dtype": "bfloat16", "probe_rows": 8}
        for mode in ("fast", "invariant"):
            with ops.mode(mode):
                res[f"linear_{mode}"] = rows_stable(ops.linear, x, w)
                res[f"rms_norm_{mode}"] = rows_stable(lambda a, b: ops.rms_norm(a, b, 1e-6), x, nw)
        print(json.dumps(res), flush=True)
        write_result(os.path.join(a.out_dir, "ops_gpu_invariance.json"), res)
        print("phase inv done", round(time.time() - t0), flush=True)
    if "check" not in skip:
        work = dict(preset="tiny", prompts=32, batch_sizes=(4, 32), max_prompt=12, decode=3, dtype="bfloat16",
                    device="cuda")
        rep = {m: check.check_invariance(mode=m, **work) for m in ("invariant", "fast")}
        for m, r in rep.items():
            print(m, {k: r[k] for k in ("steps_compared", "steps_differ", "deterministic", "max_abs_diff")}, flush=True)
        write_result(os.path.join(a.out_dir, "ops_check_gpu.json"), rep)
        print("phase check done", round(time.time() - t0), flush=True)
    if "bench" not in skip:
        rep = bench_ops(ms=(1, 8, 64, 256, 4096), widths="flash", dtype="bfloat16", device="cuda", repeats=20,
                        budget_s=0.5, out=os.path.join(a.out_dir, "ops_h200.json"),
                        plot=os.path.join(a.out_dir, "ops_h200.png"))
        print(format_table(rep), flush=True)
        print("phase bench done", round(time.time() - t0), flush=True)
    if "tiles" not in skip:
        tiles(a.out_dir)
        print("phase tiles done", round(time.time() - t0), flush=True)


TILES = ((64, 128, 64, 3, 128), (128, 128, 64, 3, 128), (128, 256, 64, 3, 256), (64, 256, 64, 3, 128))


def tiles(out_dir):
    """Candidate fixed GEMM tiles at K = N = 4096 bf16: time vs cuBLAS and row stability over M."""
    import tilelang

    from v4stack.kernels import tilelang_ops as k

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 4096, device="cuda", generator=g).bfloat16()
    w = (torch.randn(4096, 4096, device="cuda", generator=g) / 64).bfloat16()

    def med(fn, n=30):
        for _ in range(3):
            fn()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return sorted(s.elapsed_time(e) for s, e in ev)[n // 2]

    rows = []
    for bM, bN, bK, st, th in TILES:
        try:
            kern = tilelang.compile(k.gemm_nt(4096, 4096, block_M=bM, block_N=bN, block_K=bK, stages=st, threads=th),
                                    out_idx=[2], target="cuda", pass_configs=k.pass_configs())
        except Exception as e:  # a tile that does not compile is recorded, not fatal
            rows.append({"tile": [bM, bN, bK, st, th], "error": str(e)[:300]})
            continue
        alone = kern(x[:8].contiguous()[:1].contiguous(), w)
        r = {"tile": [bM, bN, bK, st, th], "stable": {}, "ms": {}, "cublas_ms": {}}
        for m in (1, 8, 64, 256, 1024, 4096):
            xm = x[:m].contiguous()
            r["stable"][m] = bool(torch.equal(kern(xm, w)[:1].view(torch.int16), alone.view(torch.int16)))
            r["ms"][m] = med(lambda: kern(xm, w))
            r["cublas_ms"][m] = med(lambda: torch.nn.functional.linear(xm, w))
        r["ratio"] = {m: r["ms"][m] / r["cublas_ms"][m] for m in r["ms"]}
        print(r, flush=True)
        rows.append(r)
    write_result(os.path.join(out_dir, "ops_gemm_tiles_h200.json"), {"rows": rows})


if __name__ == "__main__":
    main()
