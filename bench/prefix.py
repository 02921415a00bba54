"""``bench prefix``: one shared-prefix workload restored from disk under each SWA strategy.

A warm engine computes every shared prefix once; the on-disk store (``serve/cache/disk.py``)
saves it under each strategy into its own directory. Then every request (a shared prefix + its own
tail) runs on a cold engine (empty memory, as after a restart or an eviction): the store restores
what it can, the engine computes the rest. Per strategy: disk bytes per prefix token, restore
latency (for ``none`` it includes the recompute of the window cone), tokens recomputed, time to
first token end to end (restore + prefill + first sample),
and whether the tokens equal the no-store run. ``recompute`` is the no-store baseline. The files
are read back right after they were written, so restore latency is from the page cache, not the
device; the JSON says so.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.runner import save_figure, write_result

from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.serve.cache.disk import DiskPrefixStore
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams


def _first_token(engine: Engine, prompt: list[int], rid: str):
    req = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.7, seed=1), rid)
    while engine.has_work():
        engine.step()
    return req


def bench_prefix(preset_name: str = "tiny", prefixes: int = 3, prefix_len: int = 232, suffix_len: int = 8,
                 requests_per_prefix: int = 2, strategies: tuple[str, ...] = ("full", "periodic:64", "periodic:128", "none"),
                 rounds: int = 2, seed: int = 0, out: str | None = "bench/results/prefix_cpu_tiny.json", plot: bool = True,
                 store_dir: str | None = None) -> dict:
    """Run the workload; write JSON to ``out`` (and a PNG next to it when ``plot``)."""
    for name, v, lo in (("prefixes", prefixes, 1), ("prefix_len", prefix_len, 1), ("suffix_len", suffix_len, 1),
                        ("requests_per_prefix", requests_per_prefix, 1), ("rounds", rounds, 1)):
        if v < lo:
            raise ValueError(f"bench prefix: '{name}' must be >= {lo}, got {v}")
    cfg = preset(preset_name)
    model = V4Model(cfg, seed=0).cast(torch.float32).eval()
    need = -(-(prefix_len + suffix_len + 4) // cfg.block_tokens) + 2
    ecfg = EngineConfig(n_blocks=max(64, prefixes * need), n_slots=4, token_budget=max(256, prefix_len + suffix_len))
    g = torch.Generator().manual_seed(seed)
    shared = [torch.randint(1, 256, (prefix_len,), generator=g).tolist() for _ in range(prefixes)]
    work = [(i, shared[i] + torch.randint(1, 256, (suffix_len,), generator=g).tolist())
            for i in range(prefixes) for _ in range(requests_per_prefix)]
    res = {"what": "shared-prefix requests on a cold engine, prefix restored from the on-disk store",
           "preset": preset_name, "prefixes": prefixes, "prefix_len": prefix_len, "suffix_len": suffix_len,
           "requests": len(work), "rounds": rounds, "torch_threads": torch.get_num_threads(), "block_tokens": cfg.block_tokens, "sliding_window": cfg.sliding_window,
           "layers": cfg.num_hidden_layers, "page_cache": "warm (files read right after writing)",
           "recomputed": "prompt tokens the engine computed + tokens recomputed to rebuild the window (none)",
           "strategies": {}}
    with tempfile.TemporaryDirectory(dir=store_dir) as tmp:
        warm = Engine(model, ecfg)
        spec = warm.cache.spec
        res["tensor_bytes"] = {"blocks_per_token": sum(spec.bytes_per_token().values()),
                               "state_per_boundary": spec.slot_bytes(),
                               "note": "raw tensor bytes; each file adds 40 bytes (magic + digest)"}
        for i, p in enumerate(shared):
            _first_token(warm, p + [1], f"warm{i}")
        stores = {}
        for s in strategies:
            st = DiskPrefixStore(Path(tmp) / s.replace(":", "_"), warm.cache, s, model=model)
            for p in shared:
                st.save(p)
            stores[s] = st
        names = ("recompute",) + tuple(strategies)
        acc = {n: {"ttft": [], "restore": [], "recomputed": [], "cone": [], "toks": []} for n in names}
        for _ in range(rounds):  # interleaved, so load from other work falls on every strategy alike
            for k, (i, prompt) in enumerate(work):
                for name in names:
                    a = acc[name]
                    eng = Engine(model, ecfg)
                    t0 = time.perf_counter()
                    cone = 0
                    if name != "recompute":
                        info = DiskPrefixStore(stores[name].root, eng.cache, name, model=model).restore(prompt)
                        a["restore"].append(info.seconds)
                        cone = info.cone_tokens
                        a["cone"].append(cone)
                    req = eng.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.7, seed=1), f"q{k}")
                    while req.first_token_at is None:
                        eng.step()
                    a["ttft"].append(time.perf_counter() - t0)
                    a["recomputed"].append(len(prompt) - eng.cache.prefix_hit_tokens + cone)
                    while eng.has_work():
                        eng.step()
                    a["toks"].append(req.output)
        for name in names:
            a = acc[name]
            row = {"ttft_ms_p50": 1e3 * statistics.median(a["ttft"]), "ttft_ms_mean": 1e3 * statistics.fmean(a["ttft"]),
                   "recomputed_tokens_mean": statistics.fmean(a["recomputed"]),
                   "tokens_equal_recompute": a["toks"] == acc["recompute"]["toks"], "samples": len(a["ttft"])}
            if name != "recompute":
                b = stores[name].disk_bytes()
                row.update({"restore_ms_p50": 1e3 * statistics.median(a["restore"]),
                            "restore_ms_mean": 1e3 * statistics.fmean(a["restore"]),
                            "cone_tokens_mean": statistics.fmean(a["cone"]), "disk_bytes": b,
                            "disk_bytes_per_prefix_token": (b["blocks"] + b["states"]) / (prefixes * prefix_len)})
            res["strategies"][name] = row
    if out:
        write_result(out, res)
        if plot:
            _plot(res, Path(out).with_suffix(".png"))
    return res


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["strategies"])
    rows = [res["strategies"][n] for n in names]
    panels = [("disk bytes / prefix token", [r.get("disk_bytes_per_prefix_token", 0) for r in rows]),
              ("restore latency p50 (ms)", [r.get("restore_ms_p50", 0) for r in rows]),
              ("tokens recomputed / request", [r["recomputed_tokens_mean"] for r in rows]),
              ("TTFT end to end p50 (ms)", [r["ttft_ms_p50"] for r in rows])]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    for ax, (title, vals) in zip(axes, panels):
        ax.bar(names, vals, color=["#888"] + ["#3b7dd8"] * (len(names) - 1))
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(f"prefix restore from disk, {res['preset']} preset, prefix {res['prefix_len']} tokens "
                 f"(block {res['block_tokens']}, window {res['sliding_window']})", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="bench prefix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prefixes", type=int, default=3)
    ap.add_argument("--prefix-len", type=int, default=232)
    ap.add_argument("--suffix-len", type=int, default=8)
    ap.add_argument("--requests-per-prefix", type=int, default=2)
    ap.add_argument("--strategies", default="full,periodic:64,periodic:128,none")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/prefix_cpu_tiny.json")
    a = ap.parse_args(argv)
    try:
        res = bench_prefix(a.preset, a.prefixes, a.prefix_len, a.suffix_len, a.requests_per_prefix,
                           tuple(s for s in a.strategies.split(",") if s), rounds=a.rounds, out=a.out)
    except ValueError as e:
        ap.error(str(e))
    for name, r in res["strategies"].items():
        print(f"{name:<13} disk B/token {r.get('disk_bytes_per_prefix_token', 0):9.1f}   restore p50 "
              f"{r.get('restore_ms_p50', 0):8.2f} ms   recomputed {r['recomputed_tokens_mean']:6.1f}   "
              f"TTFT p50 {r['ttft_ms_p50']:8.2f} ms   equal {r['tokens_equal_recompute']}")
    print(f"JSON in {a.out}")


if __name__ == "__main__":
    main()
