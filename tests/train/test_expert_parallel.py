"""The trainer with expert parallelism (two gloo ranks, ``ep = 2``, both backends): each rank holds
only its half of every layer's routed experts, and two steps give the same losses and the same
weights, bit for bit, as one process accumulating the same two micro-batches. Control: with the
backend's layer order (each expert's rows from both ranks in one batch) the weights differ."""

import json
import os
import re

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from v4stack.train import checkpoint as ckpt
from v4stack.train import expert_parallel
from v4stack.train.trainer import TrainConfig, train

from ..optim.distributed import free_port

RUN = dict(preset="tiny", steps=2, batch_size=2, seq_len=16, ckpt_every=2, corpus_bytes=1 << 14, threads=1,
           progress=False, eval_batches=1, warmup=1, mtp_weight=0.3, stochastic_bf16=False)


def _losses(out) -> list:
    return [(r["step"], r["loss"], r["mtp_loss"]) for r in json.loads((out / "loss.json").read_text())["records"]]


def _weights(out) -> dict:
    return ckpt.load_model(ckpt.latest(out / "ckpt", clean=False))["model"]


def _ranks(rank, world, port, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo")
    try:
        for name, backend, order in (("a2a", "all_to_all", True), ("mega", "megamoe", True),
                                     ("control", "all_to_all", False)):
            expert_parallel.SOURCE_ORDER = order
            train(TrainConfig(**RUN, out=f"{root}/{name}", ep=2, ep_backend=backend))
            held = torch.load(f"{root}/{name}/ckpt/step_000002/model.experts{rank}.pt")["model"]
            blocks = {int(re.search(r"\.experts\.(\d+)\.", n).group(1)) // 4 for n in held}
            assert held and blocks == {rank}  # this rank wrote (and held) only its block of experts
    finally:
        dist.destroy_process_group()


def test_ep2_step_equals_one_process_accumulating(tmp_path):
    one = tmp_path / "one"
    train(TrainConfig(**RUN, out=str(one), grad_accum=2))
    mp.spawn(_ranks, args=(2, free_port(), str(tmp_path)), nprocs=2)
    want = _weights(one)
    for name in ("a2a", "mega"):
        got = _weights(tmp_path / name)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), name
        assert _losses(tmp_path / name) == _losses(one), name
    control = _weights(tmp_path / "control")
    assert any(not torch.equal(control[k], want[k]) for k in want if ".experts." in k)


def test_bad_expert_parallel_settings_name_the_field(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="'ep_backend' must be one of"):
        TrainConfig(ep_backend="nccl").validate()
    with pytest.raises(ValueError, match="'ep' must be an integer >= 1"):
        TrainConfig(ep=0).validate()
    with pytest.raises(ValueError, match="'ep' must divide the data-parallel ranks"):  # one process: dp = 1
        train(TrainConfig(**RUN, out=str(tmp_path), ep=2))
