"""Checkpoints that a crash cannot half-write.

Layout under the run directory::

    ckpt/step_000120/   model.pt, optim.rank{r}.pt (one per rank), meta.json (written last)
    ckpt/latest         the name of the newest complete checkpoint

A save writes every file into ``step_N.tmp`` (each file written, flushed and fsynced), renames the
directory to ``step_N`` (atomic), fsyncs the parent, then replaces ``latest`` atomically. A crash
before the directory rename leaves only a ``.tmp`` directory, which resume ignores and removes; a
crash after it leaves ``latest`` on the previous checkpoint or on this complete one. Old
checkpoints beyond ``keep`` are removed after ``latest`` moves.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
from pathlib import Path

import torch

from v4stack.atomic import atomic_write

KILL_ENV = "V4STACK_KILL_DURING_SAVE"  # fault injection for the crash tests: "<step>"


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def write_shard(root: Path, step: int, rank: int, optim_state: dict) -> None:
    """Every rank: its optimizer shard into the step's temp directory."""
    tmp = step_dir(root, step).with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    _fsync_write(tmp / f"optim.rank{rank}.pt", _torch_bytes(optim_state))


def write_model_part(root: Path, step: int, part: str, model_state: dict) -> None:
    """A pipeline stage's weights (``{"model": {name: tensor}}``) into the step's temp directory."""
    tmp = step_dir(root, step).with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    _fsync_write(tmp / f"model.{part}.pt", _torch_bytes(model_state))


def commit(root: Path, step: int, model_state: dict | None, meta: dict, keep: int = 2) -> Path:
    """Rank 0, after every rank's shard (and every stage's weights) is written: model (unless the
    stages wrote theirs), meta, rename, then ``latest``."""
    final = step_dir(root, step)
    tmp = final.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    if model_state is not None:
        _fsync_write(tmp / "model.pt", _torch_bytes(model_state))
    if os.environ.get(KILL_ENV) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)  # the crash tests stop here, mid-save
    _fsync_write(tmp / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    atomic_write(root / "latest", (final.name + "\n").encode())
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and p.suffix != ".tmp")
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(root: Path, clean: bool = True) -> Path | None:
    """The newest complete checkpoint, or None. ``clean`` removes stale temp directories."""
    if not root.exists():
        return None
    for tmp in root.glob("step_*.tmp") if clean else []:
        shutil.rmtree(tmp, ignore_errors=True)
    ptr = root / "latest"
    if not ptr.exists():
        return None
    d = root / ptr.read_text().strip()
    if not (d / "meta.json").exists() or not any(d.glob("model*.pt")):
        raise RuntimeError(f"checkpoint {d} named by {ptr} is incomplete")
    return d


def load_model(d: Path) -> dict:
    """``{"model": state}`` of checkpoint ``d``, merging the pipeline stages' parts when there are any."""
    merged: dict = {}
    for f in sorted(d.glob("model*.pt")):
        merged.update(torch.load(f, map_location="cpu", weights_only=False)["model"])
    return {"model": merged}


def load_all_optim(d: Path, world: int) -> list[dict]:
    """Every rank's optimizer shard of checkpoint ``d`` (written by ``world`` ranks), in rank order."""
    out = []
    for r in range(world):
        f = d / f"optim.rank{r}.pt"
        if not f.exists():
            raise RuntimeError(f"checkpoint {d} lacks the optimizer shard of rank {r} of {world}")
        out.append(torch.load(f, map_location="cpu", weights_only=False))
    return out


def load(d: Path, rank: int) -> tuple[dict, dict, dict]:
    """(model state, this rank's optimizer state, meta) of checkpoint directory ``d``."""
    meta = json.loads((d / "meta.json").read_text())
    model_state = load_model(d)
    shard = d / f"optim.rank{rank}.pt"
    if not shard.exists():
        raise RuntimeError(f"checkpoint {d} has no optimizer shard for rank {rank} "
                           f"(written by {meta.get('world', '?')} ranks)")
    optim_state = torch.load(shard, map_location="cpu", weights_only=False)
    return model_state, optim_state, meta
