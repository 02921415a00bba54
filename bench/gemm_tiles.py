"""Tile and schedule sweep of the invariant GPU kernels (one H200 call), writing stamped JSON.

The fixed-slice GEMMs (bf16 / fp32 linear, hc_mix): every candidate of ``kernels/tiles.py`` is
first checked bit for bit at M = 1, 8, 64, 256, 4096 - its whole output against the reference
tile's, rows 0-3 and M-1 against those rows computed alone, and for hc_mix the same on bf16 streams
(``hc_pre``'s input) - so a tile that changes an element's K chain is never chosen; then timed back
to back and under CUDA graphs next to the framework, with the relative error against float64 of
the kernel and of the framework (fp32: cuBLAS SGEMM). ``--warm N`` compiles the candidates in N
processes first; ``--choose`` writes the pick per size bucket (``choose``); ``--choose-from``
re-derives it from a committed result without a GPU (also for the grouped GEMM's sweep,
``bench/grouped_tiles.py``). Also: indexer rows, and the host cost of one small op call split into
its parts.

    python -m bench.gemm_tiles --only linear_bf16,linear_fp32,hc_mix --warm 14 \
        --out bench/results/gemm_tiles_h200.json --choose src/v4stack/kernels/tiles_chosen.json
    python -m bench.gemm_tiles --choose src/v4stack/kernels/tiles_chosen.json \
        --choose-from bench/results/gemm_tiles_h200.json
"""

from __future__ import annotations

import argparse
import os
import time
import traceback

import torch
import torch.nn.functional as F

from bench.runner import write_result
from bench.timing import back_to_back, graph_time, host_per_call

from v4stack.kernels import tiles as TL  # noqa: E402

BF16_TILES, F32_TILES = list(TL.HALF_CANDIDATES), list(TL.F32_CANDIDATES)
HC_TILES = list(TL.HC_CANDIDATES)
CUDA = torch.cuda.is_available()
SLICE_MS = (1, 8, 64, 256, 4096)
# (table, sweep section, M measured -> largest M of the bucket it picks for); the last bucket takes every M
BUCKETS = {"HALF_TILES": ("linear_bf16", ((1, 1), (8, 16), (64, 64), (256, 256), (4096, 1 << 62))),
           "F32_TILES": ("linear_fp32", ((1, 1), (8, 16), (64, 64), (256, 256), (4096, 1 << 62))),
           "HC_TILES": ("hc_mix", ((1, 1), (8, 16), (64, 64), (256, 256), (4096, 1 << 62))),
           "HC_HALF_TILES": ("hc_mix", ((1, 1), (8, 16), (64, 64), (256, 256), (4096, 1 << 62))),
           # the grouped GEMM (``bench/grouped_tiles.py``): by routed rows per expert, ceil(T / E)
           "GROUPED_TILES": ("grouped_per_expert", ((1, 3), (6, 12), (24, 32), (48, 96), (192, 288), (384, 1024),
                                                    (3072, 1 << 62)))}
BUCKETS.update({g: BUCKETS[b] for b, g in TL.GRAPH.items()})  # calls captured in CUDA graphs: device time alone


SOLE_TABLES = {"HC_TILES", "HC_TILES_GRAPH"}  # served with the section's own inputs only (fp32): the ``also``
# bits do not bind them


def _bits_ok(v: dict, also: bool = True) -> bool:
    return bool(v.get("bits_equal_alone") and v.get("bits_equal_ref", True)
                and (not also or v.get("bits_equal_also", True)))


def _cost(v: dict) -> float:
    """Device time under CUDA graphs plus time back to back: both count (decode runs in graphs,
    other calls eagerly), and a tile whose host launch outlasts its kernel (the TMA kernel's
    descriptors at small M) pays for it."""
    return v.get("graph_s", 0.0) + v["s"]


def _graph_cost(v: dict) -> float:
    """Device time under CUDA graphs alone: the cost of a tile in the ``*_GRAPH`` tables."""
    return v.get("graph_s", v["s"])


