"""Fast mode's narrow projections of bf16 rows and the greedy draw, at V4-Flash widths (one H200 call).

- ``hc_pre``: the mHC coefficients from the streams ``[M, 4, 4096]`` (K = 16384, 24 outputs) -
  the shipped slice pair (``triton_mhc.hc_pre``, 3xTF32, both modes) against ``triton_wide.hc_pre``
  at each candidate tile (and its first launch alone, ``partials_graph_s``); the error of pre /
  post / comb against float64.
- ``read_norm``: the coefficients and the sublayer's normalised input - ``hc_pre`` then
  ``hc_read_norm`` (three launches) against ``hc_pre_read_norm`` (two).
- ``head``: the output head's normalised input - ``hc_head_pre``, ``hc_read`` and ``rms_norm``
  through fast mode's ops (five launches) against ``hc_head_read_norm`` (two).
- ``router``: the router's logits ``[M, 8]`` from ``[M, 4096]`` bf16 rows - fast mode's path before
  (the rows widened to fp32 by a copy, then ``ops.linear`` on the fp32 weight) against
  ``triton_wide.linear_widened`` on the bf16 weight; the error against float64; and the whole router
  (the logits, then the gate) against ``triton_wide.router`` (the gate adding the partials itself).
- ``greedy``: ``triton_sample.greedy_draw`` over ``[M, 129280]`` bf16 logits at each launch shape,
  ids against ``argmax`` and log-probabilities against float64.

Times are device seconds per call, 20 calls in one CUDA graph replayed back to back.

    python -m bench.wide_projections --out bench/results/wide_projections_h200.json
"""

from __future__ import annotations

import argparse
import traceback

import torch

from bench.runner import write_result
from bench.timing import graph_time

ROWS = (1, 16, 64, 256, 4096)
HC_TILES = [
    dict(BM=64, KC=512, BK=64, num_warps=4, num_stages=3),
    dict(BM=64, KC=256, BK=64, num_warps=4, num_stages=3),
    dict(BM=64, KC=1024, BK=64, num_warps=4, num_stages=4),
    dict(BM=128, KC=512, BK=64, num_warps=8, num_stages=3),
    dict(BM=32, KC=512, BK=64, num_warps=4, num_stages=3),
    dict(BM=16, KC=512, BK=64, num_warps=4, num_stages=3),
    dict(BM=64, KC=512, BK=128, num_warps=4, num_stages=3),
    dict(BM=64, KC=2048, BK=64, num_warps=4, num_stages=4),
    dict(BM=64, KC=256, BK=256, num_warps=4, num_stages=1),
    dict(BM=64, KC=128, BK=128, num_warps=4, num_stages=1),
    dict(BM=64, KC=256, BK=128, num_warps=4, num_stages=2),
    dict(BM=64, KC=256, BK=64, num_warps=4, num_stages=4),
    dict(BM=128, KC=256, BK=64, num_warps=8, num_stages=3),
    dict(BM=64, KC=256, BK=256, num_warps=8, num_stages=1),
]
GREEDY_TILES = [
    dict(CHUNK=4096, BLOCK=1024, num_warps=4),
    dict(CHUNK=4096, BLOCK=1024, num_warps=4, blocks=True),
    dict(CHUNK=4096, BLOCK=4096, num_warps=4, blocks=True),
    dict(CHUNK=4096, BLOCK=4096, num_warps=8, blocks=True),
    dict(CHUNK=8192, BLOCK=4096, num_warps=8, blocks=True),
    dict(CHUNK=8192, BLOCK=2048, num_warps=4, blocks=True),
    dict(CHUNK=16384, BLOCK=4096, num_warps=8, blocks=True),
    dict(CHUNK=2048, BLOCK=2048, num_warps=4, blocks=True),
    dict(CHUNK=8192, BLOCK=8192, num_warps=8, blocks=True),
    dict(CHUNK=4096, BLOCK=4096, num_warps=2, blocks=True),
    dict(CHUNK=2048, BLOCK=2048, num_warps=2, blocks=True),
    dict(CHUNK=8192, BLOCK=8192, num_warps=4, blocks=True),
]


def _err(got, want) -> float:
    return max(float((a.double() - b).abs().max()) for a, b in zip(got, want))


