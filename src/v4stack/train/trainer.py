"""The trainer: byte-level language modelling of a V4 preset on one process or under torchrun.

One process runs ``MuonAdamW``; under ``torchrun`` (``WORLD_SIZE`` > 1; gloo on CPU, NCCL with
``device="cuda"``, one GPU per rank) the ranks form a ``pp x dp`` mesh (``pp`` pipeline stages,
1F1B over the ``grad_accum`` micro-batches, ``train/pipeline.py``) and each stage's ``dp``
replicas run ``ZeroMuonAdamW`` over that stage's parameters: each replica computes gradients on
its own micro-batches, scaled by 1 / (dp * grad_accum), and the sharded step sums them on the
owners. A checkpoint resumes on another ``pp`` / ``dp`` / ``ep`` layout: weights are stored by
name (one file per stage or expert block) and the optimizer shards are merged and re-cut
(``optim/reshard.py``). The data order is a pure function of
(seed, step, micro-batch) and every piece of state that changes (weights, optimizer shards, the
stochastic-rounding generators, the loss log) is in the checkpoint, so a run killed at any moment
resumes from its last checkpoint and reproduces the same losses. With ``grad_order="sample"`` a
step's gradients do not depend on the order of its sequences (``train/sample_order.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from v4stack.config import preset as get_preset
from v4stack.model import V4Model
from v4stack.ops.mode import mode as ops_mode
from v4stack.optim.adamw import AdamWHyper
from v4stack.optim.hybrid import MuonAdamW
from v4stack.optim.muon import MuonHyper
from v4stack.optim.reshard import full_state, load_full_state
from v4stack.optim.zero import ZeroMuonAdamW
from v4stack.train import checkpoint as ckpt
from v4stack.train import expert_parallel
from v4stack.train.corpus import load_text, unigram_entropy
from v4stack.train.data import ByteBatches
from v4stack.train.log import LossLog, Progress, plot_curves
from v4stack.train.chunk_grads import ChunkGrads, check_units
from v4stack.train.context import cp_accumulate
from v4stack.train.unit_shard import chunked_accumulate
from v4stack.train.mesh import build_mesh
from v4stack.train.interleaved import SCHEDULES, build_stage
from v4stack.train.pipeline import first_last_groups, tie_embedding_grads
from v4stack.train.recompute import apply_recompute
from v4stack.train.sample_order import sample_accumulate

OPTIMIZERS = ("muon", "adamw")
EP_BACKENDS = ("all_to_all", "megamoe")
GRAD_ORDERS = ("batch", "sample")


@dataclass
class TrainConfig:
    preset: str = "tiny"
    out: str = "runs/tiny"
    data: list[str] = field(default_factory=list)  # files / directories; empty -> generated corpus
    corpus_bytes: int = 1 << 20
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    grad_accum: int = 1  # micro-batches per step and replica (the pipeline's micro-batches when pp > 1)
    pp: int = 1  # pipeline stages (under torchrun; the world is pp x dp)
    pp_schedule: str = "1f1b"  # or "interleaved": pp_virtual chunks per stage (train/interleaved.py)
    pp_virtual: int = 1  # model chunks per pipeline rank (interleaved: >= 2)
    ep: int = 1  # expert-parallel ranks inside the dp ranks (train/expert_parallel.py)
    cp: int = 1  # context-parallel shards per sequence (under torchrun, pp = 1; world = dp x cp)
    grad_chunks: int = 0  # 0 = off (default); U: chunk-ordered gradients, bitwise equal across cp (train/unit_shard.py)
    grad_order: str = "batch"  # "sample": gradients added in the sequences' key order (train/sample_order.py)
    ops: str = "fast"  # ops mode: fast, or invariant (row results independent of the batch)
    ep_backend: str = "all_to_all"  # all_to_all or megamoe
    recompute: str = "none"  # none, full, matmul (torch's selective policy) or plan:F (train/recompute.py)
    optimizer: str = "muon"  # "adamw": the AdamW-only baseline
    muon_lr: float = 0.02
    adamw_lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 20
    mtp_weight: float = 0.0  # 0 = MTP loss off
    seed: int = 0
    ckpt_every: int = 50
    keep: int = 2
    eval_every: int = 0
    eval_batches: int = 4
    stochastic_bf16: bool = True
    max_minutes: float = 0.0  # 0 = no wall-clock limit
    threads: int = 0  # 0 = torch default
    device: str = "cpu"  # "cuda": one GPU per rank (NCCL under torchrun)
    progress: bool = True

    def validate(self) -> "TrainConfig":
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        for name in ("steps", "batch_size", "grad_accum", "ckpt_every", "eval_batches", "corpus_bytes", "pp", "ep", "cp"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 1, f"train field '{name}' must be an integer >= 1, got {v!r}")
        need(self.seq_len >= 4, f"train field 'seq_len' must be >= 4, got {self.seq_len}")
        need(self.optimizer in OPTIMIZERS, f"train field 'optimizer' must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        need(self.muon_lr > 0 and self.adamw_lr > 0, "train fields 'muon_lr' and 'adamw_lr' must be > 0")
        need(self.weight_decay >= 0, f"train field 'weight_decay' must be >= 0, got {self.weight_decay}")
        need(self.warmup >= 0, f"train field 'warmup' must be >= 0, got {self.warmup}")
        need(self.mtp_weight >= 0, f"train field 'mtp_weight' must be >= 0 (0 = off), got {self.mtp_weight}")
        need(self.ep_backend in EP_BACKENDS,
             f"train field 'ep_backend' must be one of {EP_BACKENDS}, got {self.ep_backend!r}")
        need(self.ops in ("fast", "invariant"), f"train field 'ops' must be 'fast' or 'invariant', got {self.ops!r}")
        need(self.cp == 1 or (self.seq_len % (2 * self.cp) == 0 and not self.recompute.startswith("plan:")
                              and self.ep == 1),
             f"train field 'cp' ({self.cp}) needs seq_len a multiple of 2 x cp, recompute none, full or matmul "
             "(plan:F profiles the one-process forward), ep 1")
        need(isinstance(self.grad_chunks, int) and self.grad_chunks >= 0,
             f"train field 'grad_chunks' must be an integer >= 0 (0 = off), got {self.grad_chunks!r}")
        if self.grad_chunks:
            check_units(self.grad_chunks, self.seq_len, self.cp)
            need(self.ep == 1 and self.ops == "invariant" and not self.recompute.startswith("plan:")
                 and self.pp_schedule == "1f1b",
                 f"train field 'grad_chunks' ({self.grad_chunks}) runs with ep 1, ops invariant, recompute none, "
                 "full or matmul, and pp_schedule 1f1b")
        need(self.grad_order in GRAD_ORDERS,
             f"train field 'grad_order' must be one of {GRAD_ORDERS}, got {self.grad_order!r}")
        need(self.grad_order == "batch" or (self.pp == 1 and self.cp == 1 and self.ep == 1 and not self.grad_chunks
                                            and not self.recompute.startswith("plan:")),
             f"train field 'grad_order' ({self.grad_order!r}) runs with pp 1, cp 1, ep 1, grad_chunks 0 and "
             "recompute none, full or matmul")
        need(self.cp == 1 or self.pp_schedule == "1f1b",
             f"train field 'cp' ({self.cp}) runs with pp_schedule 1f1b, got {self.pp_schedule!r}")
        need(self.pp_schedule in SCHEDULES,
             f"train field 'pp_schedule' must be one of {SCHEDULES}, got {self.pp_schedule!r}")
        need(isinstance(self.pp_virtual, int) and (self.pp_virtual == 1 if self.pp_schedule == "1f1b"
                                                   else self.pp_virtual >= 2),
             f"train field 'pp_virtual' must be 1 with pp_schedule 1f1b and >= 2 with interleaved, "
             f"got {self.pp_virtual!r}")
        need(self.pp_schedule == "1f1b" or self.pp >= 2,
             f"train field 'pp' must be >= 2 for the interleaved schedule, got {self.pp}")
        need(self.pp_schedule == "1f1b" or self.grad_accum % self.pp == 0,
             f"train field 'grad_accum' ({self.grad_accum}) must be a multiple of pp ({self.pp}) "
             "for the interleaved schedule")
        need(self.device in ("cpu", "cuda"), f"train field 'device' must be 'cpu' or 'cuda', got {self.device!r}")
        need(self.recompute in ("none", "full", "matmul") or self.recompute.startswith("plan:"),
             f"train field 'recompute' must be none, full, matmul or plan:F, got {self.recompute!r}")
        need(self.eval_every >= 0 and self.max_minutes >= 0 and self.threads >= 0 and self.keep >= 1,
             "train fields 'eval_every', 'max_minutes', 'threads' must be >= 0 and 'keep' >= 1")
        return self


def lr_scale(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10% at the last step."""
    if cfg.warmup and step <= cfg.warmup:
        return step / cfg.warmup
    t = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def lm_losses(model: V4Model, tokens: torch.Tensor, mtp: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next-token cross entropy (nats/byte), and the MTP loss (token t+2) when asked."""
    V = model.cfg.vocab_size
    if not mtp:
        logits = model(tokens)
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1)), None
    logits, mtp_logits = model.forward_train(tokens)
    main = F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))
    if mtp_logits is None:
        return main, None
    extra = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, V), tokens[:, 2:].reshape(-1))
    return main, extra


@torch.no_grad()
def eval_loss(model: V4Model, batches: ByteBatches, n: int) -> float:
    dev = next(model.parameters()).device
    losses = [lm_losses(model, b.to(dev), mtp=False)[0].item() for b in batches.val_batches(n)]
    return sum(losses) / len(losses)


def _dist_setup(device: str) -> tuple[int, int, bool]:
    """(rank, world, whether this call created the process group): gloo on CPU, NCCL on CUDA."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    created = False
    if world > 1 and not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        created = True
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), created
    return 0, 1, created


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) a training run; returns the summary on rank 0 and {} elsewhere."""
    with ops_mode(cfg.ops):  # training keeps the model on its fast ops unless told otherwise
        return _train(cfg)


def _train(cfg: TrainConfig) -> dict:
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, world, created = _dist_setup(cfg.device)
    mesh = build_mesh(cfg.pp, cfg.cp)
    dp = mesh.dp
    mcfg = get_preset(cfg.preset)
    data, source = load_text(cfg.data, cfg.corpus_bytes, cfg.seed)
    batches = ByteBatches(data, cfg.seq_len, cfg.batch_size, cfg.seed)
    unigram = unigram_entropy(bytes(batches.train.to(torch.uint8).tolist()))
    model = V4Model(mcfg, seed=cfg.seed)
    dev = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    model.to(dev)
    use_mtp = cfg.mtp_weight > 0
    out = Path(cfg.out)
    root = out / "ckpt"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    _barrier(world)
    found = ckpt.latest(root, clean=rank == 0)
    _barrier(world)
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * dp
    meta = {"config": dataclasses.asdict(cfg), "world": world, "pp": mesh.pp, "dp": dp, "cp": mesh.cp, "source": source,
            "unigram_nats": unigram, "tokens_per_step": tokens_per_step,
            "params": sum(p.numel() for p in model.parameters())}
    log = LossLog(out / "loss.json", meta)
    start, elapsed0 = 0, 0.0
    cmeta = None
    if found is not None:  # weights by name, before the stage drops what it does not hold
        cmeta = json.loads((found / "meta.json").read_text())
        model.load_state_dict(ckpt.load_model(found)["model"])
    stage, run_pp = build_stage(model, mesh, use_mtp, cfg.pp_schedule, cfg.pp_virtual) if mesh.pp > 1 else (None, None)
    if stage is not None:
        params = {n: p for n, p in model.named_parameters() if n in set(stage.param_names())}
        stage.release_others()
    else:
        params = dict(model.named_parameters())
    tie_group = first_last_groups(mesh) if stage is not None else None
    ep = expert_parallel.setup(model, cfg.ep, cfg.ep_backend, mesh, dev, cfg.batch_size * cfg.seq_len)
    if ep is not None:
        params = {n: p for n, p in params.items() if not ep.is_expert(n) or ep.owns(n)}
    if cfg.recompute != "none":
        sample = batches.batch(0, 0).to(dev)
        if cfg.recompute.startswith("plan:") and stage is not None:
            raise ValueError("train field 'recompute': plan:F profiles the whole model; use it with pp = 1")
        apply_recompute(model, cfg.recompute, (sample,), stage.layers if stage is not None else None)
    opt = _optimizer(cfg, params, mesh, ep)
    chunks = ChunkGrads(params, cfg.grad_chunks) if cfg.grad_chunks else None
    if stage is not None and chunks is not None:
        stage.chunk_grads, chunks = chunks, None  # the pipeline runs them per micro-batch
        if stage.mtp and (mesh.first or mesh.last) and "embed.weight" in params:
            stage.chunk_grads.deferred = ("embed.weight",)  # two copies: tied after the step
    if cmeta is not None:
        same = ((cmeta["world"], cmeta.get("pp", 1), cmeta.get("cp", 1), cmeta.get("pp_virtual", 1),
                 cmeta.get("ep", 1)) == (world, mesh.pp, mesh.cp, stage.virtual if stage is not None else 1, cfg.ep))
        if same:
            optim_state = _to_device(ckpt.load(found, rank)[1], dev)
            opt.load_state_dict(optim_state["optim"])
            torch.set_rng_state(optim_state["rng"].cpu())
        else:  # another layout: merge every old shard, take this rank's part
            shards = ckpt.load_all_optim(found, cmeta["world"])
            load_full_state(opt, _to_device(full_state([sh["optim"] for sh in shards]), dev))
            torch.set_rng_state(shards[min(rank, len(shards) - 1)]["rng"].cpu())
            if rank == 0 and cfg.progress:
                print(f"resharded checkpoint {found.name}: pp {cmeta.get('pp', 1)} x dp "
                      f"{cmeta.get('dp', cmeta['world'])} (ep {cmeta.get('ep', 1)}) -> pp {mesh.pp} x dp {dp} "
                      f"(ep {cfg.ep})", flush=True)
        start, elapsed0 = cmeta["step"], cmeta["elapsed"]
        log.records = cmeta["records"]
        log.truncate(start)
    if rank == 0 and cfg.progress and start == 0:
        print(opt.split.describe().splitlines()[-1], flush=True)
    progress = Progress(cfg.steps, start) if (rank == 0 and cfg.progress) else None
    t0 = time.perf_counter() - elapsed0
    step = start
    for step in range(start + 1, cfg.steps + 1):
        ts = time.perf_counter()
        starts = [batches.starts(step, mesh.replica * cfg.grad_accum + m) for m in range(cfg.grad_accum)]
        micro = [batches.at(s).to(dev) for s in starts]
        scale = 1.0 / (cfg.grad_accum * dp)
        if stage is not None:
            sums = run_pp(stage, micro, cfg.mtp_weight, scale)
            tie_embedding_grads(stage, tie_group)
        elif chunks is not None:
            sums = chunked_accumulate(model, chunks, micro, scale, mesh, cfg.mtp_weight)
        elif cfg.grad_order == "sample":
            sums = sample_accumulate(model, micro, [s.tolist() for s in starts],
                                     1.0 / (cfg.batch_size * cfg.grad_accum * dp), lm_losses, cfg.mtp_weight)
        elif mesh.cp > 1:
            sums = cp_accumulate(model, micro, scale, mesh, cfg.mtp_weight)
        else:
            sums = torch.zeros(2, device=dev)
            for tokens in micro:
                main, extra = lm_losses(model, tokens, use_mtp)
                total = main if extra is None else main + cfg.mtp_weight * extra
                (total * scale).backward()
                sums[0] += main.item()
                sums[1] += 0.0 if extra is None else extra.item()
        if world > 1:
            dist.all_reduce(sums)  # only the last stage's ranks hold losses
        sums /= cfg.grad_accum * dp
        opt.step(lr_scale=lr_scale(step, cfg))
        opt.zero_grad()
        now = time.perf_counter()
        rec = {"step": step, "loss": round(float(sums[0]), 6), "lr_scale": round(lr_scale(step, cfg), 6),
               "tokens": step * tokens_per_step, "elapsed_s": round(now - t0, 3)}
        if use_mtp:
            rec["mtp_loss"] = round(float(sums[1]), 6)
        if cfg.eval_every and step % cfg.eval_every == 0 and (rank == 0 or ep is not None) and stage is None:
            rec["val_loss"] = round(eval_loss(model, batches, cfg.eval_batches), 6)
        log.add(**rec)
        if progress:
            progress.update(step, rec["loss"], tokens_per_step / max(now - ts, 1e-9))
        stop = torch.tensor([float(cfg.max_minutes > 0 and now - t0 > 60 * cfg.max_minutes)], device=dev)
        if world > 1:
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if step % cfg.ckpt_every == 0 or step == cfg.steps or stop.item():
            _save(root, step, mesh, stage, model, opt, log, now - t0, cfg.keep, ep)
        if stop.item():
            break
    summary = {}
    # with expert parallelism every rank takes part in the evaluation (the exchange is collective)
    final_val = eval_loss(model, batches, cfg.eval_batches) if stage is None and (rank == 0 or ep) else None
    if rank == 0:
        tail = [r["loss"] for r in log.records[-10:]]
        summary = {"steps": step, "final_loss": sum(tail) / max(len(tail), 1), "val_loss": final_val,
                   "unigram_nats": unigram, "tokens": step * tokens_per_step,
                   "elapsed_s": log.records[-1]["elapsed_s"] if log.records else 0.0,
                   "resumed_from": start, "optimizer": cfg.optimizer, "world": world}
        log.meta["summary"] = summary
        log.save()
        curve = {cfg.optimizer: [(r["step"], r["loss"]) for r in log.records]}
        vals = [(r["step"], r["val_loss"]) for r in log.records if "val_loss" in r]
        if vals:
            curve["val"] = vals
        plot_curves(curve, out / "loss.png", f"v4stack train --preset {cfg.preset}", baseline=unigram)
    _barrier(world)
    if created:
        dist.destroy_process_group()
    return summary


def _to_device(obj, dev: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(dev) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _to_device(v, dev) for k, v in obj.items()}
    return obj


def _optimizer(cfg: TrainConfig, params: dict, mesh, ep=None):
    muon_hp = MuonHyper(lr=cfg.muon_lr, weight_decay=cfg.weight_decay)
    adamw_hp = AdamWHyper(lr=cfg.adamw_lr, weight_decay=cfg.weight_decay)
    if ep is not None:
        if cfg.optimizer != "muon":
            raise ValueError("train field 'optimizer': expert parallelism runs the sharded Muon step")
        return expert_parallel.optimizer(params, ep, muon_hp, adamw_hp, stochastic=cfg.stochastic_bf16, seed=cfg.seed)
    if mesh.dp * mesh.cp == 1:
        return MuonAdamW(params, muon_hp, adamw_hp, use_muon=cfg.optimizer == "muon")
    if cfg.optimizer != "muon":
        raise ValueError("train field 'optimizer': the sharded step runs Muon; use one replica for 'adamw'")
    sub = dict(group=mesh.dp_group, group_ranks=mesh.dp_ranks) if mesh.pp > 1 else {}
    return ZeroMuonAdamW(params, muon_hp, adamw_hp, stochastic=cfg.stochastic_bf16, seed=cfg.seed, **sub)


def _save(root: Path, step: int, mesh, stage, model, opt, log: LossLog, elapsed: float, keep: int, ep=None) -> None:
    ckpt.write_shard(root, step, mesh.rank, {"optim": opt.state_dict(), "rng": torch.get_rng_state()})
    if ep is not None:  # each rank of the first EP group: its experts; rank 0 below: the dense weights
        ep.save_part(root, step, model)
    if stage is not None and mesh.replica == 0 and mesh.cp_rank == 0:  # each stage's weights, by name
        ckpt.write_model_part(root, step, f"stage{mesh.stage}", {"model": stage.state()})
    _barrier(mesh.world)
    if mesh.rank == 0:
        meta = {"step": step, "world": mesh.world, "pp": mesh.pp, "dp": mesh.dp, "cp": mesh.cp, "elapsed": elapsed,
                "records": log.records, **({"ep": ep.ep} if ep is not None else {}),
                **({"pp_virtual": stage.virtual} if stage is not None and stage.virtual > 1 else {})}
        state = model.state_dict() if ep is None else ep.dense_state(model)
        ckpt.commit(root, step, {"model": state} if stage is None else None, meta, keep)
        log.save()
    _barrier(mesh.world)
