"""Tile and schedule sweep of the invariant GPU kernels (one H200 call), writing stamped JSON.

Each variant of a kernel (tile shape, warps, stages, TMA persistent schedule, fused K slices,
in-kernel tile table) is first checked bit for bit: the first rows it computes in a batch of M
must equal those rows computed alone by the kernel as shipped (so a variant that changes an
element's K chain is rejected, never timed into use). Then it is timed (CUDA events, back to back)
next to the framework's implementation. Also: the host cost of one small op call split into its
parts (dispatch, wrapper, launch) and its device time under CUDA graph replay.

    python -m bench.gemm_tiles --out bench/results/gemm_tiles_h200.json [--only linear_bf16,...]
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
HC_TILES, GROUPED_TILES = list(TL.HC_CANDIDATES), list(TL.GROUPED_CANDIDATES)
CUDA = torch.cuda.is_available()
# (table, sweep section, M measured -> largest M of the bucket it picks for); the last bucket takes every M
BUCKETS = {"HALF_TILES": ("linear_bf16", ((64, 64), (256, 256), (4096, 1 << 62))),
           "F32_TILES": ("linear_fp32", ((1, 16), (64, 128), (4096, 1 << 62))),
           "HC_TILES": ("hc_mix", ((64, 256), (4096, 1 << 62))),
           "GROUPED_TILES": ("grouped", ((1, 1024), (4096, 1 << 62)))}


def choose(rec: dict, margin: float = 0.03) -> dict:
    """Per bucket: the fastest bit-identical candidate at the bucket's measured M, if it beats the
    shipped default by more than ``margin``; else the default."""
    tables = {}
    for table, (section, buckets) in BUCKETS.items():
        rows = {r["M"]: r for r in rec.get(section, [])}
        if not all(m in rows for m, _ in buckets):
            continue
        out = []
        for m, top in buckets:
            default = TL.pick(getattr(TL, table), m)
            ok = [v for v in rows[m]["variants"] if v.get("bits_equal_alone") and "s" in v]
            base = next((v["s"] for v in ok if v["tile"] == default), None)
            best = min(ok, key=lambda v: v["s"]) if ok else None
            keep = best is None or base is None or best["s"] > base * (1 - margin)
            out.append([top, default if keep else best["tile"]])
        tables[table] = out
    return tables


def _time(fn, target_s=0.02) -> float:
    if not CUDA:  # a dry run of the script's logic
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return back_to_back(fn, target_s)


def _graph_time(fn) -> float:
    """Device time per call: ``fn`` captured 20 times in one CUDA graph, replayed."""
    return graph_time(fn, 20, 0.02) if CUDA else _time(fn)


def _host_p50(fn, batches=50, per=50) -> float:
    return host_per_call(fn, batches, per) if CUDA else _time(fn)


def _variants(name, run, tiles, ms, make, framework, rec):
    """For every tile: bits of rows 0..3 in a batch of M vs those rows alone (shipped kernel), time."""
    xs = make(max(ms))
    alone = [run(None, *(t[i:i + 1] for t in xs)) for i in range(4)]
    for M in ms:
        args = tuple(t[:M] for t in xs)
        row = {"M": M, "framework_s": _time(lambda: framework(*args)), "variants": []}
        for tile in tiles:
            v = {"tile": tile}
            try:
                y = run(tile, *args)
                v["bits_equal_alone"] = all(torch.equal(y[i:i + 1], alone[i]) for i in range(min(4, M)))
                v["s"] = _time(lambda: run(tile, *args))
                v["vs_framework"] = v["s"] / row["framework_s"]
            except Exception as e:  # a variant that does not build is recorded, the rest still run
                v["error"] = repr(e)[:300]
            row["variants"].append(v)
        ok = [v for v in row["variants"] if v.get("bits_equal_alone")]
        best = min(ok, key=lambda v: v["s"]) if ok else None
        row["best"] = best
        print(f"{name:<14}{M:>6} fw {row['framework_s'] * 1e6:8.1f}us best "
              f"{(best['s'] * 1e6 if best else float('nan')):8.1f}us {best['tile'] if best else None} "
              f"bad={[v['tile'] for v in row['variants'] if v.get('bits_equal_alone') is False]} "
              f"err={sum('error' in v for v in row['variants'])}", flush=True)
        rec.setdefault(name, []).append(row)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/gemm_tiles_h200.json")
    p.add_argument("--only", default="linear_bf16,grouped,linear_fp32,hc_mix,indexer_rows,host")
    p.add_argument("--choose", default="", help="write the pick of every tile bucket to this tiles_chosen.json")
    p.add_argument("--small", action="store_true", help="tiny widths (a CPU dry run under TRITON_INTERPRET)")
    a = p.parse_args(argv)
    from v4stack.kernels import triton_gemm as tg
    from v4stack.kernels import triton_grouped as tgr

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
    if "linear_bf16" in only:
        sections.append(lambda: _variants("linear_bf16", lambda t, x: tg.linear(x, wb, t), BF16_TILES,
                                          (64, 256, 4096) if not a.small else (64, 256, 4096), lambda m: (r(m, d),),
                                          lambda x: F.linear(x, wb), rec))
        wb = r(d, d, scale=d ** -0.5)
    if "linear_fp32" in only:
        wf = r(256 if not a.small else 32, d, dt=torch.float32, scale=d ** -0.5)
        sections.append(lambda: _variants("linear_fp32", lambda t, x: tg.linear(x, wf, t), F32_TILES,
                                          (1, 64, 4096), lambda m: (r(m, d, dt=torch.float32),),
                                          lambda x: F.linear(x, wf), rec))
    if "hc_mix" in only:
        fn = r(24, 4 * d, dt=torch.float32, scale=(4 * d) ** -0.5)
        from v4stack.ops import core

        sections.append(lambda: _variants("hc_mix", lambda t, x: tg.hc_mix(x, fn, 1e-6, t), HC_TILES,
                                          (64, 4096), lambda m: (r(m, 4 * d, dt=torch.float32),), lambda x: core.hc_mix(x, fn, 1e-6),
                                          rec))
    if "grouped" in only:
        E, inter, k = (8, 64, 2) if a.small else (256, 2048, 6)
        wg = r(E, inter, d, scale=d ** -0.5)

        def routed(m):
            ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(min(m, 64))]).repeat(-(-m // 64), 1)[:m]
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            off = torch.zeros(E + 1, dtype=torch.long, device=dev)
            off[1:] = torch.cumsum(torch.bincount(flat, minlength=E), 0)
            return r(flat.shape[0], d), off, flat[order]

        def grouped_section():
            from v4stack.ops import grouped

            out = []
            for m in ((1, 8) if a.small else (1, 4096)):
                x, off, eid = routed(m)
                # rows 0..3 alone under their expert: the default tile's bits
                alone = []
                for i in range(min(4, x.shape[0])):
                    o1 = torch.zeros_like(off)
                    o1[int(eid[i]) + 1:] = 1
                    alone.append(tgr.grouped_linear(x[i:i + 1], wg, o1))
                row = {"M": m, "rows": x.shape[0], "framework_s": _time(lambda: grouped.fast(x, wg, off))}
                if hasattr(torch, "_grouped_mm") and not a.small:
                    row["grouped_mm_s"] = _time(lambda: torch._grouped_mm(x, wg.transpose(1, 2), offs=off[1:].to(torch.int32)))
                row["variants"] = []
                for tile in GROUPED_TILES:
                    v = {"tile": tile}
                    try:
                        y = tgr.grouped_linear(x, wg, off, tile)
                        v["bits_equal_alone"] = all(torch.equal(y[i:i + 1], alone[i]) for i in range(len(alone)))
                        v["s"] = _time(lambda: tgr.grouped_linear(x, wg, off, tile))
                    except Exception as e:
                        v["error"] = repr(e)[:300]
                    row["variants"].append(v)
                print("grouped", m, {k2: v2 for k2, v2 in row.items() if k2 != "variants"},
                      [(v["tile"]["BN"], v.get("bits_equal_alone"), round(v.get("s", 0) * 1e6, 1))
                       for v in row["variants"]], flush=True)
                out.append(row)
            rec["grouped"] = out
        sections.append(grouped_section)
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
    for sec in sections:
        try:
            sec()
        except Exception:
            rec.setdefault("errors", []).append(traceback.format_exc()[-1500:])
            traceback.print_exc()
        if a.choose:
            rec["chosen"] = choose(rec)
            import json

            from v4stack.atomic import atomic_write

            atomic_write(a.choose, (json.dumps({"source": os.path.basename(a.out), "tables": rec["chosen"]}, indent=1)
                                    + "\n").encode())
        save()
        if CUDA:
            torch.cuda.empty_cache()
        print("section done", round(time.time() - t0, 1), flush=True)


def triton_next(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
