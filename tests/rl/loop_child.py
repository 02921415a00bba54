"""A loop driver (in-process fleet) that SIGKILLs itself at one point of step K's consumption
protocol, for test_faults.py:

    python -m tests.rl.loop_child OUT POLICY STEPS PROTOCOL KILL K

PROTOCOL ``commit_then_mark`` is the loop's own: the trainer commits checkpoint K naming the batch,
then the CONSUMED marks are written. ``mark_then_commit`` is the broken order (the inverse
control): the marks are made durable before the update is committed. KILL ``in_step`` dies when
the trainer is handed step K (in the broken order: after the marks), ``after_commit`` right after
the trainer committed step K (before the loop's marks); ``none`` runs to the end.
"""

from __future__ import annotations

import os
import signal
import sys

from tests.rl.conftest import QUICK_SFT
from v4stack.rl.grpo import GRPOConfig
from v4stack.rl.loop import Loop, LoopConfig

out, policy, steps, protocol, kill, k = sys.argv[1:7]
steps, k = int(steps), int(k)
assert protocol in ("commit_then_mark", "mark_then_commit") and kill in ("in_step", "after_commit", "none")

cfg = LoopConfig(out=out, policy=policy, ray=False, workers=2, groups=2, group_size=2, steps=steps, minutes=0,
                 eval_n=2, max_tokens=16, progress=False, sft=QUICK_SFT, grpo=GRPOConfig(keep=0))
loop = Loop(cfg)
orig_train = None


def train(method, *args):
    if method != "step":
        return orig_train(method, *args)
    step_no, consumed = args[0], args[3]
    if protocol == "mark_then_commit":
        for w, trajs in consumed.items():
            loop.fleet.call(w, "consume", trajs, step_no)
    if step_no == k and kill == "in_step":
        os.kill(os.getpid(), signal.SIGKILL)
    res = orig_train(method, *args)
    if step_no == k and kill == "after_commit":
        os.kill(os.getpid(), signal.SIGKILL)
    return res


_start = loop.start


def start():
    global orig_train
    _start()
    orig_train = loop.fleet.train
    loop.fleet.train = train


loop.start = start
try:
    summary = loop.run()
    print("STEPS", summary["steps"], flush=True)
finally:
    loop.close()
