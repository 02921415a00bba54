"""Fast mode's online-softmax sparse attention (``triton_attention_online``) against the bucket
table's launch (``triton_attention``) on one GPU, writing stamped JSON: V4-Flash widths (64 heads
of 512, bf16), each row with its own 128-entry window pool and, for the compressed layers, its
own compressed pool (4096 entries at 16k tokens for CSA, 128 for HCA at 16k, 256 visible of a
512-entry top-k at 1k), at 64 / 256 / 1024 query rows. Per case: device time of both under CUDA
graphs (and of the online launch after the queries' RMS norm kernel against the launch that
normalises the queries it loads, ``q_eps``), the bytes of candidate rows read and the rate that makes, each one's largest error
against an fp32 torch reference over the same candidates, and which the fast-mode dispatch
(``ops.sparse_attention``) runs.

    python -m bench.attention_online --out bench/results/attention_online_h200.json
"""

from __future__ import annotations

import argparse

import torch

from bench.runner import write_result
from bench.timing import graph_time
from v4stack import ops
from v4stack.kernels import triton_attention as ta
from v4stack.kernels import triton_attention_online as online
from v4stack.kernels.attention_tiles import pick, takes_online

H, D, WINDOW = 64, 512, 128
# name: (compressed candidates a row, visible of them, compressed entries a request)
LAYERS = {"window": (0, 0, 0), "csa_1k": (512, 256, 256), "csa_16k": (512, 512, 4096), "hca_16k": (128, 128, 128)}


def case(T: int, k1: int, visible: int, entries: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    rows = torch.arange(T, device="cuda")[:, None]
    pools = [torch.randn(T * WINDOW, D, device="cuda", generator=g, dtype=torch.bfloat16)]
    idx = [(rows * WINDOW + torch.arange(WINDOW, device="cuda")[None]).int()]
    if k1:
        pools.append(torch.randn(T * entries, D, device="cuda", generator=g, dtype=torch.bfloat16))
        pick1 = torch.randint(0, entries, (T, k1), device="cuda", generator=g) + rows * entries
        pick1[:, visible:] = -1
        idx.append(pick1.int())
    return q, pools, idx, torch.randn(H, device="cuda", generator=g), D ** -0.5


def reference(q, pools, idx, sink, scale):
    keys = torch.cat([p[i.clamp(min=0).long()] for p, i in zip(pools, idx)], 1).float()
    seen = torch.cat([i >= 0 for i in idx], 1)
    s = (torch.einsum("thd,tkd->thk", q.float(), keys) * scale).masked_fill(~seen[:, None, :], float("-inf"))
    s = torch.cat([s, sink.float()[None, :, None].expand(s.shape[0], -1, 1)], 2)
    return torch.einsum("thk,tkd->thd", torch.softmax(s, 2)[..., :-1], keys)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench attention-online", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/attention_online_h200.json")
    ap.add_argument("--rows", default="64,256,1024")
    a = ap.parse_args(argv)
    out = []
    for T in map(int, a.rows.split(",")):
        for name, (k1, visible, entries) in LAYERS.items():
            q, pools, idx, sink, scale = case(T, k1, visible, entries)
            want = reference(q, pools, idx, sink, scale)
            table = ta.sparse_attention(q, pools, idx, sink, scale)
            fast = online.sparse_attention(q, pools, idx, sink, scale, force=True)
            ops.reset_counters()
            with ops.mode("fast"):
                ops.sparse_attention(q, pools, idx, sink, scale)
            row = dict(rows=T, layer=name, candidates=WINDOW + k1, visible=WINDOW + visible,
                       bytes_read=T * (WINDOW + visible) * D * 2, table_tile=pick(T, H), online_taken=takes_online(T, H),
                       fast_mode_runs=ops.counters().get("sparse_attention"),
                       table_us=graph_time(lambda: ta.sparse_attention(q, pools, idx, sink, scale)) * 1e6,
                       online_us=graph_time(lambda: online.sparse_attention(q, pools, idx, sink, scale,
                                                                              force=True)) * 1e6,
                       table_max_err=float((table.float() - want).abs().max()),
                       online_max_err=float((fast.float() - want).abs().max()))
            # the queries' per-head RMS norm: a kernel of its own before the launch, or in the launch
            row["norm_then_online_us"] = graph_time(lambda: online.sparse_attention(
                ops.rms_norm(q, None, 1e-6), pools, idx, sink, scale, force=True)) * 1e6
            row["normed_online_us"] = graph_time(lambda: online.sparse_attention(q, pools, idx, sink, scale, force=True,
                                                                                 q_eps=1e-6)) * 1e6
            normed = online.sparse_attention(q, pools, idx, sink, scale, force=True, q_eps=1e-6).float()
            row["normed_vs_norm_then_max_err"] = float((normed - online.sparse_attention(
                ops.rms_norm(q, None, 1e-6), pools, idx, sink, scale, force=True).float()).abs().max())
            row["table_GBps"] = row["bytes_read"] / row["table_us"] / 1e3
            row["online_GBps"] = row["bytes_read"] / row["online_us"] / 1e3
            out.append(row)
            print(f"{T:>5} rows {name:>8}: table {row['table_us']:7.1f} us ({row['table_GBps']:5.0f} GB/s), online "
                  f"{row['online_us']:7.1f} us ({row['online_GBps']:5.0f} GB/s), err {row['table_max_err']:.2e} / "
                  f"{row['online_max_err']:.2e}, fast mode runs {row['fast_mode_runs']}; norm then online "
                  f"{row['norm_then_online_us']:7.1f} us, normed online {row['normed_online_us']:7.1f} us", flush=True)
            del q, pools, idx, want, table, fast
            torch.cuda.empty_cache()
            write_result(a.out, {"widths": dict(H=H, D=D, window=WINDOW), "cases": out,
                                 "device_name": torch.cuda.get_device_name()})


if __name__ == "__main__":
    main()
