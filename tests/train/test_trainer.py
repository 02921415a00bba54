"""The trainer: crash-safe checkpoints (SIGKILL mid-save and mid-run), identical losses after
resume, the sharded (gloo) run equal to one process with gradient accumulation."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from v4stack.train import checkpoint as ckpt
from v4stack.train.trainer import TrainConfig, train

from ..optim.distributed import free_port

SMALL = dict(preset="tiny", steps=5, batch_size=2, seq_len=32, ckpt_every=2, corpus_bytes=1 << 15,
             threads=1, progress=False, eval_batches=1, warmup=2)


def _run_in_subprocess(out: Path, env_extra: dict | None = None, wait: bool = True, **over):
    cfg = {**SMALL, **over, "out": str(out)}
    code = ("import json,sys; from v4stack.train.trainer import TrainConfig, train; "
            f"train(TrainConfig(**json.loads({json.dumps(json.dumps(cfg))})))")
    env = {**os.environ, **(env_extra or {})}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    if wait:
        _, err = proc.communicate(timeout=600)
        return proc.returncode, err.decode()
    return proc


def _losses(out: Path) -> list[tuple[int, float]]:
    doc = json.loads((out / "loss.json").read_text())
    return [(r["step"], r["loss"]) for r in doc["records"]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    train(TrainConfig(**SMALL, out=str(out)))
    return out


def test_sigkill_mid_save_resumes_with_identical_losses(reference, tmp_path):
    rc, _ = _run_in_subprocess(tmp_path, {ckpt.KILL_ENV: "4"})
    assert rc == -signal.SIGKILL
    root = tmp_path / "ckpt"
    assert (root / "step_000004.tmp" / "model.pt").exists()  # the half-written save
    assert not (root / "step_000004.tmp" / "meta.json").exists()
    assert (root / "latest").read_text().strip() == "step_000002"
    summary = train(TrainConfig(**SMALL, out=str(tmp_path)))
    assert summary["resumed_from"] == 2
    assert not (root / "step_000004.tmp").exists()
    assert _losses(tmp_path) == _losses(reference)
    a = torch.load(root / "step_000005" / "model.pt")["model"]
    b = torch.load(reference / "ckpt" / "step_000005" / "model.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "loss.png").stat().st_size > 1000


@pytest.mark.slow
def test_sigkill_at_any_moment_resumes_with_identical_losses(reference, tmp_path):
    proc = _run_in_subprocess(tmp_path, wait=False, ckpt_every=1)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (tmp_path / "ckpt" / "latest").exists() and "000003" in (tmp_path / "ckpt" / "latest").read_text():
            break
        time.sleep(0.05)
    time.sleep(0.3)  # somewhere inside step 4's compute or save
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    train(TrainConfig(**{**SMALL, "out": str(tmp_path), "ckpt_every": 1}))
    assert _losses(tmp_path) == _losses(reference)


def test_checkpoint_errors_name_the_problem(tmp_path):
    root = tmp_path / "ckpt"
    ckpt.write_shard(root, 3, 0, {"x": 1})
    ckpt.commit(root, 3, {"model": {}}, {"step": 3, "world": 2})
    with pytest.raises(RuntimeError, match="no optimizer shard for rank 1"):
        ckpt.load(ckpt.latest(root), 1)
    with pytest.raises(ValueError, match="'seq_len' must be >= 4"):
        TrainConfig(seq_len=2).validate()
    with pytest.raises(ValueError, match="'optimizer' must be one of"):
        TrainConfig(optimizer="sgd").validate()


def _dist_train(rank, world, port, out, over):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist

    try:
        train(TrainConfig(**{**SMALL, **over, "out": out}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_gloo_ranks_equal_one_process_with_accumulation(tmp_path):
    import torch.multiprocessing as mp

    one = tmp_path / "one"
    train(TrainConfig(**{**SMALL, "out": str(one), "grad_accum": 2, "steps": 3}))
    two = tmp_path / "two"
    mp.spawn(_dist_train, args=(2, free_port(), str(two), {"steps": 3, "stochastic_bf16": False}), nprocs=2)
    a = torch.load(one / "ckpt" / "step_000003" / "model.pt")["model"]
    b = torch.load(two / "ckpt" / "step_000003" / "model.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a), "sharded training drifted from one process"
    la, lb = _losses(one), _losses(two)
    assert [s for s, _ in la] == [s for s, _ in lb]
    assert all(abs(x - y) < 1e-5 for (_, x), (_, y) in zip(la, lb))
    assert (two / "ckpt" / "step_000003" / "optim.rank1.pt").exists()


@pytest.mark.slow
def test_tiny_training_goes_well_below_the_unigram_baseline(tmp_path):
    summary = train(TrainConfig(**{**SMALL, "out": str(tmp_path), "steps": 60, "batch_size": 4,
                                   "seq_len": 64, "ckpt_every": 60, "warmup": 10, "eval_batches": 4}))
    assert summary["val_loss"] < summary["unigram_nats"] - 0.5


def test_mtp_loss_is_logged_and_trains_the_mtp_block(tmp_path):
    from v4stack.config import preset
    from v4stack.model import V4Model

    init = V4Model(preset("tiny"), seed=0).state_dict()
    key = "mtp.0.enorm.weight"  # AdamW, no weight decay: it moves only if the MTP loss reaches it
    for weight in (0.0, 0.3):
        out = tmp_path / f"w{weight}"
        train(TrainConfig(**{**SMALL, "out": str(out), "steps": 2, "mtp_weight": weight}))
        doc = json.loads((out / "loss.json").read_text())
        trained = torch.load(out / "ckpt" / "step_000002" / "model.pt")["model"]
        if weight:
            assert all(0 < r["mtp_loss"] < 10 for r in doc["records"])
            assert not torch.equal(trained[key], init[key])
        else:
            assert all("mtp_loss" not in r for r in doc["records"])
            assert torch.equal(trained[key], init[key])
