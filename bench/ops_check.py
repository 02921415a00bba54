"""Run `check_invariance` in both ops modes and write one JSON (CPU by default).

    python -m bench.ops_check --out bench/results/ops_check_cpu.json
"""

import argparse
import time

import torch

from v4stack.check import check_invariance
from bench.runner import write_result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    p.add_argument("--out", default="bench/results/ops_check_cpu.json")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rep = {}
    for mode in ("invariant", "fast"):
        t0 = time.perf_counter()
        r = check_invariance(a.preset, a.prompts, mode, dtype=a.dtype, device=a.device)
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        r["threads"] = torch.get_num_threads()
        rep[mode] = r
        print(mode, {k: r[k] for k in ("steps_compared", "steps_differ", "requests_differ", "deterministic",
                                       "chunking_invariant", "wall_s")}, r["one_chunk"], flush=True)
    write_result(a.out, rep)


if __name__ == "__main__":
    main()
