"""Tile sweep of the grouped expert GEMM (one H200 call), writing stamped JSON.

At the expert widths of the flash4 config (hidden 4096, moe_intermediate 2048: the gate / up
projection ``N 2048, K 4096`` and the down projection ``N 4096, K 2048``), with 8 and 64 experts and
top-6 routing, at 1, 8, 64, 256 and 4096 tokens (6, 48, 384, 1536 and 24576 routed rows): every
candidate of ``tiles.GROUPED_CANDIDATES`` (the table kernel's and the persistent TMA kernel's) is
first checked bit for bit - its whole output against the reference tile's (``bits_equal_ref``), and
probe rows (the first four, the last, the first of every fourth expert) against those rows computed
alone, one row under its expert (``bits_equal_alone``) - then timed back to back (``s``) and under
CUDA graphs (``graph_s``), next to ``torch._grouped_mm``, with the relative error against float64
of the reference tile and of the framework. A variant's ``s`` / ``graph_s`` are the sums over the
four (experts, projection) cases of a row count (``cases`` holds each); its bit flags hold for all
four. GROUPED_TILES picks a tile by routed rows per expert, ``ceil(T / E)`` (what fills a row tile:
the same rows over 8 or 64 experts want different tiles), so ``--choose`` regroups the cases by that
(``per_expert``) and writes the pick per bucket into ``tiles_chosen.json`` (``gemm_tiles.choose``:
the cheapest bit-identical candidate, by graph plus back-to-back time, summed over the bucket's
cases); only GROUPED_TILES changes. ``--choose-from`` re-derives it from a committed result.
With ``--serving`` the cases are the serving engine's decode calls (the last expert the joined
shared expert, every token routed to it; gate and up also as one N = 4096 call); ``--choose-from``
such a result sets GROUPED_TILES_GRAPH, the table of graph-captured calls, by device time alone.

    python -m bench.grouped_tiles --warm 12 --out bench/results/grouped_tiles_h200.json \
        --choose src/v4stack/kernels/tiles_chosen.json
    python -m bench.grouped_tiles --choose src/v4stack/kernels/tiles_chosen.json \
        --choose-from bench/results/grouped_tiles_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback

import torch

from bench import gemm_tiles as GT
from bench.runner import write_result
from v4stack.kernels import tiles as TL

CUDA = torch.cuda.is_available()
SHAPES = (("gate_up", 2048, 4096), ("down", 4096, 2048))  # (projection, N, K) at flash4 widths
SMALL_SHAPES = (("gate_up", 64, 96), ("down", 96, 64))
EXPERTS = (8, 64)
TOP_K = 6
TOKENS = (256, 64, 1, 8, 4096)  # the serving target first (a call cut short keeps it)
REF = TL.GROUPED_CANDIDATES[2]  # the table kernel's 64 x 64 x 64: the tile the others must equal


SERVING_SHAPES = (("gate_up", 2048, 4096), ("gate_up13", 4096, 4096), ("down", 4096, 2048))  # + w1|w3 as one


def routed(tokens: int, E: int, K: int, dev: str, gen: torch.Generator, shared: bool = False):
    """``tokens * TOP_K`` rows sorted by expert (each token's top-k of random scores), ``[E + 1]``
    int64 offsets on the device, each row's expert. ``shared``: expert ``E - 1`` is the serving
    path's joined shared expert (every token routes to it, besides its top-k of the others)."""
    n = E - 1 if shared else E
    ids = torch.rand(tokens, n, generator=gen).topk(min(TOP_K, n), dim=1).indices
    if shared:
        ids = torch.cat([ids, torch.full((tokens, 1), n, dtype=ids.dtype)], 1)
    ids = ids.reshape(-1)
    eid = ids.sort(stable=True).values
    off = torch.zeros(E + 1, dtype=torch.long)
    off[1:] = torch.bincount(eid, minlength=E).cumsum(0)
    x = torch.randn(eid.shape[0], K, device=dev).to(torch.bfloat16)
    return x, off.to(dev), eid


def one_case(run, x, w, off, eid, tiles, target_s: float) -> dict:
    """Bits and times of every tile on one (rows, experts, projection) case."""
    E = w.shape[0]
    rows = x.shape[0]
    ref = run(REF, x, w, off)
    firsts = [int(off[e]) for e in range(0, E, 4) if int(off[e + 1]) > int(off[e])]
    probe = sorted({i for i in (0, 1, 2, 3, rows - 1, *firsts) if 0 <= i < rows})
    alone = {}
    for i in probe:
        o1 = torch.zeros_like(off)
        o1[int(eid[i]) + 1:] = 1
        alone[i] = run(REF, x[i:i + 1], w, o1)
    case = {"experts": E, "N": w.shape[1], "K": w.shape[2], "rows": rows,
            "rows_per_expert_max": int((off[1:] - off[:-1]).max()), "probe_rows": probe}
    if CUDA:
        fw = lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=off[1:].to(torch.int32), out_dtype=x.dtype)  # noqa: E731
        case["framework_s"] = GT._time(fw, target_s)
        case["framework_graph_s"] = GT.graph_time(fw, 10, target_s)
        want = torch.empty(rows, w.shape[1], dtype=torch.float64, device=x.device)
        for e in range(E):
            a, b = int(off[e]), int(off[e + 1])
            if b > a:
                want[a:b] = x[a:b].double() @ w[e].double().T
        case["rel_err"] = GT._rel_err(ref, want)
        case["framework_rel_err"] = GT._rel_err(fw(), want)
        del want
    out = []
    for tile in tiles:
        v = {}
        try:
            y = run(tile, x, w, off)
            v["bits_equal_ref"] = bool(torch.equal(y, ref))
            v["bits_equal_alone"] = all(torch.equal(y[i:i + 1], alone[i]) for i in probe)
            v["s"] = GT._time(lambda: run(tile, x, w, off), target_s)
            v["graph_s"] = GT.graph_time(lambda: run(tile, x, w, off), 10, target_s) if CUDA else v["s"]
        except Exception as e:  # a variant that does not build or run is recorded, the rest still run
            v["error"] = repr(e)[:300]
        out.append(v)
    return case, out


