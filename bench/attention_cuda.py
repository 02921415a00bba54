"""Fast mode's decode attention in CUDA C++ (``kernels/cuda_attention.cu``) against the Triton
launches it would replace, on one GPU, writing stamped JSON: V4-Flash widths (64 heads of 512,
bf16), the layers of ``bench/attention_online.py`` (window only, CSA at 1k and 16k tokens, HCA at
16k), at the given query rows. Per case: device time under CUDA graphs of the CUDA kernel, the
Triton online launch and the bucket table's launch, each one's largest error against the fp32
torch reference over the same candidates, the same for the launch that RMS-normalises the
queries it loads (against the online launch doing the same), and the bytes the case must move
(queries, candidate rows, outputs) over the CUDA kernel's time; ``cuda_grid``: the normed launch
one block a row and with blocks walking several rows, and whether their bits are the same
(``cuda.walks``: which one the launcher takes).

    python -m bench.attention_cuda --out bench/results/attention_cuda_h200.json
"""

from __future__ import annotations

import argparse

import torch

from bench.attention_online import LAYERS, WINDOW, H, D, case, reference
from bench.runner import write_result
from bench.timing import graph_time
from v4stack.kernels import cubin
from v4stack.kernels import cuda_attention as ca
from v4stack.kernels import triton_attention as ta
from v4stack.kernels import triton_attention_online as online


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench attention-cuda", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/attention_cuda_h200.json")
    ap.add_argument("--rows", default="1,16,64,128,256,1024")
    a = ap.parse_args(argv)
    path, report = cubin.build(ca.SOURCE)
    out = []
    for T in map(int, a.rows.split(",")):
        for name, (k1, visible, entries) in LAYERS.items():
            q, pools, idx, sink, scale = case(T, k1, visible, entries)
            want = reference(q, pools, idx, sink, scale)
            row = dict(rows=T, layer=name, candidates=WINDOW + k1, visible=WINDOW + visible,
                       bytes_moved=T * ((WINDOW + visible) * D * 2 + 2 * H * D * 2),
                       online_us=graph_time(lambda: online.sparse_attention(q, pools, idx, sink, scale,
                                                                              force=True)) * 1e6,
                       table_us=graph_time(lambda: ta.sparse_attention(q, pools, idx, sink, scale)) * 1e6,
                       online_max_err=float((online.sparse_attention(q, pools, idx, sink, scale, force=True).float()
                                             - want).abs().max()))
            ref_n = online.sparse_attention(q, pools, idx, sink, scale, force=True, q_eps=1e-6).float()
            got = ca.sparse_attention(q, pools, idx, sink, scale)
            got64 = ca.sparse_attention(q, pools, [i.long() for i in idx], sink, scale)
            normed = ca.sparse_attention(q, pools, idx, sink, scale, q_eps=1e-6).float()
            cu = row["cuda"] = dict(
                us=graph_time(lambda: ca.sparse_attention(q, pools, idx, sink, scale)) * 1e6,
                max_err=float((got.float() - want).abs().max()), i64_same_bits=bool(torch.equal(got, got64)),
                normed_us=graph_time(lambda: ca.sparse_attention(q, pools, idx, sink, scale, q_eps=1e-6)) * 1e6,
                normed_vs_online_max_err=float((normed - ref_n).abs().max()))
            cu["GBps"] = row["bytes_moved"] / cu["us"] / 1e3
            cu["walks"] = -(-(WINDOW + k1) // ca.CHUNK) <= ca.WALK_CHUNKS
            # both grids, normed (the launcher walks rows of at most WALK_CHUNKS chunks): the same bits
            row["cuda_grid"] = {("walking" if w else "block_a_row"): graph_time(
                lambda: ca.sparse_attention(q, pools, idx, sink, scale, q_eps=1e-6, walk=w)) * 1e6 for w in (False, True)}
            row["cuda_grid"]["same_bits"] = bool(torch.equal(
                ca.sparse_attention(q, pools, idx, sink, scale, q_eps=1e-6, walk=False),
                ca.sparse_attention(q, pools, idx, sink, scale, q_eps=1e-6, walk=True)))
            row["normed_online_us"] = graph_time(lambda: online.sparse_attention(q, pools, idx, sink, scale, force=True,
                                                                                 q_eps=1e-6)) * 1e6
            out.append(row)
            print(f"{T:>5} rows {name:>8}: cuda {cu['us']:7.1f} us ({cu['GBps']:5.0f} GB/s) err {cu['max_err']:.2e} "
                  f"i64 same {cu['i64_same_bits']} normed {cu['normed_us']:7.1f} (diff "
                  f"{cu['normed_vs_online_max_err']:.2e}); online {row['online_us']:7.1f} (err "
                  f"{row['online_max_err']:.2e}, normed {row['normed_online_us']:7.1f}) table {row['table_us']:7.1f}; "
                  f"normed a block a row {row['cuda_grid']['block_a_row']:.1f} walking {row['cuda_grid']['walking']:.1f} "
                  f"(same bits {row['cuda_grid']['same_bits']})", flush=True)
            del q, pools, idx, want, got, got64
            torch.cuda.empty_cache()
            write_result(a.out, {"widths": dict(H=H, D=D, window=WINDOW), "cases": out, "cubin": path.name,
                                 "ptxas": report, "device_name": torch.cuda.get_device_name()})


if __name__ == "__main__":
    main()
