"""Fast mode's CUDA decode attention built with an L2 prefetch size on its 16-byte copies (one GPU
call), writing stamped JSON.

The kernel gathers each candidate row (1 KiB) as 64 copies of 16 bytes; ``cp.async`` can ask L2 to
fetch 64, 128 or 256 bytes around each miss (``CP_L2`` in ``kernels/cuda_attention.cu``). Per
layer of ``bench/attention_online.py`` (window, HCA and CSA at 16k) and row count: the launch
the serving step takes (queries RMS-normalised as loaded), per build, its device time under CUDA
graphs (the median of interleaved rounds) and whether its output has the default build's bits.

    python -m bench.attention_l2hint --out bench/results/attention_l2hint_h100.json
"""

from __future__ import annotations

import argparse

from bench.attention_online import LAYERS, WINDOW, case
from bench.runner import write_result
from bench.timing import graph_variants
from v4stack.kernels import cuda_attention as ca

VARIANTS = {"none": (), "64B": ('-DCP_L2=".L2::64B"',), "128B": ('-DCP_L2=".L2::128B"',),
            "256B": ('-DCP_L2=".L2::256B"',)}


def use(defines) -> None:
    ca.DEFINES = defines


def main(argv=None) -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/attention_l2hint_h100.json")
    ap.add_argument("--rows", default="256,64")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    rows = []
    for T in map(int, a.rows.split(",")):
        for name in ("window", "hca_16k", "csa_16k"):
            k1, visible, entries = LAYERS[name]
            q, pools, idx, sink, scale = case(T, k1, visible, entries)
            rec = graph_variants(lambda: ca.sparse_attention(q, pools, idx, sink, scale, q_eps=1e-6), VARIANTS, use,
                                 rounds=a.rounds)
            use(())
            rows.append({"rows": T, "layer": name, "candidates": WINDOW + k1, "variants": rec})
            print(f"{T:4d} {name:8s} " + "  ".join(f"{k} {v['us']:6.1f} us{'' if v['bits_equal_first'] else '*'}"
                                               for k, v in rec.items()), flush=True)
    write_result(a.out, {"bench": "attention_l2hint", "device_name": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
