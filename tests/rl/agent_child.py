"""A rollout process that SIGKILLs itself right after a sandbox ran its first tool call and before
the observation is logged (run by test_agent.py)."""

from __future__ import annotations

import os
import signal
import sys

import torch

from tests.rl.test_agent import ONE_BYTE_TURNS, build, parse

torch.set_num_threads(1)

url, token, wal_dir = sys.argv[1:4]


class DieAfterRun:
    def __init__(self, inner):
        self.inner = inner

    def reserve(self):
        return self.inner.reserve()

    def run(self, h, seq, cmd):
        out = self.inner.run(h, seq, cmd)  # the sandbox ran it and logged the result
        print(f"RAN {out[0]!r}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def replay(self, *a):
        return self.inner.replay(*a)


w, tools = build(url, token, wal_dir, wrap=DieAfterRun)
w.submit("t0", list(b"x\n$ "), ONE_BYTE_TURNS, group="g")
w.run()
