"""Device time of the decode step's small kernels at flash widths, one call each under a CUDA graph.

    python -m bench.decode_kernels --rows 64,256 --out bench/results/decode_kernels_h200.json

Rows are a decode step's tokens (batch). Each case is captured ``reps`` times back to back in one
CUDA graph; the graph is replayed and the time per call is the median replay over ``reps``.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from bench.runner import write_result


def graph_time(fn, reps: int = 20, replays: int = 15) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3 / reps)
    ts.sort()
    return ts[len(ts) // 2]


def cases(T: int, dev: str):
    from v4stack import ops
    from v4stack.ops import fused
    from bench.serve_roofline import build_config
    from v4stack.model.rope import rope_frequencies

    cfg = build_config("flash4")
    H, D, r = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
    g = torch.Generator(device=dev).manual_seed(T)
    pos = torch.randint(0, 16384, (T,), device=dev, generator=g)
    freqs = rope_frequencies(cfg, True).to(dev)
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    kv = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=g)
    pool = torch.empty(4 * T, D, device=dev, dtype=torch.bfloat16)
    dest = torch.randperm(4 * T, device=dev, generator=g)[:T]
    out = {}
    out["rope_ q"] = lambda: fused.rope_(q, pos, freqs, False)
    out["rope_into kv"] = lambda: fused.rope_into(kv, pos, freqs, pool, dest)
    from v4stack.kernels import triton_mhc as tm

    tab = tm.rope_table(pos, freqs)
    out["rope_table"] = lambda: tm.rope_table(pos, freqs)
    out["rope_ q (table)"] = lambda: tm.rope_(q, pos, freqs, False, tab)
    out["rope_into kv (table)"] = lambda: tm.rope_into(kv, pos, freqs, pool, dest, tab)
    same = torch.equal(tm.rope_(q.clone(), pos, freqs, True), tm.rope_(q.clone(), pos, freqs, True, tab))
    out["rope table bits equal"] = f"equal={same}"
    d, n = cfg.hidden_size, cfg.hc_mult
    x = torch.randn(T, n, d, device=dev, dtype=torch.bfloat16, generator=g)
    fn = torch.randn(n * n + 2 * n, n * d, device=dev, generator=g) * (n * d) ** -0.5
    scale = torch.ones(3, device=dev)
    base = torch.zeros(n * n + 2 * n, device=dev)
    from v4stack.kernels import triton_gemm as tg, triton_mhc as tm2

    out["hc_mix bf16 streams"] = lambda: tg.hc_mix(x.view(T, -1), fn, 1e-6)
    mix = tg.hc_mix(x.view(T, -1), fn, 1e-6)
    out["hc_split"] = lambda: tm2.hc_split(mix, scale, base, n, cfg.hc_sinkhorn_iters, 1e-6)
    pre = torch.rand(T, n, device=dev, generator=g)
    out["hc_read"] = lambda: ops.hc_read(x, pre)
    wn = torch.rand(d, device=dev, dtype=torch.bfloat16, generator=g) + 0.5
    out["hc_read then rms_norm"] = lambda: ops.rms_norm(ops.hc_read(x, pre), wn, 1e-6)
    out["hc_read_norm"] = lambda: fused.hc_read_norm(x, pre, wn, 1e-6)
    out["hc_pre (projection and split)"] = lambda: fused.hc_pre(x, fn, scale, base, n, cfg.hc_sinkhorn_iters, 1e-6,
                                                                1e-6)
    o = torch.randn(T, d, device=dev, dtype=torch.bfloat16, generator=g)
    comb = torch.rand(T, n, n, device=dev, generator=g)
    out["hc_write"] = lambda: ops.hc_write(x, o, pre, comb)
    for w_ in (d, cfg.q_lora_rank, D):
        xx = torch.randn(T, w_, device=dev, dtype=torch.bfloat16, generator=g)
        wt = torch.ones(w_, device=dev, dtype=torch.bfloat16)
        out[f"rms_norm {w_}"] = (lambda xx=xx, wt=wt: ops.rms_norm(xx, wt, 1e-6))
    out["rms_norm heads"] = lambda: ops.rms_norm(q, None, 1e-6)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    logits = torch.randn(T, E, device=dev, generator=g)
    bias = torch.zeros(E, device=dev)
    out["moe_gate"] = lambda: fused.moe_gate(logits, bias, None, None, k, 1.5)
    idx, w = fused.moe_gate(logits, bias, None, None, k, 1.5)
    idx1 = torch.nn.functional.pad(idx, (0, 1), value=E)
    w1 = torch.nn.functional.pad(w, (0, 1), value=1.0)
    out["moe_route"] = lambda: fused.moe_route(idx1, w1, E + 1)
    out["pad idx + w"] = lambda: (torch.nn.functional.pad(idx, (0, 1), value=E),
                                  torch.nn.functional.pad(w, (0, 1), value=1.0))
    # a CSA layer's projections of x: six GEMMs, or one over the packed weight (model/packed.py)
    xr = torch.randn(T, d, device=dev, dtype=torch.bfloat16, generator=g)
    widths = (cfg.q_lora_rank, D, 2 * D, 2 * D, 2 * cfg.index_head_dim, 2 * cfg.index_head_dim)
    ws = [torch.randn(n_, d, device=dev, dtype=torch.bfloat16, generator=g) * d ** -0.5 for n_ in widths]
    wp = torch.cat(ws)
    out["x projections, six GEMMs"] = lambda: [ops.linear(xr, w_) for w_ in ws]
    out["x projections, packed"] = lambda: ops.linear(xr, wp).split(list(widths), -1)
    sep, pk = [ops.linear(xr, w_) for w_ in ws], ops.linear(xr, wp).split(list(widths), -1)
    out["x projections bits equal"] = f"equal={all(torch.equal(a_, b_) for a_, b_ in zip(sep, pk))}"
    # the indexer's scores at 16k context (4096 entries of ratio 4), keys by index from the pool
    iq = torch.randn(T, cfg.index_n_heads, cfg.index_head_dim, device=dev, dtype=torch.bfloat16, generator=g)
    iw = torch.randn(T, cfg.index_n_heads, device=dev, dtype=torch.bfloat16, generator=g)
    ipool = torch.randn(T * 4096, cfg.index_head_dim, device=dev, dtype=torch.bfloat16, generator=g)
    irows = torch.randperm(T * 4096, device=dev, generator=g).view(T, 4096)
    out["indexer 4096 keys"] = lambda: tg.indexer_scores(iq, iw, ipool, irows)
    isc = tg.indexer_scores(iq, iw, ipool, irows)
    out["topk_rows 512 of 4096"] = lambda: fused.topk_rows(isc, irows, cfg.index_topk)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--out", default="bench/results/decode_kernels_h200.json")
    a = ap.parse_args(argv)
    from v4stack import ops

    res = []
    for mode in ("fast", "invariant"):
        with ops.mode(mode):
            for T in map(int, a.rows.split(",")):
                for name, fn in cases(T, "cuda").items():
                    if isinstance(fn, str):  # a check's outcome, not a timing
                        res.append({"mode": mode, "rows": T, "case": name, "value": fn})
                        print(f"{mode:9s} T={T:4d} {name:24s} {fn}", flush=True)
                        continue
                    try:
                        t = graph_time(fn)
                        res.append({"mode": mode, "rows": T, "case": name, "us": t * 1e6})
                        print(f"{mode:9s} T={T:4d} {name:24s} {t * 1e6:8.2f} us", flush=True)
                    except Exception as e:  # noqa: BLE001
                        res.append({"mode": mode, "rows": T, "case": name, "error": repr(e)[:300]})
                        print(mode, T, name, "ERROR", repr(e)[:300], flush=True)
    write_result(a.out, {"results": res})


if __name__ == "__main__":
    main()
