"""A rollout worker process for the crash tests: recovers its WAL, finishes every trajectory.

    python tests/rollout/crash_worker.py --wal DIR --client-log FILE [--n 3] [--max-tokens 24]
        [--pipeline] [--preempt-every K]

The client log is written by the exposer (one JSON line per exposure, with the record end and the
WAL's durable position at that moment), so it shows what a client saw and when. On start the
worker cuts a torn last line of the client log, recovers the WAL, re-delivers durable tokens the
client had not seen, submits trajectories the WAL does not know yet, and decodes to the end.
With ``--preempt-every K`` it preempts one trajectory every K steps, saving its KV, and resumes
it the next step, so kills also land inside preempt / resume.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch

from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.rollout import RolloutWorker, TokenWAL
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams


def specs(n: int, max_tokens: int) -> list[tuple[str, list[int], SamplingParams]]:
    """The trajectories of a run: seeded sampling on even ones, greedy on odd ones."""
    rng = random.Random(1234)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, 256) for _ in range(9 + 7 * i)]
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.8 if i % 2 == 0 else 0.0, top_k=50, seed=100 + i)
        out.append((f"traj-{i}", prompt, sp))
    return out


def make_engine() -> Engine:
    torch.set_num_threads(1)  # the tests share two cores with other work
    model = V4Model(preset("tiny"), seed=0).cast(torch.float32).eval()
    return Engine(model, EngineConfig(n_blocks=64, n_slots=8, token_budget=64))


def read_client_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    data = open(path, "rb").read()
    return [json.loads(line) for line in data.split(b"\n")[:-1]]  # the part after the last \n is torn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wal", required=True)
    ap.add_argument("--client-log", required=True)
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--pipeline", action="store_true")
    ap.add_argument("--preempt-every", type=int, default=0)
    a = ap.parse_args(argv)

    if os.path.exists(a.client_log):  # cut a line torn by a kill, so the next line starts clean
        data = open(a.client_log, "rb").read()
        with open(a.client_log, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
    seen: dict[str, tuple[int, bool]] = {}
    for e in read_client_log(a.client_log):
        n, _ = seen.get(e["traj"], (0, False))
        seen[e["traj"]] = (n + len(e["ids"]), e["fin"])

    fd = os.open(a.client_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def expose(e) -> None:
        line = {"traj": e.traj, "off": e.off, "ids": list(e.ids), "fin": e.finished, "end": e.record_end,
                "durable": e.durable_lsn, "pid": os.getpid()}
        os.write(fd, (json.dumps(line) + "\n").encode())

    wal = TokenWAL(a.wal)
    worker = RolloutWorker(make_engine(), wal, expose, pipeline=a.pipeline)
    print(json.dumps({"recovery_cut": wal.recovery.cut_bytes, "resumed": worker.recover()}), flush=True)
    for tid, tr in wal.trajectories.items():
        n, fin = seen.get(tid, (0, False))
        if n < len(tr.tokens) or (tr.finished and not fin):
            worker.redeliver(tid, n)
    for tid, prompt, sp in specs(a.n, a.max_tokens):
        if tid not in wal.trajectories:
            worker.submit(tid, prompt, sp)
    print("decoding", flush=True)
    steps, parked = 0, None
    while worker.engine.has_work() or parked:
        if parked:
            worker.resume(parked)
            parked = None
        worker.step()
        steps += 1
        if a.preempt_every and steps % a.preempt_every == 0 and worker.live:
            parked = sorted(worker.live)[steps // a.preempt_every % len(worker.live)]
            worker.preempt(parked, save_kv=True)
    worker.close()
    os.close(fd)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
