"""The pipeline bubble of 1F1B and of the interleaved schedule, computed from the schedules' own
op orders (``v4stack.train.interleaved.order``) run through the dependency simulation (blocking
receives, non-blocking sends, zero transfer time; a whole-model forward F = 1, backward B = 2).

    python -m bench.pp_bubble [--markdown]

Writes bench/results/pp_bubble.json: per (pp, chunks per rank, micro-batches) the bubble fraction
(idle / step time on each rank), the idle time in units of F + B, and the peak number of
micro-batches' activations a rank holds, in units of one 1F1B stage's (chunks held / V).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.runner import write_result
from v4stack.train.interleaved import order, simulate

RESULTS = Path(__file__).resolve().parent / "results"


def peak_in_flight(ops: list[tuple[str, int, int]], virtual: int) -> float:
    """Most forwards awaiting their backward at once, in whole-stage units (a chunk is 1 / V)."""
    live = peak = 0
    for kind, _, _ in ops:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak / virtual


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--markdown", action="store_true", help="also print the table")
    ap.add_argument("--out", default=str(RESULTS / "pp_bubble.json"))
    args = ap.parse_args(argv)
    f, b = 1.0, 2.0
    rows = []
    for P in (2, 4, 8):
        for V in (1, 2, 4):
            for M in (P, 2 * P, 4 * P, 8 * P):
                sim = simulate(P, V, M, f, b)
                rows.append({"pp": P, "virtual": V, "schedule": "1f1b" if V == 1 else "interleaved",
                             "micro_batches": M, "bubble": round(sim["bubble"], 6),
                             "idle_per_rank_f_plus_b": round((sim["makespan"] - sim["busy"]) / (f + b), 6),
                             "formula_idle_f_plus_b": (P - 1) / V,
                             "peak_activations_rank0_stages": peak_in_flight(order(P, V, M, 0), V)})
    path = write_result(args.out, {"model": {"forward": f, "backward": b, "transfer": 0.0}, "rows": rows})
    print(f"wrote {path}")
    if args.markdown:
        print("| pp | V | M | bubble | idle (F+B) | peak act. rank 0 (stages) |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['pp']} | {r['virtual']} | {r['micro_batches']} | {r['bubble']:.3f} | "
                  f"{r['idle_per_rank_f_plus_b']:.3g} | {r['peak_activations_rank0_stages']:.3g} |")


if __name__ == "__main__":
    main()