def choose(rec: dict, margin: float = 0.03, defaults: dict | None = None) -> dict:
    """Per bucket: the cheapest bit-identical candidate at the bucket's measured M (``_cost``; for the
    ``*_GRAPH`` tables ``_graph_cost``), if it
    beats the shipped default by more than ``margin`` or the default is not bit-identical; else the
    default. A bucket whose M the sweep did not measure (``--ms``) keeps the shipped tile. Adjacent
    buckets with the same tile are merged. ``defaults``: tables in place of the shipped ones."""
    tables = {}
    for table, (section, buckets) in BUCKETS.items():
        rows = {r["M"]: r for r in rec.get(section, [])}
        if not any(m in rows for m, _ in buckets):
            continue
        out = []
        for m, top in buckets:
            default = TL.pick((defaults or {}).get(table) or getattr(TL, table), m)
            if m not in rows:  # not measured: the shipped tile stays
                if out and out[-1][1] == default:
                    out[-1][0] = top
                else:
                    out.append([top, default])
                continue
            ok = [v for v in rows[m]["variants"] if _bits_ok(v, table not in SOLE_TABLES) and "s" in v]
            t = _graph_cost if table.endswith("_GRAPH") else _cost
            base = next((t(v) for v in ok if v["tile"] == default), None)
            best = min(ok, key=t) if ok else None
            keep = best is None or (base is not None and t(best) > base * (1 - margin))  # a default whose
            # bits differ (or that did not run) is never kept
            tile = default if keep else best["tile"]
            if out and out[-1][1] == tile:
                out[-1][0] = top
            else:
                out.append([top, tile])
        tables[table] = out
    return tables


def write_choice(path: str, source: str, chosen: dict, graph_rows: dict | None = None) -> None:
    """Install ``chosen`` tables into the pick file at ``path``, keeping its other tables and
    recording ``source`` (the sweep result) for each table it replaces; a replaced table's
    hand overrides (``overrides``: buckets set from another measurement) go with it.
    ``graph_rows``: the most rows a graph table was measured at (``tiles.GRAPH_ROWS``)."""
    import json

    from v4stack.atomic import atomic_write

    raw = json.loads(open(path).read()) if os.path.exists(path) else {}
    sources = {**raw.get("sources", {}), **{k: source for k in chosen}}
    out = {**raw, "source": source, "sources": sources, "tables": {**raw.get("tables", {}), **chosen}}
    if graph_rows:
        out["graph_rows"] = {**raw.get("graph_rows", {}), **graph_rows}
    overrides = {k: v for k, v in raw.get("overrides", {}).items() if k not in chosen}
    if overrides:
        out["overrides"] = overrides
    else:
        out.pop("overrides", None)
    atomic_write(path, (json.dumps(out, indent=1) + "\n").encode())


_ON_ROW = None


def _time(fn, target_s=0.02) -> float:
    if not CUDA:  # a dry run of the script's logic
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return back_to_back(fn, target_s)


def _graph_time(fn, target_s=0.02) -> float:
    """Device time per call: ``fn`` captured 20 times in one CUDA graph, replayed."""
    return graph_time(fn, 20, target_s) if CUDA else _time(fn)


def _host_p50(fn, batches=50, per=50) -> float:
    return host_per_call(fn, batches, per) if CUDA else _time(fn)


def _rel_err(y, want) -> float:
    return float(((y.double() - want).abs().max() / want.abs().max().clamp(min=1e-300)).item())


