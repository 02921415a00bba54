"""The closed loop on the CPU: `v4stack loop --preset tiny --minutes 5 --json`, stamped.

    python -m bench.loop_cpu [--minutes 5] [--out runs/loop] [extra `v4stack loop` options ...]

Runs the command in this process with ``--fresh`` (the RL steps start over; the supervised policy
in ``<out>/policy`` is reused when it exists, trained first otherwise), then writes the run's log
(every step, every evaluation, the faults, the summary with the held-out reward of the supervised
policy and of the final one, mean and standard error) to bench/results/loop_cpu_tiny.json and the
reward curve to loop_cpu_tiny.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from bench.runner import write_result

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--out", default="runs/loop")
    ap.add_argument("--name", default="loop_cpu_tiny")
    args, extra = ap.parse_known_args(argv)
    import typer.main

    from v4stack.rl.cli import loop_command

    cmd = ["--preset", "tiny", "--minutes", str(args.minutes), "--json", "--out", args.out, "--fresh", *extra]
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    app = typer.Typer(add_completion=False)
    app.command()(loop_command)
    typer.main.get_command(app).main(cmd, standalone_mode=False)
    wall = time.perf_counter() - t0
    doc = json.loads((Path(args.out) / "loop.json").read_text())
    doc.update(bench="loop_cpu", loop_command="v4stack loop " + " ".join(cmd), wall_s=round(wall, 1),
               load_at_start=load0, load_at_end=os.getloadavg())
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(RESULTS / f"{args.name}.json", doc)
    shutil.copyfile(Path(args.out) / "loop.png", RESULTS / f"{args.name}.png")
    s = doc["summary"]
    print(f"held-out reward: supervised {s['sft_eval']['reward_mean']:.3f} +- {s['sft_eval']['reward_se']:.3f}, "
          f"final {s['final_eval']['reward_mean']:.3f} +- {s['final_eval']['reward_se']:.3f}; "
          f"rise {s['rise']:.3f} = {s['rise_in_se']} SE")
    return doc


if __name__ == "__main__":
    main()
