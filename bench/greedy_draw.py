"""The greedy draw's first kernel by launch shape (one H200 call): ``triton_sample.greedy_draw`` over
a decode step's bf16 logits (V-Flash's vocabulary, 1 / 64 / 256 rows), each tile's ids compared with
``torch.argmax`` and its log-probabilities with float64, timed under CUDA graphs beside the bytes the
logits take over the measured copy bandwidth.

    python -m bench.greedy_draw --out bench/results/greedy_draw_h200.json
"""

from __future__ import annotations

import argparse
import traceback

import torch

from bench.indexer_select import copy_bandwidth
from bench.runner import write_result
from bench.timing import graph_time

VOCAB = 129280
TILES = [
    {"CHUNK": 4096, "BLOCK": 1024, "num_warps": 4},
    {"CHUNK": 4096, "BLOCK": 2048, "num_warps": 4},
    {"CHUNK": 4096, "BLOCK": 4096, "num_warps": 4},
    {"CHUNK": 4096, "BLOCK": 4096, "num_warps": 8},
    {"CHUNK": 8192, "BLOCK": 2048, "num_warps": 8},
    {"CHUNK": 8192, "BLOCK": 4096, "num_warps": 8},
    {"CHUNK": 2048, "BLOCK": 2048, "num_warps": 4},
    {"CHUNK": 2048, "BLOCK": 1024, "num_warps": 4},
    {"CHUNK": 16384, "BLOCK": 4096, "num_warps": 8},
    # the block form, one block a program (the shipped launch), at one and two warps
    {"CHUNK": 2048, "BLOCK": 2048, "num_warps": 2, "blocks": True},
    {"CHUNK": 1024, "BLOCK": 1024, "num_warps": 1, "blocks": True},
    # the lean form (``lean``: columns a row)
    {"CHUNK": 2048, "BLOCK": 2048, "num_warps": 2, "lean": 8},
    {"CHUNK": 2048, "BLOCK": 2048, "num_warps": 4, "lean": 8},
    {"CHUNK": 4096, "BLOCK": 4096, "num_warps": 2, "lean": 8},
    {"CHUNK": 4096, "BLOCK": 4096, "num_warps": 4, "lean": 8},
    {"CHUNK": 8192, "BLOCK": 8192, "num_warps": 4, "lean": 8},
    {"CHUNK": 8192, "BLOCK": 8192, "num_warps": 8, "lean": 8},
    {"CHUNK": 4096, "BLOCK": 4096, "num_warps": 4, "lean": 16},
    {"CHUNK": 1024, "BLOCK": 1024, "num_warps": 1, "lean": 8},
]


def main(argv=None) -> None:
    from v4stack.kernels import triton_sample as ts

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiles", type=int, default=0,
                    help="the last N tiles only, and the shipped one (0: all); the stage that picks a tile compares "
                         "each with the shipped one")
    a = ap.parse_args(argv)
    bw = copy_bandwidth()
    cases = []
    tiles = TILES[-a.tiles:] if a.tiles else TILES
    tiles = tiles if ts.SHIPPED in tiles else [dict(ts.SHIPPED), *tiles]
    for B in (256, 64, 1):
        g = torch.Generator(device="cuda").manual_seed(B)
        x = (torch.randn(B, VOCAB, device="cuda", generator=g) * 3).bfloat16()
        ref_tok = torch.argmax(x.float(), -1)
        ref_lp = torch.log_softmax(x.double(), -1).gather(1, ref_tok[:, None])[:, 0]
        case = {"rows": B, "vocab": VOCAB, "floor_s": x.numel() * 2 / bw, "tiles": []}
        for t in tiles:
            rec = {"tile": t}
            try:
                tok, out = ts.greedy_draw(x, t)
                rec["ids_equal_argmax"] = bool(torch.equal(tok, ref_tok))
                rec["logprob_max_abs_err"] = float((out[:, 1] - ref_lp).abs().max())
                rec["graph_s"] = graph_time(lambda: ts.greedy_draw(x, t))
                rec["fraction_of_floor"] = case["floor_s"] / rec["graph_s"]
            except Exception:  # noqa: BLE001
                rec["error"] = traceback.format_exc()[-800:]
            print(B, t, {k: v for k, v in rec.items() if k != "tile"}, flush=True)
            case["tiles"].append(rec)
        cases.append(case)
    write_result(a.out, {"device_name": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw, "cases": cases})


if __name__ == "__main__":
    main()
