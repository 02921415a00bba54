"""Fast mode's CUDA decode attention against an older tree's source of it, on one GPU, writing
stamped JSON: per layer of ``bench/attention_online.py`` (window, HCA and CSA at 16k) and row count,
the launch the serving step takes (queries RMS-normalised as loaded) built from each source, its
device time under CUDA graphs (the median of interleaved rounds) and whether the new build's output
has the old one's bits.

    mkdir -p bench/ab_old && git archive <commit> src | tar -x -C bench/ab_old
    python -m bench.attention_cuda_ab --out bench/results/attention_cuda_ab_h100.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.attention_online import LAYERS, WINDOW, case
from bench.runner import write_result
from bench.timing import graph_variants
from v4stack.kernels import cuda_attention as ca

OLD = Path(__file__).resolve().parent / "ab_old" / "src" / "v4stack" / "kernels" / ca.SOURCE


def use(source) -> None:
    ca.SOURCE = source  # cubin takes a path outside the package as it is


def main(argv=None) -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/attention_cuda_ab_h100.json")
    ap.add_argument("--rows", default="256,64")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    if not OLD.exists():
        raise SystemExit(f"attention_cuda_ab: no old source at {OLD} (see the docstring)")
    new = ca.SOURCE
    variants = {"old": str(OLD), "new": new}
    rows = []
    for T in map(int, a.rows.split(",")):
        for name in ("window", "hca_16k", "csa_16k"):
            k1, visible, entries = LAYERS[name]
            q, pools, idx, sink, scale = case(T, k1, visible, entries)
            rec = graph_variants(lambda: ca.sparse_attention(q, pools, idx, sink, scale, q_eps=1e-6), variants, use,
                                 rounds=a.rounds)
            use(new)
            rows.append({"rows": T, "layer": name, "candidates": WINDOW + k1, "variants": rec})
            print(f"{T:4d} {name:8s} old {rec['old']['us']:6.1f} us  new {rec['new']['us']:6.1f} us  "
                  f"bits equal {rec['new']['bits_equal_first']}", flush=True)
    write_result(a.out, {"bench": "attention_cuda_ab", "device_name": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