def _warm(job):
    """Compile one candidate (a worker process) at both experts' specialisations, small widths."""
    idx, small = job
    from v4stack.kernels import triton_grouped as tgr

    dev = "cuda" if CUDA else "cpu"
    gen = torch.Generator().manual_seed(idx)
    tile = TL.GROUPED_CANDIDATES[idx]
    try:
        for E in EXPERTS:
            for _, N, K in (SMALL_SHAPES if small else ((0, 256, 256),)):
                x, off, _ = routed(16, E, K, dev, gen)
                w = torch.randn(E, N, K, device=dev).to(torch.bfloat16)
                tgr.grouped_linear(x, w, off, tile)
        if CUDA:
            torch.cuda.synchronize()
    except Exception as e:  # recorded; the sweep times what built
        return f"{tile}: {e!r}"[:300]
    return True


def warm(workers: int, small: bool) -> list:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(_warm, [(i, small) for i in range(len(TL.GROUPED_CANDIDATES))]))


def sweep(rec: dict, tokens, small: bool, target_s: float, on_row, experts=EXPERTS, shapes=None,
          shared: bool = False) -> None:
    from v4stack.kernels import triton_grouped as tgr

    dev = "cuda" if CUDA else "cpu"
    gen = torch.Generator().manual_seed(0)  # the routing (on the host)
    torch.manual_seed(0)  # rows and weights (on the device)
    tiles = list(TL.GROUPED_CANDIDATES)
    shapes = SMALL_SHAPES if small else (shapes or SHAPES)
    weights = {}
    for E in experts:
        for name, N, K in shapes:
            weights[E, name] = (torch.randn(E, N, K, device=dev) * K ** -0.5).to(torch.bfloat16)
    run = lambda t, x, w, off: tgr.grouped_linear(x, w, off, t)  # noqa: E731
    for tok in tokens:
        row = {"tokens": tok, "cases": [], "variants": [{"tile": t} for t in tiles]}
        for E in experts:
            for name, N, K in shapes:
                x, off, eid = routed(tok, E, K, dev, gen, shared)
                row["M"] = x.shape[0]
                case, vs = one_case(run, x, weights[E, name], off, eid, tiles, target_s)
                case["projection"] = name
                row["cases"].append(case)
                for acc, v in zip(row["variants"], vs):
                    acc.setdefault("cases", []).append(v)
        for v in row["variants"]:
            cs = v["cases"]
            errs = [c["error"] for c in cs if "error" in c]
            if errs:
                v["error"] = errs[0]
                continue
            v["bits_equal_ref"] = all(c["bits_equal_ref"] for c in cs)
            v["bits_equal_alone"] = all(c["bits_equal_alone"] for c in cs)
            v["s"] = sum(c["s"] for c in cs)
            v["graph_s"] = sum(c["graph_s"] for c in cs)
        if CUDA:
            row["framework_s"] = sum(c["framework_s"] for c in row["cases"])
            row["framework_graph_s"] = sum(c["framework_graph_s"] for c in row["cases"])
        ok = [v for v in row["variants"] if GT._bits_ok(v)]
        row["best"] = min(ok, key=GT._cost) if ok else None
        b = row["best"]
        print(f"grouped rows {row['M']:>6} fw {row.get('framework_graph_s', 0) * 1e6:8.1f}us best "
              f"{(b['graph_s'] * 1e6 if b else float('nan')):8.1f}us {b['tile'] if b else None} "
              f"bad={[v['tile'] for v in row['variants'] if 'error' not in v and not GT._bits_ok(v)]} "
              f"err={[v['error'][:100] for v in row['variants'] if 'error' in v]}", flush=True)
        for v in sorted((v for v in row["variants"] if "graph_s" in v), key=lambda v: v["graph_s"]):
            print("   ", v["tile"], [round(c["graph_s"] * 1e6, 1) for c in v["cases"]], GT._bits_ok(v), flush=True)
        rec.setdefault("grouped", []).append(row)
        on_row()


