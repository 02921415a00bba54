"""One call each of the shipped indexer kernel over bf16 keys and over V4's packed keys (the
decode step's 256 queries x 4096 entries of 64 heads x 128 dims), for a profiler to read:

    ncu -k regex:indexer_kernel --section SpeedOfLight --section WarpStateStats python3 -m bench.indexer_once

``--ch`` sets the chunks a program (``INDEXER_TILE``'s CH)."""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> None:
    from bench.indexer_fp8 import case
    from v4stack.kernels.triton_gemm import INDEXER_TILE, indexer_scores
    from v4stack.model.quant import IndexRounding
    from v4stack.ops import fp8_keys

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ch", type=int, default=INDEXER_TILE["CH"])
    a = ap.parse_args(argv)
    q, w, keys, rows = case(256, 4096, "cuda")
    keys = IndexRounding()(keys)
    packed = fp8_keys.pack(keys)
    t = dict(INDEXER_TILE, CH=a.ch)
    got = [indexer_scores(q, w, pool, rows, t) for pool in (keys, packed)]
    torch.cuda.synchronize()
    print("bits equal:", bool(torch.equal(*got)))


if __name__ == "__main__":
    main()
