"""One GPU call that checks and times every op at V4-Flash widths, writing stamped JSON:

- ``ops_gpu_invariance_h200.json``: per op and mode, for M = 1..4096 (31 sizes), whether rows 0-3
  and the batch's last row, computed in a batch of M, are bit-identical to the same rows computed
  alone; the sparse attention also with 300 extra trailing ``-1`` columns;
- ``ops_h200.json``: time per call (CUDA events, calls back to back) in fast and invariant mode
  at M in {1, 8, 64, 256, 4096}, the framework's own implementation beside them, and which
  implementation the dispatch table ran; also each mode's device time per call with the host
  taken out (20 calls captured in a CUDA graph, replayed: ``graph_ratio``);
- ``launch_h200.json``: host time of a contract check, of the dispatch lookup, of a light
  launch (C path and Python path), of Triton's own launch, of ``torch.add`` and of ``ops.softmax``
  / ``ops.log_softmax`` in each mode, each p50 over batches of 100 calls; the light launch's bits
  against Triton's per specialisation;
- the whole-model check (``bench/model_check.py``, ``--model-only`` runs just it): decode step
  time per mode through the engine, then the invariance check in invariant and fast mode.

    python -m bench.ops_gpu_check --out-dir bench/results
    python -c "from bench.ops_gpu_check import plot; plot('bench/results/ops_h200.json', 'bench/results/ops_h200.png')"
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch

from bench.ops_gpu_cases import CASES, build
from bench.timing import graph_time, host_per_call, interleaved
from bench.runner import write_result
from v4stack import ops

TIME_MS = (1, 8, 64, 256, 4096)
INV_MS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512,
          1000, 1024, 2047, 2048, 4095, 4096)


def _rows(rows, a, b):
    return tuple(t[a:b] for t in rows)


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t


def invariance(name: str, mode: str) -> dict:
    case = build(name, max(INV_MS))
    out = {}
    with ops.mode(mode), torch.no_grad():
        alone = {i: case.call(*_rows(case.rows, i, i + 1)) for i in range(4)}
        for M in INV_MS:
            y = case.call(*_rows(case.rows, 0, M))
            ok = all(torch.equal(_bits(y[i : i + 1]), _bits(alone[i])) for i in range(min(M, 4)))
            last = case.call(*_rows(case.rows, M - 1, M))
            ok = ok and torch.equal(_bits(y[M - 1 : M]), _bits(last))
            out[M] = ok
        if name == "sparse_attention":  # trailing -1 columns change no bit
            q, a, b = _rows(case.rows, 0, 256)
            pad = torch.cat([b, torch.full((b.shape[0], 300), -1, device=b.device, dtype=b.dtype)], 1)
            out["trailing_minus_one_same_bits"] = torch.equal(_bits(case.call(q, a, b)), _bits(case.call(q, a, pad)))
    return out


def _graph_time(fn, reps=20) -> float:
    return graph_time(fn, reps, 0.03)


def timings(name: str) -> list[dict]:
    rows = []
    case = build(name, max(TIME_MS))
    with torch.no_grad():
        for M in TIME_MS:
            args = _rows(case.rows, 0, M)
            if case.timing is not None:
                call, fw = case.timing(M)
            else:
                call, fw = (lambda: case.call(*args)), (lambda: case.framework(*args))
            row = {"op": name, "M": M}
            for mode in ("fast", "invariant"):  # who serves each mode: one counted call
                ops.reset_counters()
                with ops.mode(mode):
                    call()
                row[f"{mode}_served"] = ops.counters()
            # eager seconds per call, the modes' (and the framework's) batches interleaved
            fns, ctx = {"fast": call, "invariant": call}, {m: (lambda m=m: ops.mode(m)) for m in ("fast", "invariant")}
            if case.framework is not None:
                fns["framework"] = fw
            for k, t in interleaved(fns, 0.03, contexts=ctx).items():
                row[f"{k}_s"] = t
            row["ratio"] = row["invariant_s"] / row["fast_s"]
            if "framework_s" in row:
                row["invariant_vs_framework"] = row["invariant_s"] / row["framework_s"]
            rows.append(row)
            print(f"{name:<20}{M:>6} fast {row['fast_s'] * 1e6:9.1f}us inv {row['invariant_s'] * 1e6:9.1f}us "
                  f"fw {row.get('framework_s', 0) * 1e6:9.1f}us ratio {row['ratio']:.2f}", flush=True)
    return rows


def graph_timings(name: str, rows: list[dict]) -> None:
    """Add each mode's device time per call under CUDA graph replay to ``rows`` of op ``name``."""
    case = build(name, max(TIME_MS))
    with torch.no_grad():
        for row in rows:
            M = row["M"]
            args = _rows(case.rows, 0, M)
            call, fw = case.timing(M) if case.timing is not None else ((lambda: case.call(*args)),
                                                                       (lambda: case.framework(*args)))
            for mode in ("fast", "invariant"):
                with ops.mode(mode):
                    row[f"{mode}_graph_s"] = _graph_time(call)
            if case.framework is not None:  # the framework itself, whichever implementation fast mode picked
                try:
                    row["framework_graph_s"] = _graph_time(fw)
                except RuntimeError as e:  # e.g. a framework path that reads offsets on the host cannot be captured
                    row["framework_graph_error"] = repr(e)[:300]
            row["graph_ratio"] = row["invariant_graph_s"] / row["fast_graph_s"]
            print(f"{name:<20}{M:>6} graph fast {row['fast_graph_s'] * 1e6:9.1f}us inv "
                  f"{row['invariant_graph_s'] * 1e6:9.1f}us ratio {row['graph_ratio']:.2f}", flush=True)


