"""The trainer as two processes (gloo, ZeRO): the same update as one process, checkpoints with one
optimizer shard per rank, and a resume on another process count."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import torch

from tests.rl.test_grpo import _heavy
from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.rl.grpo import GRPOConfig, PolicyTrainer
from v4stack.rl.trainer_group import TrainerGroup

CFG = GRPOConfig(keep=0, muon_lr=0.01)


def _batch(n=4):
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (12,), generator=g).tolist() for _ in range(n)]
    heavy = _heavy(V4Model(preset("tiny"), seed=0), seqs)
    adv = np.array([1.0, -1.0, 0.5, -0.5][:n], np.float32)
    return heavy, adv, {"w0": [f"t{i}" for i in range(n)]}


def _diff(a: dict, b: dict) -> float:
    """L2 distance between two weight sets (AdamW's first step is nearly sign(g) * lr, so a max-abs
    distance is dominated by gradients near zero whose sign the summation order can flip)."""
    return sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a) ** 0.5


def test_two_trainer_processes_take_the_one_process_step(tmp_path):
    heavy, adv, consumed = _batch()
    one = PolicyTrainer("tiny", tmp_path / "one", cfg=CFG, threads=1)
    start = one.weights()
    one.step(1, heavy, adv, consumed)
    group = TrainerGroup(2, "tiny", str(tmp_path / "two"), None, dataclasses.asdict(CFG), 1)
    try:
        stats = group.step(1, heavy, adv, consumed)
        w2 = group.weights()
        moved = _diff(one.weights(), start)
        assert moved > 1e-3
        print(f"one step: moved {moved:.4g}, group vs one process {_diff(w2, one.weights()):.3g}")
        assert _diff(w2, one.weights()) < 0.05 * moved, (_diff(w2, one.weights()), moved)
        assert stats["tokens"] == sum(int(h["mask"].sum()) for h in heavy)  # both ranks' tokens reported
        d = tmp_path / "two" / "ckpt" / "step_000001"
        assert sorted(p.name for p in d.glob("optim.rank*.pt")) == ["optim.rank0.pt", "optim.rank1.pt"]
        assert json.loads((d / "meta.json").read_text())["world"] == 2
        # inverse control: one process trained on rank 0's rows alone lands elsewhere
        half = PolicyTrainer("tiny", tmp_path / "half", cfg=CFG, threads=1)
        half.step(1, heavy[0::2], adv[0::2], consumed)
        print(f"inverse control (rank 0's rows alone) vs group {_diff(half.weights(), w2):.3g}")
        assert _diff(half.weights(), w2) > 10 * _diff(w2, one.weights())
        # a second step: the group's sharded optimizer state against one process resumed from the
        # group's checkpoint (shards merged) - the momentum carried over
        resumed = PolicyTrainer("tiny", tmp_path / "two", cfg=CFG, threads=1)
        assert resumed.step_no == 1 and _diff(resumed.weights(), w2) == 0.0
        heavy2, adv2, consumed2 = _batch()
        adv2 = -adv2
        group.step(2, heavy2, adv2, consumed2)
        resumed.root = tmp_path / "resumed" / "ckpt"
        resumed.step(2, heavy2, adv2, consumed2)
        step2 = _diff(group.weights(), w2)
        print(f"second step: moved {step2:.4g}, group vs resumed one process {_diff(group.weights(), resumed.weights()):.3g}")
        assert _diff(group.weights(), resumed.weights()) < 0.05 * step2
    finally:
        group.close()
