"""``v4stack bench megamoe`` / ``python -m bench.megamoe``: MegaMoE vs the all-to-all baseline, side by side.

For each routing (uniform, Zipf) and each tokens-per-rank size, both paths run the same layer
calls on the same inputs. Reported per (routing, size, path):

- ``p50_ms`` / ``p99_ms``: latency of one layer call (the slowest rank's time per call, each call
  started from a barrier);
- ``throughput_tok_s``: steady state, calls back to back (in a few blocks), global tokens per second;
- ``link_GB_s``: rows that crossed ranks (dispatch + combine bytes) per p50 call time.

The two paths alternate call by call, so a busy host slows both alike. The ranks are real processes (gloo on one host, or ``torchrun`` / CUDA when launched that way).
On a CPU host the numbers are only good for ratios between the two paths.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.runner import write_result

DEFAULTS = dict(world=2, tokens=(1, 16, 128, 512), hidden=512, inner=256, experts=16, topk=4,
                iters=20, warmup=3, routings=("uniform", "zipf"), tile=16, ring_tiles=8, gemm="tile",
                seed=0, device="cpu")


def _layer(cfg: dict):
    from v4stack.config import preset
    from v4stack.model.moe import MoE

    mc = dataclasses.replace(preset("tiny"), hidden_size=cfg["hidden"], moe_intermediate_size=cfg["inner"],
                             n_routed_experts=cfg["experts"], num_experts_per_tok=cfg["topk"]).validate()
    moe = MoE(mc, layer_id=mc.num_hash_layers)
    g = torch.Generator().manual_seed(cfg["seed"])
    with torch.no_grad():
        for _, p in moe.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1))
    return moe.eval()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_rank(cfg: dict) -> list[dict] | None:
    """One rank's side of the benchmark (process group already initialised); rank 0 returns rows."""
    from v4stack.megamoe.baseline import AllToAllMoE
    from v4stack.megamoe.experts import ExpertShard
    from v4stack.megamoe.pull import MegaMoE
    from v4stack.megamoe.routing import routing

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(cfg["device"])
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    moe = _layer(cfg).to(device)
    shard = ExpertShard.from_moe(moe, rank, world, tile=cfg["tile"], gemm=cfg["gemm"])
    paths = {
        "megamoe": MegaMoE(shard, max_tokens=max(cfg["tokens"]), device=device, ring_tiles=cfg["ring_tiles"]),
        "baseline": AllToAllMoE(shard),
    }
    h, elem = cfg["hidden"], 2 + 4  # bf16 dispatch + fp32 combine bytes per element
    rows = []
    for kind in cfg["routings"]:
        for n in cfg["tokens"]:
            g = torch.Generator().manual_seed(cfg["seed"] * 1000 + n)
            x_all = torch.randn(world * n, h, generator=g).to(torch.bfloat16)
            idx_all, w_all = routing(kind, world * n, cfg["experts"], cfg["topk"], g)
            mine = slice(rank * n, (rank + 1) * n)
            x, idx, w = x_all[mine].to(device), idx_all[mine], w_all[mine].to(device)
            outs = {}
            for path in paths.values():
                for _ in range(cfg["warmup"]):
                    path(x, idx, w)
            # the paths alternate call by call (and block by block), so both see the same host load
            lat = {name: [] for name in paths}
            for _ in range(cfg["iters"]):
                for name, path in paths.items():
                    dist.barrier()
                    sync()
                    t0 = time.perf_counter()
                    outs[name] = path(x, idx, w)
                    sync()
                    lat[name].append(time.perf_counter() - t0)
            busy = {name: 0.0 for name in paths}
            blocks = max(1, min(4, cfg["iters"]))
            for b in range(blocks):
                for name, path in paths.items():
                    dist.barrier()
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(cfg["iters"] // blocks):
                        path(x, idx, w)
                    sync()
                    busy[name] += time.perf_counter() - t0
            calls = blocks * (cfg["iters"] // blocks)
            for name, path in paths.items():
                lat_t = torch.tensor(lat[name], dtype=torch.float64)
                dist.all_reduce(lat_t, op=dist.ReduceOp.MAX)
                remote = (path.last.remote_rows if name == "megamoe" else path.last_remote_rows)
                remote_t = torch.tensor([remote], dtype=torch.float64)
                dist.all_reduce(remote_t)
                total = torch.tensor([busy[name]], dtype=torch.float64)
                dist.all_reduce(total, op=dist.ReduceOp.MAX)
                lat_ms = [v * 1e3 for v in lat_t.tolist()]
                p50 = _pct(lat_ms, 0.5)
                link_bytes = float(remote_t) * (h * elem + 4)
                rows.append(dict(routing=kind, tokens_per_rank=n, path=name, p50_ms=p50,
                                 p99_ms=_pct(lat_ms, 0.99), mean_ms=statistics.fmean(lat_ms),
                                 throughput_tok_s=world * n * calls / float(total),
                                 remote_rows=int(remote_t), link_GB_s=link_bytes / (p50 * 1e-3) / 1e9))
            same = torch.tensor([int(torch.equal(outs["megamoe"], outs["baseline"]))])
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
            rows[-1]["bit_identical"] = rows[-2]["bit_identical"] = bool(same)
    paths["megamoe"].close()
    return rows if rank == 0 else None


def summarize(rows: list[dict]) -> list[dict]:
    by = {(r["routing"], r["tokens_per_rank"], r["path"]): r for r in rows}
    out = []
    for (kind, n, path), r in by.items():
        if path != "megamoe":
            continue
        b = by[(kind, n, "baseline")]
        out.append(dict(routing=kind, tokens_per_rank=n, speedup_p50=b["p50_ms"] / r["p50_ms"],
                        speedup_throughput=r["throughput_tok_s"] / b["throughput_tok_s"],
                        bit_identical=r["bit_identical"]))
    return out


def _spawned(rank: int, world: int, port: int, cfg: dict, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = run_rank(cfg)
        if rows is not None:
            Path(result_path).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = report["config"]["routings"]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 3.6), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for path, style in (("megamoe", "o-"), ("baseline", "s--")):
            rs = [r for r in report["results"] if r["routing"] == kind and r["path"] == path]
            ax.plot([r["tokens_per_rank"] for r in rs], [r["p50_ms"] for r in rs], style, label=path)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{kind} routing, EP{report['config']['world']}")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("p50 ms per layer call")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def bench_megamoe(out: str | None = "bench/results/megamoe.json", plot: bool = True, **overrides) -> dict:
    """Run the benchmark (spawning ``world`` gloo processes, or in place under ``torchrun``) and
    write the JSON report (and a PNG next to it). Returns the report."""
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown bench option(s) {sorted(unknown)}; allowed: {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **overrides}
    cfg["tokens"], cfg["routings"] = list(cfg["tokens"]), list(cfg["routings"])
    for name in ("world", "hidden", "inner", "experts", "topk", "iters", "tile", "ring_tiles"):
        if not (isinstance(cfg[name], int) and cfg[name] > 0):
            raise ValueError(f"{name} must be a positive integer, got {cfg[name]!r}")
    if cfg["experts"] % cfg["world"]:
        raise ValueError(f"world ({cfg['world']}) must divide experts ({cfg['experts']})")
    if not cfg["tokens"] or min(cfg["tokens"]) < 1:
        raise ValueError(f"tokens must be positive sizes, got {cfg['tokens']!r}")
    if "RANK" in os.environ and dist.is_available():  # launched by torchrun
        backend = "nccl" if cfg["device"] == "cuda" else "gloo"
        if cfg["device"] == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            cfg["device"] = f"cuda:{torch.cuda.current_device()}"
        dist.init_process_group(backend)
        cfg["world"] = dist.get_world_size()
        rows = run_rank(cfg)
        dist.destroy_process_group()
        if rows is None:
            return {}
    else:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            res = os.path.join(tmp, "rows.json")
            mp.spawn(_spawned, args=(cfg["world"], _free_port(), cfg, res), nprocs=cfg["world"], join=True)
            rows = json.loads(Path(res).read_text())
    report = {
        "what": "MegaMoE (pull dispatch, waves, ring) vs all_to_all_single baseline, same math",
        "note": "ranks are processes on one host; CPU numbers are for ratios only",
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "config": cfg,
        "results": rows,
        "summary": summarize(rows),
    }
    if out:
        path = write_result(out, report)
        if plot:
            _plot(report, path.with_suffix(".png"))
    return report


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="bench megamoe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("world", "hidden", "inner", "experts", "topk", "iters", "warmup", "tile", "ring_tiles", "seed"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=DEFAULTS[name])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULTS["tokens"]))
    ap.add_argument("--routings", nargs="+", default=list(DEFAULTS["routings"]))
    ap.add_argument("--gemm", default=DEFAULTS["gemm"], choices=["row", "tile"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="bench/results/megamoe.json")
    a = vars(ap.parse_args(argv))
    out = a.pop("out")
    try:
        report = bench_megamoe(out=out, **a)
    except ValueError as e:
        ap.error(str(e))
    if report:
        print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
