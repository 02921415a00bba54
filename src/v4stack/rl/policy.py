"""The starting policy: the tiny preset taught by the trainer on task demonstrations.

``ensure_sft`` writes the demonstration corpus (training-split episodes only, ``tasks.py``), runs
the ordinary trainer on it (``train/trainer.py``: Muon, crash-safe checkpoints, resumable) and
returns the run directory. The run is keyed by its settings (not its wall-clock cap), so later loops reuse the
checkpoint; a run that was interrupted resumes from its last checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from v4stack.atomic import atomic_write


@dataclass
class SFTConfig:
    preset: str = "tiny"
    steps: int = 600
    batch_size: int = 16
    seq_len: int = 64
    corpus_bytes: int = 1 << 20
    minutes: float = 15.0  # a cap for a loaded machine; 600 steps take a few minutes on 2 quiet cores
    seed: int = 0
    threads: int = 0

    def key(self) -> str:
        from v4stack.rl.tasks import VERSION

        d = asdict(self)
        d.pop("threads")
        d.pop("minutes")  # a wall-clock cap, not a setting of the result
        d["tasks"] = VERSION
        return hashlib.blake2b(json.dumps(d, sort_keys=True).encode(), digest_size=5).hexdigest()


def sft_dir(root: str | Path, cfg: SFTConfig) -> Path:
    return Path(root) / f"sft-{cfg.preset}-{cfg.key()}"


def sft_done(run: Path) -> dict | None:
    p = run / "loss.json"
    if not p.exists():
        return None
    summary = json.loads(p.read_text()).get("meta", {}).get("summary")
    return summary if summary and (run / "ckpt" / "latest").exists() else None


def ensure_sft(root: str | Path, cfg: SFTConfig, progress: bool = True) -> tuple[Path, dict]:
    """-> (the supervised run's directory, its summary); trains only when no finished run exists."""
    from v4stack.rl import tasks as T
    from v4stack.train.trainer import TrainConfig, train

    run = sft_dir(root, cfg)
    done = sft_done(run)
    if done is not None:
        return run, {**done, "reused": True}
    run.mkdir(parents=True, exist_ok=True)
    corpus = run / "demonstrations.txt"
    if not corpus.exists():
        atomic_write(corpus, T.demonstrations(cfg.corpus_bytes, cfg.seed).encode())
    tc = TrainConfig(preset=cfg.preset, out=str(run), data=[str(corpus)], steps=cfg.steps,
                     batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed, ckpt_every=25,
                     max_minutes=cfg.minutes, threads=cfg.threads, warmup=20, progress=progress)
    summary = train(tc)
    return run, {**summary, "reused": False}
