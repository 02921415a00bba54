"""The ops cases of the GPU check at V4-Flash widths (``bench/ops_gpu_check.py``).

Each case builds its inputs once for the largest M and returns a ``Case``: ``rows`` (tensors
whose dim 0 is the row / token), ``call(*rows)`` running the op through ``ops`` (the dispatch
table decides the implementation), and ``framework(*rows)`` running the framework's own
implementation directly (the fast references of ``ops.core`` / cuBLAS), for comparison.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from v4stack import ops
from v4stack.ops import core, quantized

FLASH = dict(d=4096, H=64, c=512, ih=64, ic=128, S=4096, window=128, topk=512, k=6, E=256, inter=2048, n=4,
             pool=8, vocab=129280)


@dataclass
class Case:
    rows: tuple
    call: Callable
    framework: Callable | None = None
    timing: Callable | None = None  # M -> (op call, framework call) on inputs prepared outside the timing


SMALL = dict(d=64, H=4, c=32, ih=16, ic=32, S=96, window=8, topk=40, k=3, E=8, inter=32, n=4, pool=4, vocab=300)


def build(name: str, M: int, w=FLASH, dev: str = "cuda") -> Case:
    g = torch.Generator(device=dev).manual_seed(sum(map(ord, name)))

    def r(*s, dt=torch.bfloat16, scale=1.0):
        return (torch.randn(*s, generator=g, device=dev) * scale).to(dt)

    d, f32, bf = w["d"], torch.float32, torch.bfloat16
    if name == "linear_bf16":
        wt = r(d, d, scale=d ** -0.5)
        return Case((r(M, d),), lambda x: ops.linear(x, wt), lambda x: F.linear(x, wt))
    if name == "linear_fp32":  # the router's shape
        wt = r(w["E"], d, dt=f32, scale=d ** -0.5)
        return Case((r(M, d, dt=f32),), lambda x: ops.linear(x, wt), lambda x: F.linear(x, wt))
    if name == "linear_fp8":
        q, s = quantized.quantize_fp8(torch.randn(d, d, generator=g, device=dev) * d ** -0.5)
        qw = quantized.QuantizedWeight("fp8", q, s)
        dense = qw.dequantize().to(bf)
        return Case((r(M, d),), lambda x: ops.linear(x, qw), lambda x: F.linear(x, dense))
    if name == "grouped_linear":
        wt = r(w["E"], w["inter"], d, scale=d ** -0.5)
        ids = torch.stack([torch.randperm(w["E"], generator=g, device=dev)[: w["k"]] for _ in range(min(M, 64))])
        ids = ids.repeat(-(-M // ids.shape[0]), 1)[:M]

        def routed(fn):
            def call(x, e):
                flat = e.reshape(-1)
                order = torch.argsort(flat, stable=True)
                off = torch.zeros(w["E"] + 1, dtype=torch.long, device=dev)
                off[1:] = torch.cumsum(torch.bincount(flat, minlength=w["E"]), 0)
                y = fn(x[order // w["k"]], wt, off)
                out = torch.empty_like(y)
                out[order] = y
                return out.view(x.shape[0], w["k"], -1)
            return call

        grouped = importlib.import_module("v4stack.ops.grouped")
        x_all = r(M, d)

        def timing(m):  # the grouped GEMM alone: rows already sorted by expert, offsets on the device
            flat = ids[:m].reshape(-1)
            order = torch.argsort(flat, stable=True)
            off = torch.zeros(w["E"] + 1, dtype=torch.long, device=dev)
            off[1:] = torch.cumsum(torch.bincount(flat, minlength=w["E"]), 0)
            xs = x_all[:m][order // w["k"]].contiguous()
            return (lambda: ops.grouped_linear(xs, wt, off)), (lambda: grouped.fast(xs, wt, off))

        return Case((x_all, ids), routed(ops.grouped_linear), routed(grouped.fast), timing)
    if name == "softmax":
        return Case((r(M, d, dt=f32),), lambda x: ops.softmax(x, -1), lambda x: torch.softmax(x, -1))
    if name == "log_softmax_vocab":
        return Case((r(M, w["vocab"], dt=f32),), lambda x: ops.log_softmax(x, -1), lambda x: torch.log_softmax(x, -1))
    if name == "rms_norm":
        nw = (torch.rand(d, generator=g, device=dev) + 0.5).to(bf)
        return Case((r(M, d),), lambda x: ops.rms_norm(x, nw, 1e-6), lambda x: core.rms_norm(x, nw, 1e-6))
    if name == "hc_mix":
        n = w["n"]
        fn = r(n * n + 2 * n, n * d, dt=f32, scale=(n * d) ** -0.5)
        return Case((r(M, n * d, dt=f32),), lambda x: ops.hc_mix(x, fn, 1e-6), lambda x: core.hc_mix(x, fn, 1e-6))
    if name == "indexer_scores":
        k = r(w["S"], w["ic"])
        return Case((r(M, w["ih"], w["ic"]), r(M, w["ih"], dt=f32)), lambda q, wt: ops.indexer_scores(q, wt, k),
                    lambda q, wt: core.indexer_scores(q, wt, k))
    if name == "indexer_scores_rows":  # the paged step: each query's own entries, by index into the key pool
        E = w["S"]
        pool = r(64 * E, w["ic"])
        rows = torch.randint(0, pool.shape[0], (M, E), generator=g, device=dev)
        rows[:, -37:] = -1
        ir = importlib.import_module("v4stack.ops.indexer_rows")
        return Case((r(M, w["ih"], w["ic"]), r(M, w["ih"], dt=f32), rows),
                    lambda q, wt, j: ops.indexer_scores(q, wt, pool, rows=j), lambda q, wt, j: ir.fast(q, wt, pool, j))
    if name == "weighted_pool":
        return Case((r(M, w["pool"], w["c"], dt=f32), r(M, w["pool"], w["c"], dt=f32)),
                    lambda kv, s: ops.weighted_pool(kv, s, 1), lambda kv, s: core.weighted_pool(kv, s, 1))
    if name == "moe_combine":
        idx = torch.randint(0, w["E"], (M, w["k"]), generator=g, device=dev)
        return Case((r(M, w["k"], d, dt=f32), idx), ops.moe_combine, core.moe_combine)
    if name == "topk_stable":
        x = torch.randint(-64, 64, (M, w["S"]), generator=g, device=dev).to(f32) / 8  # ties
        return Case((x,), lambda x: ops.topk(x, w["topk"], stable=True)[1],
                    lambda x: torch.topk(x, w["topk"], dim=-1).indices)
    if name in ("sparse_attention", "attention_with_sink"):
        H, c = w["H"], w["c"]
        np0, np1 = 32 * w["window"] * 4, 64 * w["topk"]
        pool0, pool1 = r(np0, c), r(np1, c)
        i0 = torch.randint(0, np0, (M, w["window"]), generator=g, device=dev)
        i1 = torch.randint(0, np1, (M, w["topk"]), generator=g, device=dev)
        i1[:, -37:] = -1  # trailing hidden candidates
        sink = torch.randn(H, generator=g, device=dev)
        q = r(M, H, c)
        sc = c ** -0.5
        if name == "sparse_attention":
            sa = importlib.import_module("v4stack.ops.sparse_attention")
            return Case((q, i0, i1), lambda q, a, b: ops.sparse_attention(q, [pool0, pool1], [a, b], sink, sc),
                        lambda q, a, b: sa.fast(q, [pool0, pool1], [a, b], sink, sc))

        def dense(fn):
            def call(q, a, b):
                keys = torch.cat([pool0[a], pool1[b.clamp(min=0)]], 1)
                mask = torch.cat([a >= 0, b >= 0], 1)
                return fn(q, keys, mask, sink, sc)
            return call

        return Case((q, i0, i1), dense(ops.attention_with_sink), dense(core.attention_with_sink))
    if name == "hc_read":
        return Case((r(M, w["n"], d), torch.rand(M, w["n"], generator=g, device=dev)), ops.hc_read, core.hc_read)
    if name == "hc_write":
        n = w["n"]
        return Case((r(M, n, d), r(M, d), torch.rand(M, n, generator=g, device=dev),
                     torch.rand(M, n, n, generator=g, device=dev)), ops.hc_write, core.hc_write)
    raise ValueError(f"unknown case {name!r}")


CASES = ("linear_bf16", "linear_fp32", "linear_fp8", "grouped_linear", "softmax", "log_softmax_vocab", "rms_norm",
         "hc_mix", "indexer_scores", "indexer_scores_rows", "weighted_pool", "moe_combine", "topk_stable", "sparse_attention",
         "attention_with_sink", "hc_read", "hc_write")
