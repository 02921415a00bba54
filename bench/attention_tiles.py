"""Launch-shape sweep of the sparse attention kernel (one GPU call), writing stamped JSON.

Every candidate of ``v4stack.kernels.attention_tiles`` runs the dense attention with a sink at
V4-Flash widths (64 heads of 512, 640 candidates a row: a 128 window and 512 selected, the last
37 hidden). Bits first: for M in {1, 8, 64, 256, 4096} the M rows a candidate computes in one call
must equal, bit for bit, the reference shape's rows computed in a batch of 4096, and a few rows
alone must equal them too (so a shape that changed a row's arithmetic is never timed into use).
Then device time (calls captured in a CUDA graph, replayed) and back-to-back time per candidate
and M, beside the framework's (``ops.core``) on the same keys. ``--choose`` writes each bucket's
fastest bit-identical shape to ``attention_tiles.json``; the ops section then times
``ops.attention_with_sink`` in both modes with that table, the keys gathered per call as in
``bench/ops_gpu_check.py``, and checks rows alone = in a batch through the dispatch table.

    python -m bench.attention_tiles --out bench/results/attention_tiles_h200.json \
        --choose src/v4stack/kernels/attention_tiles.json [--warm 12] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import torch

from bench.runner import write_result
from bench.timing import back_to_back, graph_time
from v4stack.atomic import atomic_write
from v4stack.kernels import attention_tiles as AT

CUDA = torch.cuda.is_available()
MS = (1, 8, 64, 256, 4096)
TOPS = (1, 8, 64, 256, 1 << 62)  # largest rows of the bucket each measured M picks for
FLASH = dict(H=64, D=512, window=128, topk=512)
SMALL = dict(H=64, D=256, window=16, topk=48, ms=(1, 2, 3, 4, 6))


def data(w: dict, M: int, dev: str, seed: int = 0):
    """q, keys (each row's candidates gathered from two pools), mask, sink, scale."""
    g = torch.Generator(device=dev).manual_seed(seed)
    H, D = w["H"], w["D"]
    np0, np1 = 32 * w["window"] * 4, 64 * w["topk"]
    p0 = torch.randn(np0, D, generator=g, device=dev).bfloat16()
    p1 = torch.randn(np1, D, generator=g, device=dev).bfloat16()
    i0 = torch.randint(0, np0, (M, w["window"]), generator=g, device=dev)
    i1 = torch.randint(0, np1, (M, w["topk"]), generator=g, device=dev)
    i1[:, -37:] = -1
    keys = torch.cat([p0[i0], p1[i1.clamp(min=0)]], 1)
    mask = torch.cat([i0 >= 0, i1 >= 0], 1)
    q = torch.randn(M, H, D, generator=g, device=dev).bfloat16()
    return q, keys, mask, torch.randn(H, generator=g, device=dev), D ** -0.5


def run(tile, q, keys, mask, sink, scale):
    from v4stack.kernels import triton_attention as ta

    return ta.attention_with_sink(q, keys, mask, sink, scale, tiles=None if tile is None else ((1 << 62, tile),))


def _bits(t):
    return t.contiguous().view(torch.int16)


def _time(fn, M: int) -> dict:
    if not CUDA:  # a dry run of the logic under the interpreter
        t0 = time.perf_counter()
        fn()
        s = time.perf_counter() - t0
        return {"graph_s": s, "b2b_s": s}
    reps = 20 if M <= 256 else 4
    return {"graph_s": graph_time(fn, reps, 0.02), "b2b_s": back_to_back(fn, 0.02)}


def warm(n: int, small: bool) -> dict:
    """Compile every candidate in ``n`` parallel processes (Triton's disk cache then serves this
    one): each calls its candidates on 2 rows at the same widths (the same specialisation)."""
    t0 = time.time()
    procs = []
    idx = list(range(len(AT.CANDIDATES)))
    for k in range(n):
        mine = idx[k::n]
        if mine:
            cmd = [sys.executable, "-m", "bench.attention_tiles", "--warm-only", ",".join(map(str, mine))]
            procs.append(subprocess.Popen(cmd + (["--small"] if small else []), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate()[0][-400:] for p in procs]
    return {"s": round(time.time() - t0, 1), "failed": [o for p, o in zip(procs, outs) if p.returncode]}


def sweep(w: dict, dev: str, rec: dict, save, between=lambda: None) -> None:
    """Bits of every candidate, then (after ``between()``) its times."""
    from v4stack.ops import core

    ms = w.get("ms", MS)
    q, keys, mask, sink, scale = data(w, max(ms), dev)
    probe = (0, 1, max(ms) // 2 + 1, max(ms) - 1)
    rows, full, reps = [], {}, []  # reps: one candidate per class of bit-identical ones
    for i, tile in enumerate(AT.CANDIDATES):
        v = {"i": i, "tile": tile, "batch_equal_prefix": {}, "time": {}}
        try:
            y = full[i] = run(tile, q, keys, mask, sink, scale)
            for M in ms[:-1]:  # its rows in a smaller batch = its rows in the largest
                v["batch_equal_prefix"][M] = bool(torch.equal(_bits(run(tile, q[:M], keys[:M], mask[:M], sink, scale)),
                                                              _bits(y[:M])))
            v["alone_equal_batch"] = all(
                torch.equal(_bits(run(tile, q[r:r + 1], keys[r:r + 1], mask[r:r + 1], sink, scale)), _bits(y[r:r + 1]))
                for r in probe)
            v["class"] = next((j for j in reps if torch.equal(_bits(y), _bits(full[j]))), i)
            if v["class"] == i:
                reps.append(i)
            v["bits_equal_reference"] = v["class"] == rows[0].get("class", 0) if rows else True
        except Exception as e:  # a shape that does not build or launch is recorded, the rest still run
            v["error"] = repr(e)[:400]
        rows.append(v)
        print("bits", i, tile, v.get("batch_equal_prefix"), v.get("alone_equal_batch"), "class", v.get("class"),
              v.get("error", ""), flush=True)
    ref = full.get(0, next(iter(full.values()), None))
    full.clear()
    rec["candidates"] = rows
    with torch.no_grad():
        want = core.attention_with_sink(q[:64].double(), keys[:64].double(), mask[:64], sink.double(), scale)
    rec["reference_rel_err_vs_float64"] = float((ref[:64].double() - want).norm() / want.norm())
    save()
    between()
    framework = {}
    for M in sorted(ms, reverse=True):  # the targets first: a call cut short keeps them
        a = (q[:M], keys[:M], mask[:M], sink, scale)
        framework[M] = _time(lambda: core.attention_with_sink(*a), M)
        for v in rows:
            if "error" in v:
                continue
            if v["tile"]["path"] == "split" and M > ms[2]:
                continue
            try:
                v["time"][M] = _time(lambda: run(v["tile"], *a), M)
            except Exception as e:
                v["time"][M] = {"error": repr(e)[:300]}
        rec["framework"] = framework
        best = min((v for v in rows if "graph_s" in v["time"].get(M, {})), key=lambda v: v["time"][M]["graph_s"])
        print(f"M={M:5d} framework {framework[M]['graph_s'] * 1e6:9.1f}us  best {best['i']} "
              f"{best['time'][M]['graph_s'] * 1e6:9.1f}us  " + " ".join(
                  f"{v['i']}:{v['time'][M]['graph_s'] * 1e6:.0f}" for v in rows if "graph_s" in v["time"].get(M, {})),
              flush=True)
        save()


def choose(rec: dict, ms=MS) -> list:
    """One class of candidates whose outputs are bit-identical to each other (and each one's rows
    the same alone, in a smaller batch and in the largest), so every bucket gives a row the same
    bits; the class fastest over the measured M (the sum of each M's best time over the best of
    all); per bucket its fastest member (device time at the bucket's M)."""
    ok = [v for v in rec["candidates"] if "error" not in v and v.get("alone_equal_batch")
          and all(v["batch_equal_prefix"].values())]
    best_at = {M: min((v["time"][M]["graph_s"] for v in ok if "graph_s" in v["time"].get(M, {})), default=None)
               for M in ms}

    def fastest(members, M):
        timed = [v for v in members if "graph_s" in v["time"].get(M, {})]
        return min(timed, key=lambda v: v["time"][M]["graph_s"]) if timed else None

    def score(members):
        return sum((fastest(members, M)["time"][M]["graph_s"] / best_at[M]) if fastest(members, M) else 1e9
                   for M in ms if best_at[M])

    classes = {}
    for v in ok:
        classes.setdefault(v["class"], []).append(v)
    if not classes:
        return [[1 << 62, dict(AT.CANDIDATES[0], path=None)]]
    members = min(classes.values(), key=score)
    rec["chosen_class"] = members[0]["class"]
    any_m = fastest(members, max(ms)) or members[0]
    return [[top, (fastest(members, M) or any_m)["tile"]] for M, top in zip(ms, TOPS)]


def ops_section(rec: dict, small: bool, save) -> None:
    """``ops.attention_with_sink`` through the dispatch table with the chosen buckets: both
    modes' times (keys gathered per call, as in the ops check) and rows alone = in a batch."""
    from bench.ops_gpu_cases import SMALL as CASE_SMALL
    from bench.ops_gpu_cases import build
    from v4stack import ops

    w = CASE_SMALL if small else None
    out = {"time": {}, "invariance": {}}
    ms = MS if not small else (1, 2, 3, 8, 9)
    case = build("attention_with_sink", max(ms), **({"w": w, "dev": "cpu"} if small else {}))
    with ops.mode("invariant"), torch.no_grad():
        alone = {i: case.call(*(t[i:i + 1] for t in case.rows)) for i in range(3)}
        for M in ((1, 2, 3, 8, 9) if small else (1, 2, 3, 8, 63, 64, 65, 255, 256, 257, 1024, 4095, 4096)):
            y = case.call(*(t[:M] for t in case.rows))
            last = case.call(*(t[M - 1:M] for t in case.rows))
            out["invariance"][M] = bool(all(torch.equal(_bits(y[i:i + 1]), _bits(alone[i])) for i in range(min(M, 3)))
                                        and torch.equal(_bits(y[M - 1:M]), _bits(last)))
    print("ops invariance", out["invariance"], flush=True)
    for M in sorted(ms, reverse=True):
        args = tuple(t[:M] for t in case.rows)
        row = {}
        for mode in ("fast", "invariant"):
            with ops.mode(mode), torch.no_grad():
                row[mode] = _time(lambda: case.call(*args), M)
        row["ratio_graph"] = row["invariant"]["graph_s"] / row["fast"]["graph_s"]
        row["ratio_b2b"] = row["invariant"]["b2b_s"] / row["fast"]["b2b_s"]
        out["time"][M] = row
        print(f"ops M={M:5d} fast {row['fast']['graph_s'] * 1e6:9.1f}us inv {row['invariant']['graph_s'] * 1e6:9.1f}us "
              f"ratio graph {row['ratio_graph']:.2f} b2b {row['ratio_b2b']:.2f}", flush=True)
        rec["ops"] = out
        save()
    rec["ops"] = out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/attention_tiles_h200.json")
    p.add_argument("--choose", default="", help="write each bucket's pick to this attention_tiles.json")
    p.add_argument("--warm", type=int, default=0, help="compile the candidates in this many processes first")
    p.add_argument("--warm-only", default="", help=argparse.SUPPRESS)
    p.add_argument("--skip-ops", action="store_true")
    p.add_argument("--pytest", default="", help="run these tests (-m gpu) beside the bit checks, before the timing")
    p.add_argument("--small", action="store_true", help="tiny widths (a CPU dry run under TRITON_INTERPRET)")
    a = p.parse_args(argv)
    w, dev = (SMALL if a.small else FLASH), ("cuda" if CUDA else "cpu")
    if a.warm_only:
        q, keys, mask, sink, scale = data(w, 2, dev)
        for i in map(int, a.warm_only.split(",")):
            run(AT.CANDIDATES[i], q, keys, mask, sink, scale)
        return
    t0 = time.time()
    rec: dict = {"bench": "attention_tiles", "widths": "small" if a.small else "flash", "device_name":
                 torch.cuda.get_device_name() if CUDA else "cpu", "candidates_source": "v4stack.kernels.attention_tiles"}

    def save():
        write_result(a.out, {**rec, "elapsed_s": round(time.time() - t0, 1)})

    if a.warm:
        rec["warm"] = warm(a.warm, a.small)
        print("warm", rec["warm"], flush=True)
    tests = None
    if a.pytest:
        tests = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                  *a.pytest.split(",")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_tests():
        if tests is not None:
            try:
                out = tests.communicate(timeout=60)[0]
            except subprocess.TimeoutExpired:
                tests.kill()
                out = tests.communicate()[0] + "\n(killed after 60 s)"
            rec["pytest"] = {"tests": a.pytest, "rc": tests.returncode, "tail": out[-1500:]}
            print("pytest rc", tests.returncode, out[-600:], flush=True)
            save()

    try:
        sweep(w, dev, rec, save, wait_tests)
        table = choose(rec, w.get("ms", MS))
        rec["chosen"] = table
        print("chosen", json.dumps(table), flush=True)
        if a.choose:
            atomic_write(a.choose, (json.dumps({"source": os.path.basename(a.out), "tiles": table}, indent=1)
                                    + "\n").encode())
        AT.TILES = tuple((top, t) for top, t in table)  # the dispatch's wrapper reads it per call
        save()
        if not a.skip_ops:
            ops_section(rec, a.small, save)
    except Exception:
        rec["error"] = traceback.format_exc()[-2000:]
        print(rec["error"], flush=True)
    if tests is not None and "pytest" not in rec:
        wait_tests()
    save()


if __name__ == "__main__":
    main()
