"""Resuming an expert-parallel checkpoint under another ``ep`` and world: the experts' weights and
Muon momenta are re-cut to the new owners. A step-1 checkpoint of an EP2 run (two gloo ranks)
resumed as one process, and a step-1 checkpoint of one process resumed at EP2, give step 2's loss
and weights bit for bit equal to the uninterrupted one-process run (EP2 with one micro-batch per
rank accumulates in the same order as one process with two, so nothing is regrouped). Controls:
the same resume with the experts' momenta zeroed gives other expert weights (and the same dense
ones), and with the experts' optimizer state removed it stops with an error naming the entry.
Slow: EP2 x two replicas (four ranks) resumed at EP2 on two ranks, against the uninterrupted
four-rank run (the sums are regrouped there; bound below)."""

import shutil

import pytest
import torch
import torch.multiprocessing as mp

from v4stack.train.trainer import TrainConfig, train

from ..optim.distributed import free_port
from .test_expert_parallel import RUN, _losses, _ranks, _weights


def _edit_expert_state(d, fn) -> None:
    """Apply ``fn`` to every rank's saved expert optimizer state of the latest checkpoint in ``d``."""
    step = (d / "ckpt" / "latest").read_text().strip()
    for f in sorted((d / "ckpt" / step).glob("optim.rank*.pt")):
        shard = torch.load(f, weights_only=False)
        fn(shard["optim"]["expert_parallel"]["experts"])
        torch.save(shard, f)


def test_ep2_and_one_process_resume_each_other(tmp_path):
    one = tmp_path / "one"
    train(TrainConfig(**RUN, out=str(one), grad_accum=2))
    train(TrainConfig(**{**RUN, "steps": 1}, out=str(tmp_path / "one_to_ep2"), grad_accum=2))
    runs = [("ep2", 2, "all_to_all", True, {"steps": 1}), ("one_to_ep2", 2, "all_to_all", True, {})]
    mp.spawn(_ranks, args=(2, free_port(), str(tmp_path), runs), nprocs=2)
    for name in ("ep2_to_one", "zeroed", "dropped"):
        shutil.copytree(tmp_path / "ep2", tmp_path / name)
    train(TrainConfig(**RUN, out=str(tmp_path / "ep2_to_one"), grad_accum=2))

    want = _weights(one)
    for name in ("ep2_to_one", "one_to_ep2"):
        got = _weights(tmp_path / name)
        assert got.keys() == want.keys(), name
        assert all(torch.equal(got[k], want[k]) for k in want), name
        assert _losses(tmp_path / name) == _losses(one), name

    # control: the experts' momenta lost in the re-cut -> step 2 moves the experts elsewhere
    _edit_expert_state(tmp_path / "zeroed", lambda sd: [t.zero_() for k, t in sd["state"].items()
                                                        if k.startswith("muon.")])
    train(TrainConfig(**RUN, out=str(tmp_path / "zeroed"), grad_accum=2))
    got = _weights(tmp_path / "zeroed")
    assert all(torch.equal(got[k], want[k]) for k in want if ".experts." not in k)
    assert all(not torch.equal(got[k], want[k]) for k in want if ".experts." in k and k.endswith("w1.weight"))
    # control: the experts' optimizer state missing -> the resume refuses, naming what is missing
    _edit_expert_state(tmp_path / "dropped", lambda sd: sd["state"].clear())
    with pytest.raises(ValueError, match=r"no optimizer state 'muon\.layers\.\d+\.\S*experts\.\d+\.w\d\.weight'"):
        train(TrainConfig(**RUN, out=str(tmp_path / "dropped"), grad_accum=2))