def _variants(name, run, tiles, ms, make, framework, rec, ref_tile, exact=None, target_s=0.02, also=None):
    """For every tile at every M: all rows equal to the reference tile's (``bits_equal_ref``), rows
    0..3 and M-1 equal to those rows computed alone by the reference tile (``bits_equal_alone``),
    then time back to back (``s``) and under CUDA graphs (``graph_s``). ``exact``: a float64
    reference of the batch, for the relative error of each variant and of the framework. ``also``:
    other inputs of the same call (hc_mix: bf16 streams, as ``hc_pre`` passes them), checked the
    same way into ``bits_equal_also``."""
    xs = make(max(ms))
    for M in ms:
        args = tuple(t[:M] for t in xs)
        probe = sorted({i for i in (0, 1, 2, 3, M - 1) if 0 <= i < M})
        alone = {i: run(ref_tile, *(t[i:i + 1] for t in args)) for i in probe}
        ref = run(ref_tile, *args)
        if also is not None:
            args2 = also(*args)
            alone2 = {i: run(ref_tile, *(t[i:i + 1] for t in args2)) for i in probe}
            ref2 = run(ref_tile, *args2)
        row = {"M": M, "framework_s": _time(lambda: framework(*args), target_s),
               "framework_graph_s": _graph_time(lambda: framework(*args), target_s), "variants": []}
        want = exact(*args) if exact is not None else None
        if want is not None:
            row["framework_rel_err"] = _rel_err(framework(*args), want)
            row["rel_err"] = _rel_err(ref, want)
        for tile in tiles:
            v = {"tile": tile}
            try:
                y = run(tile, *args)
                v["bits_equal_ref"] = bool(torch.equal(y, ref))
                v["bits_equal_alone"] = all(torch.equal(y[i:i + 1], alone[i]) for i in probe)
                if also is not None:
                    y2 = run(tile, *args2)
                    v["bits_equal_also"] = bool(torch.equal(y2, ref2)) and all(torch.equal(y2[i:i + 1], alone2[i])
                                                                               for i in probe)
                v["s"] = _time(lambda: run(tile, *args), target_s)
                v["graph_s"] = _graph_time(lambda: run(tile, *args), target_s)
                v["vs_framework"] = v["graph_s"] / row["framework_graph_s"]
            except Exception as e:  # a variant that does not build is recorded, the rest still run
                v["error"] = repr(e)[:300]
            row["variants"].append(v)
        ok = [v for v in row["variants"] if _bits_ok(v)]
        best = min(ok, key=_cost) if ok else None
        row["best"] = best
        print(f"{name:<12}{M:>6} fw {row['framework_graph_s'] * 1e6:8.1f}us best "
              f"{(best['graph_s'] * 1e6 if best else float('nan')):8.1f}us {best['tile'] if best else None} "
              f"err {row.get('rel_err', 0):.2e} fw_err {row.get('framework_rel_err', 0):.2e} "
              f"bad={[v['tile'] for v in row['variants'] if 'error' not in v and not _bits_ok(v)]} "
              f"err={[v['error'][:80] for v in row['variants'] if 'error' in v]}", flush=True)
        rec.setdefault(name, []).append(row)
        if _ON_ROW is not None:  # partial results reach the disk row by row (a call may be cut short)
            _ON_ROW()


def slice_sections(small: bool, dev: str):
    """(name, run(tile, x), candidates, make(M) -> (x,), framework(x), exact(x), reference tile) of
    the fixed-slice GEMMs at V4-Flash widths (``small``: tiny widths for a CPU dry run)."""
    from v4stack.kernels import triton_gemm as tg
    from v4stack.ops import core

    d, E = (256, 32) if small else (4096, 256)
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*s, dt=torch.bfloat16, scale=1.0):
        return (torch.randn(*s, device=dev, generator=g) * scale).to(dt)

    wb = r(d, d, scale=d ** -0.5)
    wf = r(E, d, dt=torch.float32, scale=d ** -0.5)
    fn = r(24, 4 * d, dt=torch.float32, scale=(4 * d) ** -0.5)
    f64 = lambda a, b: a.double() @ b.double().T  # noqa: E731

    def hc_exact(x):
        xd = x.double()
        return (xd @ fn.double().T) / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6)

    return (("linear_bf16", lambda t, x: tg.linear(x, wb, t), BF16_TILES, lambda m: (r(m, d),),
             lambda x: F.linear(x, wb), None, TL.HALF_CANDIDATES[5], None),
            ("linear_fp32", lambda t, x: tg.linear(x, wf, t), F32_TILES, lambda m: (r(m, d, dt=torch.float32),),
             lambda x: F.linear(x, wf), lambda x: f64(x, wf), TL.F32_CANDIDATES[4], None),
            ("hc_mix", lambda t, x: tg.hc_mix(x, fn, 1e-6, t), HC_TILES, lambda m: (r(m, 4 * d, dt=torch.float32),),
             lambda x: core.hc_mix(x, fn, 1e-6), hc_exact, TL.HC_CANDIDATES[4], lambda x: (x.bfloat16(),)))


def _warm(job):
    """Compile one section's tiles (a worker process): each at M = 1, 8, 64 (the integer
    specialisations the timed calls hit), at the timed widths; the kernels land in Triton's cache."""
    name, idx, small = job
    torch.manual_seed(0)
    for sec in slice_sections(small, "cuda" if CUDA else "cpu"):
        if sec[0] != name:
            continue
        tile = sec[2][idx]
        x = sec[3](64)[0]
        for m in (1, 8, 64):
            try:
                sec[1](tile, x[:m])
                if sec[7] is not None:
                    sec[1](tile, *sec[7](x[:m]))
            except Exception as e:  # recorded; the sweep times what built
                return f"{name} {tile}: {e!r}"[:300]
    if CUDA:
        torch.cuda.synchronize()
    return True