def _p50_per_call(fn, batches=60, per=100) -> float:
    return host_per_call(fn, batches, per)


def launch_tax() -> dict:
    """Host seconds per call (p50 over batches of 100) of: a contract check, the dispatch lookup,
    the light launcher (its C path and its Python path), Triton's own launch, ``torch.add`` (with
    ``out=`` and allocating), and ``ops.softmax`` / ``ops.log_softmax`` in each mode; then, per
    specialisation (fp32 / bf16, aligned / not, one row), whether the light launch's output equals
    Triton's launch bit for bit."""
    from v4stack.kernels import contracts as C
    from v4stack.kernels import launch as L
    from v4stack.kernels import triton_rows as tr
    from v4stack.ops import dispatch

    x = torch.randn(1, 64, device="cuda")
    y = torch.empty_like(x)
    a, b, c = torch.randn(64, device="cuda"), torch.randn(64, device="cuda"), torch.empty(64, device="cuda")
    consts = dict(LOG=False, BLOCK=64)
    k = tr.softmax_kernel
    L.launch(k, (1,), x, y, 64, 64, 64, **consts)  # compile + cache
    L.py_launch(k, (1,), x, y, 64, 64, 64, **consts)
    res = {"launch_path": L.PATH, "launch_setup_error": L.SETUP_ERROR,
           "contract_check_s": _p50_per_call(lambda: C.softmax(x, -1)),
           "dispatch_resolve_s": _p50_per_call(lambda: dispatch.resolve("softmax", "invariant", "float32", "cuda", x, -1)),
           "light_launch_s": _p50_per_call(lambda: L.launch(k, (1,), x, y, 64, 64, 64, **consts)),
           "light_launch_python_path_s": _p50_per_call(lambda: L.py_launch(k, (1,), x, y, 64, 64, 64, **consts)),
           "triton_launch_s": _p50_per_call(lambda: k[(1,)](x, y, 64, 64, 64, **consts)),
           "torch_add_s": _p50_per_call(lambda: torch.add(a, b, out=c)),
           "torch_add_alloc_s": _p50_per_call(lambda: a + b)}
    xs = {"softmax_1x4096": torch.randn(1, 4096, device="cuda"), "log_softmax_1x129280": torch.randn(1, 129280, device="cuda")}
    with torch.no_grad():
        for name, t in xs.items():
            fn = ops.softmax if name.startswith("softmax") else ops.log_softmax
            for mode in ("invariant", "fast"):
                with ops.mode(mode):
                    res[f"ops_{name}_{mode}_s"] = _p50_per_call(lambda: fn(t, -1))
    base = torch.randn(4, 80, device="cuda")
    spec = {}
    for name, t in (("fp32", base[:, :64]), ("fp32_unaligned", base[:, 1:65]), ("bf16", base[:, :64].to(torch.bfloat16)),
                    ("one_row", base[:1, :64]), ("fp16_unaligned", base.half()[:, 3:67])):
        R, N = t.shape
        y1, y2 = torch.empty(R, N, device="cuda", dtype=t.dtype), torch.empty(R, N, device="cuda", dtype=t.dtype)
        n0 = len(L._cache)
        L.launch(k, (R,), t, y1, N, t.stride(0), N, **consts)
        L.launch(k, (R,), t, y1, N, t.stride(0), N, **consts)
        k[(R,)](t, y2, N, t.stride(0), N, **consts)
        spec[name] = {"bits_equal_triton": bool(torch.equal(y1, y2)), "new_entries": len(L._cache) - n0}
    res["specialisations"] = spec
    res["light_launch_bits_equal_triton"] = all(v["bits_equal_triton"] for v in spec.values())
    res["c_entries"] = sum(type(e).__name__ == "Entry" for e in L._cache.values())
    res["contract_check_under_1us"] = res["contract_check_s"] < 1e-6
    res["light_launch_le_torch_add"] = res["light_launch_s"] <= res["torch_add_s"]
    print({k: (f"{v * 1e6:.2f}us" if isinstance(v, float) else v) for k, v in res.items()}, flush=True)
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--skip", default="", help="comma list of phases to skip: launch,inv,model,time")
    p.add_argument("--model-preset", default="tiny")
    p.add_argument("--model-set", action="append", default=[], help="model config override key=json-value")
    p.add_argument("--model-prompts", type=int, default=16)
    p.add_argument("--model-out", default="model_invariance_tiny_h200.json")
    p.add_argument("--model-only", action="store_true", help="run only the whole-model check (bench.model_check)")
    p.add_argument("--model-phases", default="decode,invariant,fast")
    p.add_argument("--ops-out", default="ops_h200.json")
    a = p.parse_args(argv)
    skip, names = set(a.skip.split(",")), a.cases.split(",")
    if a.model_only:
        skip |= {"launch", "inv", "time"}
    t0 = time.time()
    print("device", torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    from v4stack.kernels import tiles

    meta = {"widths": "flash", "device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
            "tiles_chosen": {"file": tiles.CHOSEN.name, **json.loads(tiles.CHOSEN.read_text())}}
    if "launch" not in skip:
        write_result(os.path.join(a.out_dir, "launch_h200.json"), {**meta, "bench": "launch", **launch_tax()})
        print("launch done", round(time.time() - t0), flush=True)
    if "inv" not in skip:
        inv = {}
        for n in names:
            inv[n] = {}
            for m in ("invariant", "fast"):
                try:
                    inv[n][m] = invariance(n, m)
                except Exception as e:  # a failing op is recorded, the rest still run
                    inv[n][m] = {"error": repr(e)[:500]}
                    traceback.print_exc()
            iv, fv = inv[n]["invariant"], inv[n]["fast"]
            print(f"inv {n:<20} invariant all equal: {all(v for v in iv.values() if isinstance(v, bool))} "
                  f"fast differs at M={[m for m, v in fv.items() if v is False][:6]}", flush=True)
            torch.cuda.empty_cache()
        write_result(os.path.join(a.out_dir, "ops_gpu_invariance_h200.json"),
                     {**meta, "bench": "ops_gpu_invariance", "ms": list(INV_MS), "probe_rows": "0-3 and M-1",
                      "results": inv})
        print("invariance done", round(time.time() - t0), flush=True)
    if "time" not in skip:
        rows = []
        for n in names:
            try:
                rows += timings(n)
            except Exception as e:
                rows.append({"op": n, "error": repr(e)[:500]})
                traceback.print_exc()
            torch.cuda.empty_cache()
        payload = {**meta, "bench": "ops", "ms": list(TIME_MS), "timing": "CUDA events, calls back to back, "
                   "median of 3 batches; *_graph_s: 20 calls captured in one CUDA graph, replayed", "results": rows}
        write_result(os.path.join(a.out_dir, a.ops_out), payload)
        print("timing done", round(time.time() - t0), flush=True)
        for n in names:  # after the eager numbers are safe on disk: a failed capture can spoil the context
            try:
                graph_timings(n, [r for r in rows if r["op"] == n and "error" not in r])
            except Exception as e:
                payload.setdefault("graph_errors", {})[n] = repr(e)[:300]
                traceback.print_exc()
                break
        write_result(os.path.join(a.out_dir, a.ops_out), payload)
        print("graph timing done", round(time.time() - t0), flush=True)
    if "model" not in skip:  # the whole model (serving path) through the table on the GPU: bench/model_check.py
        from bench import model_check

        dump = float(os.environ.get("V4STACK_DUMP_AFTER_S", "0"))
        if dump:  # where the model check is, should the call's time run out
            import faulthandler

            faulthandler.dump_traceback_later(dump, exit=False)
        model_check.main(["--preset", a.model_preset, "--prompts", str(a.model_prompts), "--phases", a.model_phases,
                          "--out", os.path.join(a.out_dir, a.model_out), *[f"--set={x}" for x in a.model_set]],
                         meta={"widths": meta["widths"], "torch": meta["torch"]})
        print("model done", round(time.time() - t0), flush=True)


if __name__ == "__main__":
    main()


def plot(path_json: str, path_png: str) -> None:
    """PNG of ``ops_h200.json``: invariant / fast and invariant / framework time per op over M."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.runner import save_figure

    rep = json.load(open(path_json))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, key, title in ((axes[0], "ratio", "invariant / fast"), (axes[1], "invariant_vs_framework",
                                                                     "invariant / framework")):
        for op in dict.fromkeys(r["op"] for r in rep["results"]):
            pts = [(r["M"], r[key]) for r in rep["results"] if r["op"] == op and r.get(key)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=op)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        for y in (1.0, 1.3, 1.5):
            ax.axhline(y, color="gray", lw=0.6, ls="-" if y == 1.0 else "--")
        ax.set_xlabel("M (rows)")
        ax.set_title(f"{title}, {rep['device_name']}, V4-Flash widths")
    axes[0].set_ylabel("time ratio")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_figure(fig, path_png)
