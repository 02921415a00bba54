"""The trainer as several processes: rank 0 in the calling process (the trainer actor), ranks
1..world-1 launched by it, torchrun-style (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), joined in one gloo group.

Rank 0 is the only one the loop talks to. For every command (a step, an empty commit) it
broadcasts the command with the batch's heavy fields (``broadcast_object_list``) and then runs it
itself; the followers run the same command on their rows. ZeRO sums the gradients at their
owners and gathers the new weights, so every rank ends each step with the same model; every rank
writes its optimizer shard and rank 0 commits the checkpoint. The followers die with rank 0's
process (parent-death signal): a SIGKILLed trainer actor takes its whole group down, and its
restart launches a new group that resumes from the latest checkpoint.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist

TIMEOUT = timedelta(seconds=600)


def _die_with_parent() -> None:  # in the child between fork and exec
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrainerGroup:
    """Rank 0 of ``world`` trainer processes (``world`` >= 2) on this host."""

    def __init__(self, world: int, preset: str, out: str, init: str | None, grpo: dict, threads: int):
        from v4stack.rl.grpo import GRPOConfig, PolicyTrainer

        if world < 2:
            raise ValueError(f"trainer field 'procs': a group needs >= 2 processes, got {world}")
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group")
        port = _free_port()
        args = json.dumps({"preset": preset, "out": out, "init": init, "grpo": grpo, "threads": threads})
        self.procs = []
        for rank in range(1, world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port)}
            self.procs.append(subprocess.Popen([sys.executable, "-m", "v4stack.rl.trainer_group", args], env=env,
                                               preexec_fn=_die_with_parent))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
                                timeout=TIMEOUT)
        self.world = world
        self.t = PolicyTrainer(preset, out, init, GRPOConfig(**grpo), threads=threads, rank=0, world=world)
        self._send(("ready", self.t.step_no))

    @staticmethod
    def _send(cmd: tuple) -> None:
        dist.broadcast_object_list([cmd], src=0)

    @property
    def step_no(self) -> int:
        return self.t.step_no

    @property
    def meta(self) -> dict:
        return self.t.meta

    def weights(self) -> dict:
        return self.t.weights()

    def step(self, step_no: int, heavy: list, adv, consumed: dict, extra: dict | None = None) -> dict:
        shared = {k: v for k, v in (extra or {}).items() if k != "fault"}  # faults are rank 0's alone
        self._send(("step", step_no, heavy, adv, consumed, shared))
        return self.t.step(step_no, heavy, adv, consumed, extra)

    def commit_empty(self, step_no: int, consumed: dict, extra: dict | None = None) -> dict:
        shared = {k: v for k, v in (extra or {}).items() if k != "fault"}
        self._send(("empty", step_no, consumed, shared))
        return self.t.commit_empty(step_no, consumed, extra)

    def close(self) -> None:
        self._send(("stop",))
        for p in self.procs:
            p.wait(60)
        dist.destroy_process_group()


def follower() -> None:
    """Ranks 1..world-1: build the same trainer, then run rank 0's commands until 'stop'."""
    from v4stack.rl.grpo import GRPOConfig, PolicyTrainer

    a = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=TIMEOUT)
    t = PolicyTrainer(a["preset"], a["out"], a["init"], GRPOConfig(**a["grpo"]), threads=a["threads"], rank=rank,
                      world=world)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        cmd = box[0]
        if cmd[0] == "ready":
            if cmd[1] != t.step_no:
                raise RuntimeError(f"trainer rank {rank} resumed at step {t.step_no}, rank 0 at {cmd[1]}")
        elif cmd[0] == "step":
            t.step(*cmd[1:])
        elif cmd[0] == "empty":
            t.commit_empty(*cmd[1:])
        elif cmd[0] == "stop":
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    follower()