def warm(names, workers: int, small: bool, sel: dict | None = None) -> float:
    """Compile every candidate of ``names`` in ``workers`` processes before the sweep (the sweep then
    loads them from Triton's cache instead of compiling ~30 kernels one after another)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.time()
    counts = {"linear_bf16": len(BF16_TILES), "linear_fp32": len(F32_TILES), "hc_mix": len(HC_TILES)}
    jobs = [(n, i, small) for n in names if n in counts for i in (sel or {}).get(n, range(counts[n]))]
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        done = list(ex.map(_warm, jobs))
    print("warm:", sum(d is True for d in done), "of", len(done), "compiled", [d for d in done if d is not True],
          flush=True)
    return time.time() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/gemm_tiles_h200.json")
    p.add_argument("--only", default="linear_bf16,linear_fp32,hc_mix,indexer_rows,host")
    p.add_argument("--choose", default="", help="write the pick of every tile bucket to this tiles_chosen.json")
    p.add_argument("--small", action="store_true", help="tiny widths (a CPU dry run under TRITON_INTERPRET)")
    p.add_argument("--warm", type=int, default=0, help="compile the fixed-slice candidates in this many processes first")
    p.add_argument("--target-s", type=float, default=0.02, help="seconds of calls per timed batch")
    p.add_argument("--warm-also", default="", help="sections compiled by --warm but not swept (the GPU tests use them)")
    p.add_argument("--ms", action="append", default=[], metavar="SECTION=M,M",
                   help="measure these M only for a fixed-slice section (the other buckets keep their tiles)")
    p.add_argument("--choose-from", default="", help="only re-derive --choose from this sweep result (no GPU)")
    p.add_argument("--tiles", action="append", default=[], metavar="SECTION=I,J",
                   help="sweep only these candidates (indices into the section's candidates; the buckets' "
                        "shipped tiles should be among them, as the pick compares against them)")
    a = p.parse_args(argv)
    if a.choose_from:
        import json

        chosen = choose(json.loads(open(a.choose_from).read()))
        write_choice(a.choose, os.path.basename(a.choose_from), chosen)
        print(chosen)
        return
    from v4stack.kernels import triton_gemm as tg

    dev = "cuda" if CUDA else "cpu"
    torch.manual_seed(0)
    d = 256 if a.small else 4096
    only = set(a.only.split(","))
    rec: dict = {"widths": "small" if a.small else "flash", "device_name": torch.cuda.get_device_name() if CUDA else "cpu"}
    t0 = time.time()

    def save():
        write_result(a.out, {**rec, "bench": "gemm_tiles", "elapsed_s": round(time.time() - t0, 1)})

    def r(*s, dt=torch.bfloat16, scale=1.0):
        return (torch.randn(*s, device=dev) * scale).to(dt)

    sections = []
    sel = {k: [int(i) for i in v.split(",")] for k, v in (e.split("=", 1) for e in a.tiles)}
    if a.warm:
        rec["warm_compile_s"] = round(warm(only | set(filter(None, a.warm_also.split(","))), a.warm, a.small, sel), 1)
        print("warm compile", rec["warm_compile_s"], "s", flush=True)
    if "indexer_rows" in only:
        def indexer_rows():
            from v4stack import ops
            from v4stack.ops import indexer_rows as ir

            E = 256 if a.small else 4096  # 16k context / ratio 4
            H, D = (16, 32) if a.small else (64, 128)
            out = []
            for T in ((1, 4) if a.small else (16, 256)):
                pool = r(max(T, 4) * E, D)
                rows = torch.randint(0, pool.shape[0], (T, E), device=dev)
                rows[:, E - 37:] = -1
                q, w = r(T, H, D), r(T, H)
                got = tg.indexer_scores(q, w, pool, rows)
                gathered = tg.indexer_scores(q, w, pool[rows.clamp(min=0)])
                vis = rows >= 0
                row = {"T": T, "E": E, "bits_equal_gathered": bool(torch.equal(got[vis], gathered[vis])),
                       "bits_equal_alone": all(torch.equal(tg.indexer_scores(q[i:i + 1], w[i:i + 1], pool, rows[i:i + 1]),
                                                           got[i:i + 1]) for i in range(min(T, 3)))}
                row["indexed_s"] = _time(lambda: tg.indexer_scores(q, w, pool, rows))
                row["gather_then_kernel_s"] = _time(lambda: tg.indexer_scores(q, w, pool[rows.clamp(min=0)]))
                row["fast_gather_einsum_s"] = _time(lambda: ir.fast(q, w, pool, rows))
                with ops.mode("invariant"):
                    row["ops_invariant_s"] = _time(lambda: ops.indexer_scores(q, w, pool, rows=rows))
                print("indexer_rows", row, flush=True)
                out.append(row)
            rec["indexer_rows"] = out
        sections.append(indexer_rows)
    ms = {k: tuple(int(m) for m in v.split(",")) for k, v in (e.split("=", 1) for e in a.ms)}
    order = a.only.split(",")
    for sec in sorted(slice_sections(a.small, dev), key=lambda sec: order.index(sec[0]) if sec[0] in order else 0):
        if sec[0] in only:
            cands = [sec[2][i] for i in sel[sec[0]]] if sec[0] in sel else sec[2]
            sections.append((lambda sec, cands: lambda: _variants(sec[0], sec[1], cands, ms.get(sec[0], SLICE_MS),
                                                                   sec[3], sec[4], rec, sec[6], sec[5], a.target_s,
                                                                   sec[7]))(sec, cands))
    if "host" in only:
        def host():
            from v4stack import ops
            from v4stack.kernels import triton_rows as tr
            from v4stack.kernels.launch import launch
            from v4stack.ops import dispatch

            out = {}
            for M in (1,):
                x = r(M, d, dt=torch.float32)
                y = torch.empty_like(x)
                ys, idx = r(M, 6, d, dt=torch.float32), torch.randint(0, 256, (M, 6), device=dev)
                res = {}
                with ops.mode("invariant"):
                    res["ops_softmax_invariant"] = _host_p50(lambda: ops.softmax(x, -1))
                    res["ops_moe_combine_invariant"] = _host_p50(lambda: ops.moe_combine(ys, idx))
                    res["graph_softmax_invariant"] = _graph_time(lambda: ops.softmax(x, -1))
                    res["graph_moe_combine_invariant"] = _graph_time(lambda: ops.moe_combine(ys, idx))
                res["ops_softmax_fast"] = _host_p50(lambda: ops.softmax(x, -1))
                res["ops_moe_combine_fast"] = _host_p50(lambda: ops.moe_combine(ys, idx))
                res["graph_softmax_fast"] = _graph_time(lambda: ops.softmax(x, -1))
                res["graph_moe_combine_fast"] = _graph_time(lambda: ops.moe_combine(ys, idx))
                res["wrapper_softmax"] = _host_p50(lambda: tr.softmax(x))
                res["wrapper_moe_combine"] = _host_p50(lambda: tr.moe_combine(ys, idx))
                blk = triton_next(d)
                res["launch_only_softmax"] = _host_p50(lambda: launch(tr.softmax_kernel, (M,), x, y, d, d, d, LOG=False,
                                                                    BLOCK=blk, num_warps=8 if blk >= 2048 else 4))
                res["resolve_softmax"] = _host_p50(lambda: dispatch.resolve("softmax", "invariant", "float32", "cuda", x, -1))
                res["torch_softmax"] = _host_p50(lambda: torch.softmax(x, -1))
                res["torch_empty_like"] = _host_p50(lambda: torch.empty_like(x))
                out[M] = res
                print("host", M, {k2: round(v2 * 1e6, 2) for k2, v2 in res.items()}, flush=True)
            rec["host_us"] = out
        sections.append(host)
    def checkpoint():
        if a.choose:
            rec["chosen"] = choose(rec)
            write_choice(a.choose, os.path.basename(a.out), rec["chosen"])
        save()

    global _ON_ROW
    _ON_ROW = checkpoint
    for sec in sections:
        try:
            sec()
        except Exception:
            rec.setdefault("errors", []).append(traceback.format_exc()[-1500:])
            traceback.print_exc()
        checkpoint()
        if CUDA:
            torch.cuda.empty_cache()
        print("section done", round(time.time() - t0, 1), flush=True)


def triton_next(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
