"""Benchmark every v4stack op in fast and invariant mode over M; writes JSON (+ PNG).

    python bench/ops.py --device cpu --widths quarter --ms 1,4,16,64,256 \
        --out bench/results/ops_cpu.json --plot bench/results/ops_cpu.png
    python bench/ops.py --device cuda --widths flash --ms 1,8,64,256,4096 \
        --out bench/results/ops_h200.json --plot bench/results/ops_h200.png
"""

import argparse

from v4stack.ops.bench import DEFAULT_MS, OPS, bench_ops, format_table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--widths", default="quarter", help="flash or quarter")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32")
    p.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)), help="comma-separated M values")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated op names")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=2.0, help="stop an op/mode past this time per call")
    p.add_argument("--out", default="bench/results/ops_cpu.json")
    p.add_argument("--plot", default=None)
    a = p.parse_args()
    rep = bench_ops(ms=[int(m) for m in a.ms.split(",")], widths=a.widths, dtype=a.dtype, device=a.device,
                    repeats=a.repeats, budget_s=a.budget_s, op_names=a.ops.split(","), out=a.out, plot=a.plot)
    print(format_table(rep))


if __name__ == "__main__":
    main()