def per_expert(rows: list) -> list:
    """The sweep's cases regrouped by routed rows per expert ``ceil(rows / experts)`` (GROUPED_TILES'
    key): one row per value, each variant's ``s`` / ``graph_s`` summed over those cases, its bit
    flags over all of them."""
    groups: dict = {}
    for row in rows:
        for i, case in enumerate(row["cases"]):
            r = -(-case["rows"] // case["experts"])
            g = groups.setdefault(r, {"M": r, "cases": [], "variants": {}})
            g["cases"].append({"tokens": row["tokens"], "experts": case["experts"], "projection": case["projection"]})
            for v in row["variants"]:
                key = json.dumps(v["tile"], sort_keys=True)
                acc = g["variants"].setdefault(key, {"tile": v["tile"], "bits_equal_ref": True,
                                                     "bits_equal_alone": True, "s": 0.0, "graph_s": 0.0})
                c = v["cases"][i]
                if "error" in c or "error" in acc:
                    acc["error"] = c.get("error") or acc.get("error")
                    continue
                acc["bits_equal_ref"] &= c["bits_equal_ref"]
                acc["bits_equal_alone"] &= c["bits_equal_alone"]
                acc["s"] += c["s"]
                acc["graph_s"] += c["graph_s"]
    out = []
    for r in sorted(groups):
        g = groups[r]
        g["variants"] = [{k: v for k, v in acc.items() if "error" not in acc or k in ("tile", "error")}
                         for acc in g["variants"].values()]
        out.append(g)
    return out


def write_choice(choose_path: str, rec: dict, source: str) -> dict:
    """GROUPED_TILES' pick from a sweep record, written into ``choose_path`` (other tables kept)."""
    from v4stack.atomic import atomic_write

    chosen = GT.choose({"grouped_per_expert": per_expert(rec.get("grouped", []))})
    chosen = {k: v for k, v in chosen.items() if k == "GROUPED_TILES"}  # the graph table: ``choose_graph``
    raw = json.loads(open(choose_path).read()) if os.path.exists(choose_path) else {}
    tables = {**raw.get("tables", {}), **chosen}
    sources = {**raw.get("sources", {}), **{k: source for k in chosen}}
    atomic_write(choose_path, (json.dumps({**raw, "sources": sources, "tables": tables}, indent=1) + "\n").encode())
    return chosen


CALLS_PER_LAYER = {"gate_up": 2, "down": 1, "gate_up13": 0}  # what a MoE layer's decode runs (w1, w3, w2)


def serving_costs(rec: dict) -> dict:
    """A ``--serving`` sweep's device time under graphs per routed rows-per-expert value, each case
    weighted by its calls per MoE layer (gate and up are two calls; the one-call form is measured,
    not run): ``{r: {"tiles": {tile json: s or None (bits differ / failed)}, "framework": s}}``."""
    cost: dict = {}
    for row in rec.get("grouped", []):
        for i, case in enumerate(row["cases"]):
            n = CALLS_PER_LAYER.get(case["projection"], 1)
            per = cost.setdefault(-(-case["rows"] // case["experts"]), {"tiles": {}, "framework": 0.0})
            per["framework"] += n * case.get("framework_graph_s", 0.0)
            for v in row["variants"]:
                c, key = v["cases"][i], json.dumps(v["tile"], sort_keys=True)
                ok = "error" not in c and GT._bits_ok(c) and per["tiles"].get(key, 0.0) is not None
                per["tiles"][key] = per["tiles"].get(key, 0.0) + n * c["graph_s"] if ok else None
    return cost


def best_tiles(rec: dict, cost: dict | None = None) -> dict:
    """``{r: (tile, s)}``: per rows-per-expert value of a serving sweep, the bit-identical tile with
    the least weighted device time (``serving_costs``, or ``cost`` when already computed)."""
    out = {}
    for r, per in sorted((cost or serving_costs(rec)).items()):
        ok = {k: t for k, t in per["tiles"].items() if t is not None}
        if not ok:
            raise ValueError(f"rows/expert {r}: no bit-identical tile")
        key = min(ok, key=ok.get)
        out[r] = (json.loads(key), ok[key])
    return out


def graph_rows(rec: dict) -> int:
    """The most rows of one call a serving sweep measured (GROUPED_TILES_GRAPH serves no larger call:
    a 24576-row capture over 256 experts, 96 rows each, is not a decode step)."""
    return max(c["rows"] for row in rec.get("grouped", []) for c in row["cases"])


def choose_graph(rec: dict) -> dict:
    """GROUPED_TILES_GRAPH (calls captured in CUDA graphs: the engine's decode steps) from a
    ``--serving`` sweep: per measured rows-per-expert value its ``best_tiles`` tile; bucket bounds
    halfway (geometric) between adjacent measured values, the last open-ended."""
    best = best_tiles(rec)
    vals = sorted(best)
    tops = [int(math.sqrt(a * b)) for a, b in zip(vals, vals[1:])] + [1 << 62]
    out: list = []
    for r, top in zip(vals, tops):
        tile = best[r][0]
        if out and out[-1][1] == tile:
            out[-1][0] = top
        else:
            out.append([top, tile])
    return {"GROUPED_TILES_GRAPH": out}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/grouped_tiles_h200.json")
    p.add_argument("--choose", default="", help="write the GROUPED_TILES pick into this tiles_chosen.json")
    p.add_argument("--small", action="store_true", help="tiny widths (a CPU dry run under TRITON_INTERPRET)")
    p.add_argument("--warm", type=int, default=0, help="compile the candidates in this many processes first")
    p.add_argument("--target-s", type=float, default=0.01, help="seconds of calls per timed batch")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--choose-from", default="", help="only re-derive --choose from this sweep result (no GPU)")
    p.add_argument("--experts", default=",".join(map(str, EXPERTS)), help="experts per case")
    p.add_argument("--serving", action="store_true",
                   help="the serving path's calls: the last expert is the joined shared expert (every token), and "
                        "the gate and up projections also as one N = 4096 call")
    a = p.parse_args(argv)
    if a.choose_from:
        rec = json.loads(open(a.choose_from).read())
        if rec.get("serving"):  # decode's calls: the graph table
            chosen = choose_graph(rec)  # the table holds up to the sweep's largest call
            rows = {"GROUPED_TILES_GRAPH": graph_rows(rec)}
            GT.write_choice(a.choose, os.path.basename(a.choose_from), chosen, rows)
            print(chosen, rows)
        else:
            print(write_choice(a.choose, rec, os.path.basename(a.choose_from)))
        return
    t0 = time.time()
    rec: dict = {"widths": "small" if a.small else "flash4", "top_k": TOP_K, "experts": list(EXPERTS),
                 "shapes": [list(s) for s in (SMALL_SHAPES if a.small else SHAPES)],
                 "device_name": torch.cuda.get_device_name() if CUDA else "cpu", "reference_tile": REF}
    if a.warm:
        done = warm(a.warm, a.small)
        rec["warm_compile_s"] = round(time.time() - t0, 1)
        rec["warm_failed"] = [d for d in done if d is not True]
        print("warm", rec["warm_compile_s"], "s; failed:", rec["warm_failed"], flush=True)

    def checkpoint():
        if a.choose:
            rec["chosen"] = write_choice(a.choose, rec, os.path.basename(a.out))
        write_result(a.out, {**rec, "bench": "grouped_tiles", "elapsed_s": round(time.time() - t0, 1)})

    try:
        experts = tuple(int(e) for e in a.experts.split(","))
        rec["experts"], rec["serving"] = list(experts), a.serving
        if a.serving and not a.small:
            rec["shapes"] = [list(s) for s in SERVING_SHAPES]
        sweep(rec, [int(t) for t in a.tokens.split(",")], a.small, a.target_s, checkpoint, experts,
              SERVING_SHAPES if a.serving else None, a.serving)
    except Exception:
        rec.setdefault("errors", []).append(traceback.format_exc()[-1500:])
        traceback.print_exc()
    checkpoint()
    print("done", round(time.time() - t0, 1), "s", flush=True)


if __name__ == "__main__":
    main()
