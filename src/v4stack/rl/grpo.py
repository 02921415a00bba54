"""The policy update: GRPO-style, with Muon (``optim.hybrid.MuonAdamW``) and the trainer's
crash-safe checkpoints (``train/checkpoint.py``).

For a batch of trajectories with group-normalised advantages ``A`` (computed from the metadata
table alone: ``(r - mean_group) / (std_group + eps)``), the loss over every *sampled* token
(observation tokens have mask 0) is

    ratio = exp(logp_new - logp_rollout)
    loss  = -mean_tokens( min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) )

where ``logp_rollout`` is the log-probability the rollout engine recorded in the token WAL.

Every step ends with a checkpoint whose meta names the trajectories it consumed. The loop writes
the CONSUMED marks into the rollout WALs only after that checkpoint is committed, and after a
restart it re-applies the marks named by the latest checkpoint; so a step either survives with its
marks, or is lost with its data still unconsumed and trained again - never twice, never lost.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from v4stack.config import preset as get_preset
from v4stack.model import V4Model
from v4stack.ops.mode import mode as ops_mode
from v4stack.optim.adamw import AdamWHyper
from v4stack.optim.hybrid import MuonAdamW
from v4stack.optim.muon import MuonHyper
from v4stack.train import checkpoint as ckpt


@dataclass
class GRPOConfig:
    clip: float = 0.2
    muon_lr: float = 0.003
    adamw_lr: float = 3e-4
    weight_decay: float = 0.0
    temperature: float = 1.0
    micro_batch: int = 32
    epochs: int = 2  # optimizer steps per batch (after the first the ratio and the clip are live)
    keep: int = 2

    def validate(self) -> "GRPOConfig":
        if not 0 < self.clip < 1:
            raise ValueError(f"grpo field 'clip' must be in (0, 1), got {self.clip}")
        if self.muon_lr <= 0 or self.adamw_lr <= 0 or self.temperature <= 0 or self.micro_batch < 1 or self.epochs < 1:
            raise ValueError("grpo fields 'muon_lr', 'adamw_lr', 'temperature' must be > 0, 'micro_batch' and "
                             "'epochs' >= 1")
        return self


def group_advantages(rewards: np.ndarray, groups: np.ndarray, eps: float = 1e-4) -> np.ndarray:
    """``(r - mean) / (std + eps)`` within each group id (a group of equal rewards gets 0)."""
    rewards = rewards.astype(np.float64)
    _, inv, counts = np.unique(groups, return_inverse=True, return_counts=True)
    mean = np.bincount(inv, rewards) / counts
    var = np.bincount(inv, (rewards - mean[inv]) ** 2) / counts
    return ((rewards - mean[inv]) / (np.sqrt(var[inv]) + eps)).astype(np.float32)


def pad_batch(heavy: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> tokens [B, T], rollout log-probs [B, T-1], loss mask [B, T-1] (position t predicts
    token t+1), and each row's length."""
    T = max(len(h["tokens"]) for h in heavy)
    B = len(heavy)
    tok = torch.zeros(B, T, dtype=torch.long)
    lp = torch.zeros(B, T - 1)
    mask = torch.zeros(B, T - 1)
    lens = torch.zeros(B, dtype=torch.long)
    for i, h in enumerate(heavy):
        n, p = len(h["tokens"]), h["prompt_len"]
        tok[i, :n] = torch.from_numpy(np.asarray(h["tokens"], dtype=np.int64))
        g = len(h["lp"])
        lp[i, p - 1 : p - 1 + g] = torch.from_numpy(np.nan_to_num(np.asarray(h["lp"], dtype=np.float32)))
        mask[i, p - 1 : p - 1 + g] = torch.from_numpy(np.asarray(h["mask"], dtype=np.float32))
        lens[i] = n
    return tok, lp, mask, lens


