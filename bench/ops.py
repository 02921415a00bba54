"""`v4stack bench ops` / `python -m bench.ops`: each op in both modes over M, invariant / fast time ratio side by side.

Widths: ``flash`` uses V4-Flash's (d 4096, 64 heads x 512, indexer 64 x 128, 128-token window +
512 selected entries, 6 routed experts, 4 mHC streams); ``quarter`` divides every width by 4
(heads and candidate counts included) so the CPU reference can reach large M in minutes.
A case whose one call exceeds ``budget_s`` stops that op/mode from going to larger M (recorded
as null), so a run always ends. Times are medians of ``repeats`` calls after a warm-up (one
call, then one timed probe that alone counts when it is over budget).
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Callable

import torch

from bench.runner import save_figure, write_result
from v4stack import ops

DEFAULT_MS = (1, 4, 16, 64, 256, 1024, 4096)
WIDTHS = {
    "flash": dict(d=4096, H=64, c=512, ih=64, ic=128, S=1024, K=640, k=6, n=4, pool=8),
    "quarter": dict(d=1024, H=16, c=128, ih=16, ic=32, S=256, K=160, k=6, n=4, pool=8),
}
OPS = ("linear", "rms_norm", "softmax", "hc_mix", "hc_read", "hc_write", "weighted_pool",
       "indexer_scores", "attention_with_sink", "moe_combine", "silu")


def _inputs(op: str, M: int, w: dict, dtype, device) -> tuple[Callable, tuple]:
    g = torch.Generator(device="cpu").manual_seed(M)

    def r(*s, dt=dtype):
        return torch.randn(*s, generator=g).to(device=device, dtype=dt)

    d, n = w["d"], w["n"]
    f32 = torch.float32
    if op == "linear":
        return ops.linear, (r(M, d), r(d, d))
    if op == "rms_norm":
        return (lambda x, wt: ops.rms_norm(x, wt, 1e-6)), (r(M, d), r(d))
    if op == "softmax":
        return (lambda x: ops.softmax(x, -1)), (r(M, d, dt=f32),)
    if op == "hc_mix":
        return (lambda x, fn: ops.hc_mix(x, fn, 1e-6)), (r(M, n * d, dt=f32), r(n * n + 2 * n, n * d, dt=f32))
    if op == "hc_read":
        return ops.hc_read, (r(M, n, d), r(M, n, dt=f32).sigmoid())
    if op == "hc_write":
        return ops.hc_write, (r(M, n, d), r(M, d), r(M, n, dt=f32), r(M, n, n, dt=f32).softmax(-1))
    if op == "weighted_pool":
        return (lambda kv, s: ops.weighted_pool(kv, s, 1)), (r(M, w["pool"], w["c"], dt=f32),
                                                               r(M, w["pool"], w["c"], dt=f32))
    if op == "indexer_scores":
        return ops.indexer_scores, (r(M, w["ih"], w["ic"]), r(M, w["ih"]), r(w["S"], w["ic"]))
    if op == "attention_with_sink":
        mask = torch.ones(M, w["K"], dtype=torch.bool, device=device)
        return (lambda q, k, m, s: ops.attention_with_sink(q, k, m, s, w["c"] ** -0.5)), (
            r(M, w["H"], w["c"]), r(M, w["K"], w["c"]), mask, r(w["H"], dt=f32))
    if op == "moe_combine":
        idx = torch.stack([torch.randperm(256, generator=g)[: w["k"]] for _ in range(M)]).to(device)
        return ops.moe_combine, (r(M, w["k"], d, dt=f32), idx)
    if op == "silu":
        return ops.silu, (r(M, d, dt=f32),)
    raise ValueError(f"op must be one of {list(OPS)}, got {op!r}")


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _time(fn, args, repeats: int, device, budget_s: float) -> float:
    fn(*args)  # warm-up: kernel compilation, allocator, caches
    _sync(device)
    t0 = time.perf_counter()
    fn(*args)
    _sync(device)
    probe = time.perf_counter() - t0
    if probe > budget_s:  # over budget already: one timed call is enough
        return probe
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_ops(ms=DEFAULT_MS, widths: str = "quarter", dtype: str = "bfloat16", device: str = "cpu",
              repeats: int = 3, budget_s: float = 2.0, op_names=OPS, out: str | None = None,
              plot: str | None = None) -> dict:
    """Time every op in ``fast`` and ``invariant`` mode; returns (and writes) the JSON report."""
    if widths not in WIDTHS:
        raise ValueError(f"widths must be one of {list(WIDTHS)}, got {widths!r}")
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    ms = sorted(set(int(m) for m in ms))
    if not ms or ms[0] < 1:
        raise ValueError(f"ms must be positive integers, got {ms}")
    w, dt = WIDTHS[widths], getattr(torch, dtype)
    rows = []
    with torch.no_grad():
        for op in op_names:
            stopped = {"fast": False, "invariant": False}
            for M in ms:
                row = {"op": op, "M": M}
                fn, args = _inputs(op, M, w, dt, device)
                for mode in ("fast", "invariant"):
                    t = None
                    if not stopped[mode]:
                        with ops.mode(mode):
                            t = _time(fn, args, repeats, device, budget_s)
                        stopped[mode] = t > budget_s
                    row[f"{mode}_s"] = t
                f, i = row["fast_s"], row["invariant_s"]
                row["ratio"] = (i / f) if (f and i) else None
                rows.append(row)
    rep = {
        "bench": "ops", "widths": widths, "width_values": w, "dtype": dtype, "device": device,
        "device_name": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "repeats": repeats, "budget_s": budget_s,
        "results": rows,
    }
    if out:
        write_result(out, rep)
    if plot:
        plot_ratios(rep, plot)
    return rep




def plot_ratios(rep: dict, path: str) -> None:
    """PNG: invariant / fast time ratio per op over M (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for op in dict.fromkeys(r["op"] for r in rep["results"]):
        pts = [(r["M"], r["ratio"]) for r in rep["results"] if r["op"] == op and r["ratio"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("M (rows)")
    ax.set_ylabel("invariant / fast time")
    ax.set_title(f"ops slowdown, {rep['device_name']} ({rep['widths']} widths, {rep['dtype']})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def format_table(rep: dict) -> str:
    lines = [f"{'op':<22}{'M':>6}{'fast ms':>12}{'invariant ms':>14}{'ratio':>9}"]
    for r in rep["results"]:
        f = f"{r['fast_s'] * 1e3:.3f}" if r["fast_s"] is not None else "-"
        i = f"{r['invariant_s'] * 1e3:.3f}" if r["invariant_s"] is not None else "-"
        x = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        lines.append(f"{r['op']:<22}{r['M']:>6}{f:>12}{i:>14}{x:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="bench ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--widths", default="quarter", help="flash or quarter")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32")
    p.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)), help="comma-separated M values")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated op names")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=2.0, help="stop an op/mode past this time per call")
    p.add_argument("--out", default="bench/results/ops_cpu.json")
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    try:
        rep = bench_ops(ms=[int(m) for m in a.ms.split(",")], widths=a.widths, dtype=a.dtype, device=a.device,
                        repeats=a.repeats, budget_s=a.budget_s, op_names=a.ops.split(","), out=a.out, plot=a.plot)
    except ValueError as e:
        p.error(str(e))
    print(format_table(rep))


if __name__ == "__main__":
    main()
