"""One call each of fast mode's CUDA decode attention (queries RMS-normalised as loaded, as the
serving step launches it) per layer of ``bench/attention_online.py``, for a profiler to read:

    ncu -k regex:decode_attention --section SpeedOfLight --section WarpStateStats \
        python3 -m bench.attention_once --rows 256 --layers window,csa_16k
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    import torch

    from bench.attention_online import LAYERS, case
    from v4stack.kernels import cuda_attention as ca

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--layers", default="window,csa_16k")
    a = ap.parse_args(argv)
    for name in a.layers.split(","):
        q, pools, idx, sink, scale = case(a.rows, *LAYERS[name])
        ca.sparse_attention(q, pools, idx, sink, scale, q_eps=1e-6)
        torch.cuda.synchronize()
        print(name, "done", flush=True)


if __name__ == "__main__":
    main()