def grpo_loss(model: V4Model, heavy: list[dict], adv: torch.Tensor, clip: float, temperature: float = 1.0,
              n_tokens: float | None = None) -> tuple[torch.Tensor, dict]:
    tok, lp_old, mask, _ = pad_batch(heavy)
    logits = model(tok)[:, :-1].float() / temperature
    lp_new = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tok[:, 1:].reshape(-1),
                              reduction="none").view_as(mask)
    ratio = torch.exp((lp_new - lp_old) * mask)
    a = adv[:, None]
    obj = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    denom = n_tokens if n_tokens is not None else mask.sum().clamp(min=1)
    loss = -(obj * mask).sum() / denom
    with torch.no_grad():
        m = mask.bool()
        r = ratio[m]
        stats = {"ratio_mean": float(r.mean()) if r.numel() else 1.0,
                 "clipped": float(((r - 1).abs() > clip).float().mean()) if r.numel() else 0.0,
                 "kl_rollout": float((lp_old - lp_new)[m].mean()) if r.numel() else 0.0,
                 "tokens": int(m.sum())}
    return loss, stats


class PolicyTrainer:
    """One trainer process's policy: the model, its optimizer, and the step checkpoints. With
    ``world`` > 1 it is rank ``rank`` of a gloo group (``trainer_group.py``): it trains on every
    ``world``-th row of each batch, ZeRO (``optim.zero.ZeroMuonAdamW``) sums the ranks' gradients
    at the owners and gathers the updated weights, every rank writes its optimizer shard and rank 0
    commits the checkpoint. A checkpoint written by another number of processes is resharded."""

    def __init__(self, preset: str, out: str | Path, init: str | Path | None = None,
                 cfg: GRPOConfig | None = None, threads: int = 0, rank: int = 0, world: int = 1):
        if threads:
            torch.set_num_threads(threads)
        self.cfg = (cfg or GRPOConfig()).validate()
        self.rank, self.world = rank, world
        self.model = V4Model(get_preset(preset), seed=0)
        muon = MuonHyper(lr=self.cfg.muon_lr, weight_decay=self.cfg.weight_decay)
        adamw = AdamWHyper(lr=self.cfg.adamw_lr, weight_decay=self.cfg.weight_decay)
        if world > 1:  # ZeRO over the process group (gloo): owners hold the state, rounding off (exact sums)
            from v4stack.optim.zero import ZeroMuonAdamW

            self.opt = ZeroMuonAdamW(self.model, muon, adamw, zero_group_size=world, stochastic=False)
        else:
            self.opt = MuonAdamW(self.model, muon, adamw)
        self.root = Path(out) / "ckpt"
        self.step_no, self.meta = 0, {}
        found = ckpt.latest(self.root, clean=rank == 0)
        if found is not None:
            self.meta = json.loads((found / "meta.json").read_text())
            if int(self.meta.get("world", 1)) == world:
                model_state, optim_state, _ = ckpt.load(found, rank)
                self.opt.load_state_dict(optim_state["optim"])
            else:  # written by another number of trainer processes: merge the shards, take this rank's part
                from v4stack.optim.reshard import full_state, load_full_state

                shards = ckpt.load_all_optim(found, int(self.meta["world"]))
                load_full_state(self.opt, full_state([sh["optim"] for sh in shards]))
                model_state = ckpt.load_model(found)
            self.model.load_state_dict(model_state["model"])
            self.step_no = int(self.meta["step"])
        elif init is not None:
            self.model.load_state_dict(load_model_state(init))

    def weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def commit_empty(self, step_no: int, consumed: dict[str, list[str]], extra_meta: dict | None = None) -> dict:
        """A step with nothing to train on (every selected group had equal rewards): the checkpoint
        still names what it consumed, and the weights are unchanged."""
        return self._commit(step_no, consumed, extra_meta, {"loss": 0.0, "tokens": 0, "update_s": 0.0})

    def _commit(self, step_no: int, consumed: dict, extra_meta: dict | None, stats: dict) -> dict:
        if step_no != self.step_no + 1:
            raise ValueError(f"trainer step {step_no}: the last committed step is {self.step_no}")
        extra_meta = dict(extra_meta or {})
        fault = extra_meta.pop("fault", None)  # fault injection: SIGKILL this process before / after the commit
        if fault == "before_commit":
            os.kill(os.getpid(), signal.SIGKILL)
        t1 = time.perf_counter()
        meta = {"step": step_no, "world": self.world, "elapsed": 0.0, "records": [], "version": step_no,
                "consumed": consumed, **(extra_meta or {})}
        ckpt.write_shard(self.root, step_no, self.rank, {"optim": self.opt.state_dict()})
        if self.world > 1:
            dist.barrier()  # every shard is durable before rank 0 commits
        if self.rank == 0:
            ckpt.commit(self.root, step_no, {"model": self.model.state_dict()}, meta, self.cfg.keep)
        if self.world > 1:
            dist.barrier()
        self.step_no, self.meta = step_no, meta
        stats["ckpt_s"] = time.perf_counter() - t1
        if fault == "after_commit":
            os.kill(os.getpid(), signal.SIGKILL)
        return stats

    def step(self, step_no: int, heavy: list[dict], adv: np.ndarray, consumed: dict[str, list[str]],
             extra_meta: dict | None = None) -> dict:
        """One update on ``heavy`` (a batch's heavy fields) and ``adv``; commits checkpoint
        ``step_no`` naming ``consumed`` ({worker: [trajectory ids]}) before returning."""
        if step_no != self.step_no + 1:
            raise ValueError(f"trainer step {step_no}: the last committed step is {self.step_no}")
        t0 = time.perf_counter()
        adv_t = torch.as_tensor(adv, dtype=torch.float32)
        n_tok = float(sum(int(np.sum(h["mask"])) for h in heavy)) or 1.0  # the whole batch's tokens
        if self.world > 1:  # this rank's rows; the optimizer sums the ranks' gradients
            mine = list(range(self.rank, len(heavy), self.world))
            heavy, adv_t = [heavy[i] for i in mine], adv_t[mine]
        mb = self.cfg.micro_batch
        with ops_mode("fast"):
            self.model.train()
            for epoch in range(self.cfg.epochs):  # the stats reported are the last epoch's
                stats: dict = {"loss": 0.0, "tokens": 0, "ratio_mean": 0.0, "clipped": 0.0, "kl_rollout": 0.0,
                               "epochs": self.cfg.epochs}
                for i in range(0, len(heavy), mb):
                    loss, s = grpo_loss(self.model, heavy[i : i + mb], adv_t[i : i + mb], self.cfg.clip,
                                        self.cfg.temperature, n_tok)
                    loss.backward()
                    w = s["tokens"] / n_tok
                    stats["loss"] += float(loss.detach())
                    stats["tokens"] += s["tokens"]
                    for k in ("ratio_mean", "clipped", "kl_rollout"):
                        stats[k] += w * s[k]
                self.opt.step()
                self.opt.zero_grad()
        if self.world > 1:  # every rank reports the whole batch's numbers
            keys = ("loss", "tokens", "ratio_mean", "clipped", "kl_rollout")
            tot = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64)
            dist.all_reduce(tot)
            stats.update({k: float(v) for k, v in zip(keys, tot.tolist())}, tokens=int(tot[1]))
        stats["update_s"] = time.perf_counter() - t0
        if not all(math.isfinite(v) for v in (stats["loss"], stats["ratio_mean"])):
            raise FloatingPointError(f"grpo step {step_no}: non-finite loss or ratio {stats}")
        return self._commit(step_no, consumed, extra_meta, stats)


def load_model_state(path: str | Path) -> dict:
    """A model state dict from a trainer checkpoint directory, a run directory, or a model.pt."""
    p = Path(path)
    if p.is_dir() and (p / "ckpt").is_dir():
        p = p / "ckpt"
    if p.is_dir() and (p / "latest").exists():
        p = ckpt.latest(p, clean=False)
    if p.is_dir():
        p = p / "model.pt"
    sd = torch.load(p, map_location="cpu", weights_only=False)
    return sd["model"] if "model" in sd else sd
