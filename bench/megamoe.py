"""``v4stack bench megamoe`` / ``python -m bench.megamoe``: MegaMoE vs the all-to-all baseline.

    torchrun --nproc-per-node 2 -m bench.megamoe --device cuda      # one GPU per rank (EP2)
    torchrun --nproc-per-node 8 -m bench.megamoe --device cuda --out bench/results/megamoe_ep8_h200.json
    python -m bench.megamoe --shapes tiny --tokens 1 8 32           # CPU: gloo processes, ratios only

Expert shapes default to V4-Flash (hidden 4096, width 2048, 256 experts, top-6) and V4-Pro
(7168, 3072, 384, top-6), each rank holding n_routed / EP experts with random bf16 weights. For
each shape, routing (uniform, Zipf) and tokens per rank, both paths run the same calls on the same
inputs, alternating. Per (shape, routing, tokens, path):

- ``p50_ms`` / ``p99_ms``: one layer call, slowest rank, each call started together;
- ``throughput_tok_s``: calls back to back, global tokens per second;
- ``link_GB_s``: bytes that crossed ranks per rank (dispatch rows + weights + combine rows) / p50;
- ``limit_ms``: max(expert FLOPs / measured bf16 matmul rate, link bytes / measured peer-copy
  rate), the time a perfectly overlapped layer would take, and ``frac_of_limit`` = limit / p50;
- ``bit_identical``: MegaMoE's output equals the baseline's bitwise on every rank.

On CUDA a third path, ``megamoe_graph``, replays the same MegaMoE call captured as a CUDA graph
(one per tokens-per-rank bucket, as a serving engine would): the call reads nothing back to the
host, so it can be captured; the baseline cannot (its split sizes need a host read).

On CUDA MegaMoE is the device-side pipeline and the baseline runs the same grouped kernels after
an ``all_to_all_single`` exchange; on CPU both run the model's expert math (ratios only).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a file (torchrun bench/megamoe.py): make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from bench.timing import cuda_median, cuda_times

SHAPES = {  # hidden, expert width, routed experts, top-k
    "flash": (4096, 2048, 256, 6),
    "pro": (7168, 3072, 384, 6),
    "tiny": (64, 32, 8, 2),
}
DEFAULTS = dict(shapes=("flash", "pro"), tokens=(1, 32, 512, 4096, 8192), routings=("uniform", "zipf"),
                iters=20, warmup=3, device="cpu", dispatch="bf16", seed=0, world=2, graphs=True)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _experts(shape: str, rank: int, world: int, device, seed: int):
    from v4stack.megamoe.experts import LocalExperts

    h, d, E, k = SHAPES[shape]
    nl = E // world
    g = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    w = [(torch.randn(nl, n, kk, generator=g, device=device) * kk ** -0.5).to(torch.bfloat16)
         for n, kk in ((d, h), (d, h), (h, d))]
    if device.type == "cpu":
        w = [t.float() for t in w]
    return LocalExperts.from_stacked(w[0], w[1], w[2], first=rank * nl, n_experts=E, topk=k, limit=10.0)


def _ceilings(device, world: int, rank: int) -> tuple[float, float, float]:
    """(bf16 matmul FLOP/s, peer-read bytes/s, HBM bytes/s read+written) measured here (CPU: rough,
    for the ratio only)."""
    if device.type != "cuda":
        return 50e9, 5e9, 20e9
    from v4stack.megamoe.symm import symmetric_buffer

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ts = cuda_times(lambda: a @ b, 10)
    flops = 2 * 8192**3 / statistics.median(ts)
    buf = symmetric_buffer({"x": ((1 << 28,), torch.bfloat16)}, None, device)  # 512 MiB
    dst = torch.empty(1 << 28, dtype=torch.bfloat16, device=device)
    peer = buf.remote((rank + 1) % world, "x")
    buf.barrier()
    ts = cuda_times(lambda: dst.copy_(peer), 10)
    buf.barrier()
    torch.cuda.synchronize()
    buf.close()
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    big = torch.empty_like(src)
    hbm = 2 * (1 << 30) / cuda_median(lambda: big.copy_(src), 10)
    del src, big
    return flops, (1 << 29) / statistics.median(ts), hbm


def run_rank(cfg: dict, checkpoint=None) -> list[dict] | None:
    from v4stack.megamoe.backend import ExpertParallel, make_transport
    from v4stack.megamoe.fp8 import FP8
    from v4stack.megamoe.pipeline import DevicePipeline
    from v4stack.megamoe.routing import routing

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(cfg["device"])
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    dd = FP8 if cfg["dispatch"] == "fp8" else torch.bfloat16
    peak, link, hbm = _ceilings(device, world, rank)
    graph_error = None
    rows = []
    for shape in cfg["shapes"]:
        h, d, E, k = SHAPES[shape]
        ex = _experts(shape, rank, world, device, cfg["seed"])
        mt = max(cfg["tokens"])
        a2a = make_transport("all_to_all", n_experts=E, topk=k, hidden=h, max_tokens=mt, device=device)
        paths = {"baseline": ExpertParallel(None, a2a, experts=ex, dispatch_dtype=dd, kernels=cuda)}
        if cuda:
            pipe = DevicePipeline(ex, max_tokens=mt, device=device, dispatch_dtype=dd)
            paths["megamoe"] = lambda x, w, i, n: pipe(x, w, i, peer_tokens=n)
            graphs = {}

            def graphed(x, w, i, n):  # one CUDA graph per tokens-per-rank bucket, captured on first use
                if n not in graphs:
                    graphs.clear()  # keep one graph's private pool alive at a time
                    graphs[n] = pipe.graphed(n, peer_tokens=n)
                return graphs[n](x, w, i)
        else:
            sym = make_transport("megamoe", n_experts=E, topk=k, hidden=h, max_tokens=mt, device=device)
            paths["megamoe"] = ExpertParallel(None, sym, experts=ex, dispatch_dtype=dd, kernels=False)
        calls = {"baseline": lambda x, w, i, n: paths["baseline"].infer(x, w, i),
                 "megamoe": paths["megamoe"] if cuda else (lambda x, w, i, n: paths["megamoe"].infer(x, w, i))}
        if cuda and cfg["graphs"]:
            try:  # a capture that fails drops the graph rows and says why, rather than the run
                graphs[min(cfg["tokens"])] = pipe.graphed(min(cfg["tokens"]), peer_tokens=min(cfg["tokens"]))
                calls["megamoe_graph"] = graphed
            except Exception as e:  # noqa: BLE001
                graph_error = f"{type(e).__name__}: {e}"[:500]
        for kind in cfg["routings"]:
            for n in cfg["tokens"]:
                g = torch.Generator().manual_seed(cfg["seed"] * 1000 + n)
                x_all = torch.randn(world * n, h, generator=g).to(torch.bfloat16)
                idx_all, w_all = routing(kind, world * n, E, k, g)
                mine = slice(rank * n, (rank + 1) * n)
                x, idx, w = x_all[mine].to(device), idx_all[mine].to(device), w_all[mine].to(device)
                owner = idx_all // (E // world)
                src = torch.arange(world * n).unsqueeze(1) // n
                remote = (owner != src).sum().item() / world          # rows a rank sends/receives, average
                mine_rows = (owner == rank).sum().item()
                iters = cfg["iters"] if n < 4096 else max(5, cfg["iters"] // 2)
                outs, lat = {}, {p: [] for p in calls}
                for _ in range(cfg["warmup"]):
                    for p, fn in calls.items():
                        outs[p] = fn(x, w, idx, n)
                for _ in range(iters):
                    for p, fn in calls.items():
                        sync()
                        dist.barrier()
                        t0 = time.perf_counter()
                        outs[p] = fn(x, w, idx, n)
                        sync()
                        lat[p].append(time.perf_counter() - t0)
                same = torch.tensor([int(all(torch.equal(outs[p], outs["baseline"]) for p in calls))])
                busy = {}
                for p, fn in calls.items():
                    sync()
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        fn(x, w, idx, n)
                    sync()
                    busy[p] = time.perf_counter() - t0
                nl_ = E // world
                active_mine = len(set((idx_all[owner == rank] - rank * nl_).tolist()))
                stats = torch.tensor([same.item(), mine_rows, active_mine], dtype=torch.float64)
                gathered = [torch.zeros_like(stats) for _ in range(world)]
                dist.all_gather(gathered, stats)
                ok = all(bool(t[0]) for t in gathered)
                max_rows = max(float(t[1]) for t in gathered)
                byte_row = h * (1 if dd == FP8 else 2) + (4 * -(-h // 128) if dd == FP8 else 0) + 4 + h * 4
                link_bytes = remote * byte_row
                active = max(float(t[2]) for t in gathered)
                t_comp, t_link = 6 * h * d * max_rows / peak, link_bytes / link
                t_hbm = active * 3 * h * d * 2 / hbm        # every active expert's weights read once
                limit = max(t_comp, t_link, t_hbm)
                for p in calls:
                    lt = torch.tensor(lat[p] + [busy[p]], dtype=torch.float64)
                    dist.all_reduce(lt, op=dist.ReduceOp.MAX)
                    ms = [v * 1e3 for v in lt[:-1].tolist()]
                    p50 = _pct(ms, 0.5)
                    rows.append(dict(shape=shape, routing=kind, tokens_per_rank=n, path=p, p50_ms=p50,
                                     p99_ms=_pct(ms, 0.99), mean_ms=statistics.fmean(ms),
                                     throughput_tok_s=world * n * iters / float(lt[-1]),
                                     link_GB_s=link_bytes / (p50 * 1e-3) / 1e9, compute_ms=t_comp * 1e3,
                                     link_ms=t_link * 1e3, weights_hbm_ms=t_hbm * 1e3, limit_ms=limit * 1e3,
                                     frac_of_limit=limit * 1e3 / p50,
                                     frac_of_compute_link_limit=max(t_comp, t_link) * 1e3 / p50,
                                     bit_identical=ok, iters=iters))
                if rank == 0:
                    last = {r["path"]: r for r in rows[-len(calls):]}
                    a, b = last["megamoe"], last["baseline"]
                    gr = f" graph {last['megamoe_graph']['p50_ms']:8.3f} ms" if "megamoe_graph" in last else ""
                    print(f"{shape:5s} {kind:7s} {n:5d}  mega {a['p50_ms']:8.3f} ms  base {b['p50_ms']:8.3f} ms  "
                          f"x{b['p50_ms'] / a['p50_ms']:.2f}  link {a['link_GB_s']:6.1f} GB/s  "
                          f"limit {limit * 1e3:.3f} ms{gr}  same={ok}", flush=True)
        if cuda:
            graphs.clear()
            torch.cuda.synchronize(device)
            pipe.close()
        else:
            paths["megamoe"].transport.close()
        del paths, calls, ex
        if cuda:
            torch.cuda.empty_cache()
        if checkpoint is not None and rank == 0:  # a partial report survives a later failure
            checkpoint(rows, dict(bf16_matmul_tflops=peak / 1e12, peer_copy_GB_s=link / 1e9,
                                  hbm_copy_GB_s=hbm / 1e9, partial=True))
    meta = dict(bf16_matmul_tflops=peak / 1e12, peer_copy_GB_s=link / 1e9, hbm_copy_GB_s=hbm / 1e9,
                graph_error=graph_error)
    return (rows, meta) if rank == 0 else None


def summarize(rows: list[dict]) -> list[dict]:
    by = {(r["shape"], r["routing"], r["tokens_per_rank"], r["path"]): r for r in rows}
    out = []
    for (shape, kind, n, path), r in by.items():
        if path == "megamoe":
            b = by[(shape, kind, n, "baseline")]
            g = by.get((shape, kind, n, "megamoe_graph"))
            row = dict(shape=shape, routing=kind, tokens_per_rank=n, speedup_p50=b["p50_ms"] / r["p50_ms"],
                       speedup_throughput=r["throughput_tok_s"] / b["throughput_tok_s"],
                       frac_of_limit=r.get("frac_of_limit"), link_GB_s=r["link_GB_s"],
                       bit_identical=r["bit_identical"])
            if g:
                row.update(graph_speedup_p50=b["p50_ms"] / g["p50_ms"], graph_frac_of_limit=g["frac_of_limit"],
                           graph_frac_of_compute_link_limit=g["frac_of_compute_link_limit"],
                           graph_link_GB_s=g["link_GB_s"])
            out.append(row)
    return out


def _validate(cfg: dict) -> dict:
    unknown = set(cfg) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown bench option(s) {sorted(unknown)}; allowed: {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **cfg}
    for name in ("shapes", "tokens", "routings"):
        cfg[name] = list(cfg[name])
    bad = [s for s in cfg["shapes"] if s not in SHAPES]
    if bad or not cfg["shapes"]:
        raise ValueError(f"shapes must be among {sorted(SHAPES)}, got {cfg['shapes']!r}")
    if not cfg["tokens"] or min(cfg["tokens"]) < 1:
        raise ValueError(f"tokens must be positive sizes, got {cfg['tokens']!r}")
    if cfg["dispatch"] not in ("bf16", "fp8"):
        raise ValueError(f"dispatch must be bf16 or fp8, got {cfg['dispatch']!r}")
    for name in ("iters", "world"):
        if not (isinstance(cfg[name], int) and cfg[name] > 0):
            raise ValueError(f"{name} must be a positive integer, got {cfg[name]!r}")
    for s in cfg["shapes"]:
        if SHAPES[s][2] % cfg["world"]:
            raise ValueError(f"world ({cfg['world']}) must divide the experts of shape {s} ({SHAPES[s][2]})")
    return cfg


def _spawned(rank, world, port, cfg, result_path):
    import json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = run_rank(cfg)
        if res is not None:
            with open(result_path, "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_megamoe(out: str | None = "bench/results/megamoe.json", **overrides) -> dict:
    """Run (spawning gloo processes, or in place under torchrun) and write the stamped report."""
    import json
    import tempfile

    cfg = _validate(overrides)
    if "RANK" in os.environ:  # torchrun
        if cfg["device"].startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            cfg["device"] = f"cuda:{torch.cuda.current_device()}"
            dist.init_process_group("cpu:gloo,cuda:nccl")
        else:
            dist.init_process_group("gloo")
        cfg["world"] = dist.get_world_size()
        cfg = _validate({k: v for k, v in cfg.items()})
        res = run_rank(cfg, (lambda rows, meta: _write(out, cfg, rows, meta)) if out else None)
        dist.barrier()
        dist.destroy_process_group()
        if res is None:
            return {}
    else:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rows.json")
            mp.spawn(_spawned, args=(cfg["world"], _free_port(), cfg, path), nprocs=cfg["world"], join=True)
            with open(path) as f:
                res = json.load(f)
    rows, meta = res
    return _write(out, cfg, rows, meta)


def _write(out, cfg, rows, meta) -> dict:
    report = {"what": "MegaMoE (device-side pull, waves, ring, overlapped streams) vs all_to_all_single + the "
                      "same grouped kernels; BF16 or FP8 dispatch, fp32 combine",
              "config": cfg, "ceilings": meta, "results": rows, "summary": summarize(rows)}
    if out:
        from bench.runner import write_result

        write_result(out, report)
    return report


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="bench megamoe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULTS["shapes"]))
    ap.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULTS["tokens"]))
    ap.add_argument("--routings", nargs="+", default=list(DEFAULTS["routings"]))
    for name in ("iters", "warmup", "seed", "world"):
        ap.add_argument(f"--{name}", type=int, default=DEFAULTS[name])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dispatch", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="skip the CUDA-graph MegaMoE rows")
    ap.add_argument("--out", default="bench/results/megamoe.json")
    a = vars(ap.parse_args(argv))
    out = a.pop("out")
    report = bench_megamoe(out=out, **a)
    if report:
        print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