def hc_cases() -> list:
    from v4stack.kernels import triton_mhc as tm
    from v4stack.kernels import triton_wide as tw
    from v4stack.ops import fused

    out = []
    for M in ROWS:
        g = torch.Generator(device="cuda").manual_seed(M)
        x = torch.randn(M, 4, 4096, device="cuda", generator=g).bfloat16()
        fn = torch.randn(24, 16384, device="cuda", generator=g) * 0.01
        scale = torch.rand(3, device="cuda", generator=g) + 0.5
        base = torch.randn(24, device="cuda", generator=g)
        want = fused.hc_pre_reference(x.double(), fn.double(), scale.double(), base.double(), 4, 20, 1e-6, 1e-6)
        case = {"rows": M, "shipped": {}, "tiles": []}
        args = (x, fn, scale, base, 4, 20, 1e-6, 1e-6)
        case["shipped"]["max_abs_err"] = _err(tm.hc_pre(*args), want)
        case["shipped"]["graph_s"] = graph_time(lambda: tm.hc_pre(*args))
        for t in HC_TILES:
            rec = {"tile": t, "shipped": t == tw.TILE}
            try:
                got = tw.hc_pre(*args, tile=t)
                rec["max_abs_err"] = _err(got, want)
                alone = tw.hc_pre(x[M // 2: M // 2 + 1].clone(), *args[1:], tile=t)
                rec["row_alone_bits_equal"] = all(bool(torch.equal(a[0], b[M // 2])) for a, b in zip(alone, got))
                rec["graph_s"] = graph_time(lambda: tw.hc_pre(*args, tile=t))
                flat = x.reshape(M, -1)
                rec["partials_graph_s"] = graph_time(lambda: tw.partials(flat, fn, True, t))
            except Exception:  # noqa: BLE001
                rec["error"] = traceback.format_exc()[-800:]
            print("hc_pre", M, t, {k: v for k, v in rec.items() if k != "tile"}, case["shipped"], flush=True)
            case["tiles"].append(rec)
        out.append(case)
    return out


def read_norm_cases() -> list:
    """Fast mode's coefficients and the sublayer's normalised input: ``triton_wide.hc_pre`` then
    ``triton_rows.hc_read_norm`` (three launches) against ``triton_wide.hc_pre_read_norm`` (two: the
    finish, the split and the read in one), and their differences."""
    from v4stack.kernels import triton_rows as trw
    from v4stack.kernels import triton_wide as tw

    out = []
    for M in ROWS:
        g = torch.Generator(device="cuda").manual_seed(M + 7)
        x = torch.randn(M, 4, 4096, device="cuda", generator=g).bfloat16()
        fn = torch.randn(24, 16384, device="cuda", generator=g) * 0.01
        scale = torch.rand(3, device="cuda", generator=g) + 0.5
        base = torch.randn(24, device="cuda", generator=g)
        nw = (torch.rand(4096, device="cuda", generator=g) + 0.5).bfloat16()
        args = (x, fn, scale, base, 4, 20, 1e-6, 1e-6)

        def two():
            pre, post, comb = tw.hc_pre(*args)
            return trw.hc_read_norm(x, pre, nw, 1e-6), post, comb

        a, b = two(), tw.hc_pre_read_norm(*args, nw, 1e-6)
        rec = {"rows": M, "separate_graph_s": graph_time(two),
               "fused_graph_s": graph_time(lambda: tw.hc_pre_read_norm(*args, nw, 1e-6)),
               "post_comb_max_abs_diff": max(float((u - v).abs().max()) for u, v in zip(a[1:], b[1:])),
               "input_max_abs_diff": float((a[0].float() - b[0].float()).abs().max()),
               "input_bits_equal": bool(torch.equal(a[0], b[0]))}
        print("read_norm", rec, flush=True)
        out.append(rec)
    return out


def head_cases() -> list:
    """The output head's normalised input in fast mode through the ops: ``hc_head_pre`` (the
    partials, ``finish_sum``, ``head_weights``), ``hc_read`` and ``rms_norm`` - the step's five
    launches before - against ``hc_head_read_norm`` (the partials and one launch), and their bits."""
    from v4stack import ops
    from v4stack.ops import fused

    out = []
    for M in ROWS:
        g = torch.Generator(device="cuda").manual_seed(M + 11)
        x = torch.randn(M, 4, 4096, device="cuda", generator=g).bfloat16()
        fn = torch.randn(4, 16384, device="cuda", generator=g) / 64
        scale, base = torch.rand(1, device="cuda", generator=g) + 0.5, torch.randn(4, device="cuda", generator=g)
        nw = (torch.rand(4096, device="cuda", generator=g) + 0.5).bfloat16()

        def five():
            return ops.rms_norm(ops.hc_read(x, fused.hc_head_pre(x, fn, scale, base, 1e-6, 1e-6)), nw, 1e-6)

        def one():
            return fused.hc_head_read_norm(x, fn, scale, base, 1e-6, 1e-6, nw, 1e-6)

        with ops.mode("fast"):
            ops.reset_counters()
            a, b = five(), one()
            rec = {"rows": M, "separate_graph_s": graph_time(five), "fused_graph_s": graph_time(one),
                   "bits_equal": bool(torch.equal(a, b)), "max_abs_diff": float((a.float() - b.float()).abs().max()),
                   "served_by": {k: dict(v) for k, v in ops.counters().items()
                                 if k in ("hc_head_read_norm", "hc_head_pre", "hc_read", "rms_norm")}}
        print("head_read_norm", rec, flush=True)
        out.append(rec)
    return out


def router_cases() -> list:
    from v4stack import ops
    from v4stack.kernels import triton_wide as tw

    out = []
    for M in ROWS:
        g = torch.Generator(device="cuda").manual_seed(M + 1)
        x = torch.randn(M, 4096, device="cuda", generator=g).bfloat16()
        w = (torch.randn(8, 4096, device="cuda", generator=g) * 0.02).bfloat16()
        wide = w.float()
        want = x.double() @ w.double().T
        case = {"rows": M, "tiles": []}
        with ops.mode("fast"):
            before = ops.linear(x.float(), wide)
            case["widened_copy_then_linear"] = {"max_abs_err": float((before.double() - want).abs().max()),
                                                "graph_s": graph_time(lambda: ops.linear(x.float(), wide))}
        for t in [tw.TILE] + [t for t in HC_TILES[:6] if t != tw.TILE]:  # the shipped tile first
            rec = {"tile": t, "shipped": t == tw.TILE}
            try:
                got = tw.linear_widened(x, w, wide, tile=t)
                rec["max_abs_err"] = float((got.double() - want).abs().max())
                rec["graph_s"] = graph_time(lambda: tw.linear_widened(x, w, wide, tile=t))
            except Exception:  # noqa: BLE001
                rec["error"] = traceback.format_exc()[-800:]
            print("router", M, t, {k: v for k, v in rec.items() if k != "tile"}, case["widened_copy_then_linear"],
                  flush=True)
            case["tiles"].append(rec)
        # the whole router: the logits then the gate (two launches after the partials' one) against
        # the gate adding the partials itself
        from v4stack.kernels import triton_route as trt

        bias = torch.randn(8, device="cuda", generator=g) * 0.1
        a = trt.moe_gate(tw.linear_widened(x, w, wide), bias, None, None, 6, 2.5)
        b = tw.router(x, w, wide, bias, None, None, 6, 2.5)
        def separate():
            return trt.moe_gate(tw.linear_widened(x, w, wide), bias, None, None, 6, 2.5)

        case["router_with_gate"] = {
            "separate_graph_s": graph_time(separate),
            "fused_graph_s": graph_time(lambda: tw.router(x, w, wide, bias, None, None, 6, 2.5)),
            "bits_equal": bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))}
        print("router_with_gate", M, case["router_with_gate"], flush=True)
        out.append(case)
    return out


def greedy_cases(bw: float) -> list:
    from v4stack.kernels import triton_sample as ts

    out = []
    for M in (64, 256):
        g = torch.Generator(device="cuda").manual_seed(M + 2)
        x = (torch.randn(M, 129280, device="cuda", generator=g) * 4).bfloat16()
        ids = x.float().argmax(-1)
        lp = torch.log_softmax(x.double(), -1).gather(1, ids[:, None])[:, 0]
        case = {"rows": M, "floor_s": x.numel() * 2 / bw, "tiles": []}
        for t in GREEDY_TILES:
            rec = {"tile": t, "shipped": t == ts.TILE}
            try:
                tok, o = ts.greedy_draw(x, t)
                rec["ids_equal_argmax"] = bool(torch.equal(tok, ids))
                rec["logprob_max_abs_err"] = float((o[:, 1] - lp).abs().max())
                rec["graph_s"] = graph_time(lambda: ts.greedy_draw(x, t))
                rec["fraction_of_floor"] = case["floor_s"] / rec["graph_s"]
            except Exception:  # noqa: BLE001
                rec["error"] = traceback.format_exc()[-800:]
            print("greedy", M, t, {k: v for k, v in rec.items() if k != "tile"}, flush=True)
            case["tiles"].append(rec)
        out.append(case)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="hc,read_norm,head,router,greedy")
    a = ap.parse_args(argv)
    from bench.indexer_select import copy_bandwidth

    parts = a.parts.split(",")
    bw = copy_bandwidth()
    res = {"device_name": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw}
    if "hc" in parts:
        res["hc_pre"] = hc_cases()
    if "read_norm" in parts:
        res["read_norm"] = read_norm_cases()
    if "head" in parts:
        res["head_read_norm"] = head_cases()
    if "router" in parts:
        res["router"] = router_cases()
    if "greedy" in parts:
        res["greedy"] = greedy_cases(bw)
    write_result(a.out, res)


if __name__ == "__main__":
    main()
