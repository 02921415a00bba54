"""Command functions for `v4stack train` and `v4stack plan muon` (registered in v4stack.cli).

Typer reads the options from the signatures; torch and the model load only when a command runs.
"""

from __future__ import annotations

import json
from typing import List, Optional

import typer


def _model_config(preset: Optional[str], model: Optional[str]):
    from v4stack.config import ConfigError, ModelConfig, preset as get_preset

    try:
        return ModelConfig.load(model) if model else get_preset(preset or "flash")
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)


def muon_plan_command(
    preset: str = typer.Option("flash", help="Preset: tiny, flash or pro."),
    model: Optional[str] = typer.Option(None, help="A model directory (config.json) instead of a preset."),
    dp: Optional[int] = typer.Option(None, help="Data-parallel ranks per pipeline stage (default: the preset's deployment)."),
    pp: Optional[int] = typer.Option(None, help="Pipeline stages."),
    ep: Optional[int] = typer.Option(None, help="Expert-parallel shards inside the dp ranks."),
    cap: int = typer.Option(5, min=1, help="Most matrices one rank may own."),
    target: float = typer.Option(0.10, min=0.0, max=1.0, help="Padding the group-size search aims below."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Muon ownership plan of the real V4 matrix list: padding and matrices per rank."""
    from v4stack.optim.plan import PlanError, format_plan, plan_muon

    cfg = _model_config(preset, model)
    try:
        plan = plan_muon(cfg, dp, pp, ep, preset=None if model else preset, cap=cap, target=target)
    except PlanError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if as_json:
        typer.echo(json.dumps(plan, indent=2))
    else:
        typer.echo(format_plan(plan))


def train_command(
    preset: str = typer.Option("tiny", help="Model preset (tiny runs on a CPU)."),
    out: str = typer.Option("runs/tiny", help="Run directory: checkpoints, loss.json, loss.png."),
    data: Optional[List[str]] = typer.Option(None, help="Text files or directories (repeatable); none = generated corpus."),
    steps: int = typer.Option(300, min=1),
    batch_size: int = typer.Option(8, min=1, help="Sequences per micro-batch per rank."),
    seq_len: int = typer.Option(128, min=4),
    grad_accum: int = typer.Option(1, min=1, help="Micro-batches per optimizer step (pipeline micro-batches with --pp)."),
    pp: int = typer.Option(1, "--pp", min=1, help="Pipeline stages under torchrun (world = pp x dp; 1F1B)."),
    pp_schedule: str = typer.Option("1f1b", "--pp-schedule", help="Pipeline schedule: 1f1b or interleaved."),
    pp_virtual: int = typer.Option(1, "--pp-virtual", help="Model chunks per pipeline rank (interleaved: >= 2)."),
    ep: int = typer.Option(1, "--ep", min=1, help="Expert-parallel ranks inside the dp ranks (under torchrun, pp = 1)."),
    ep_backend: str = typer.Option("all_to_all", help="Expert-parallel backend: all_to_all or megamoe."),
    cp: int = typer.Option(1, "--cp", min=1, help="Context-parallel shards per sequence under torchrun (world = dp x cp)."),
    grad_chunks: int = typer.Option(0, "--grad-chunks", min=0, help="0: off. U: every gradient summed over U fixed "
                                    "chunks of each sequence in a fixed order, bitwise the same for one process and "
                                    "any --cp with U / 2cp a power of two (needs --ops invariant; slower)."),
    grad_order: str = typer.Option("batch", "--grad-order", help="batch: gradients summed in batch order. sample: "
                                   "each sequence's backward alone, added in the order of its corpus offset - the "
                                   "step's gradients are the same bits for any order of its sequences (pp, cp, ep 1; "
                                   "one backward per sequence)."),
    ops: str = typer.Option("fast", help="Ops mode: fast, or invariant (bitwise reproducible per row)."),
    recompute: str = typer.Option("none", help="Activation recompute: none, full, matmul, or plan:F (keep fraction F)."),
    optimizer: str = typer.Option("muon", help="muon (Muon + AdamW split) or adamw (AdamW only)."),
    muon_lr: float = typer.Option(0.02, min=0.0),
    adamw_lr: float = typer.Option(3e-3, min=0.0),
    weight_decay: float = typer.Option(0.01, min=0.0),
    warmup: int = typer.Option(20, min=0),
    mtp_weight: float = typer.Option(0.0, min=0.0, help="Weight of the MTP loss (0 = off)."),
    seed: int = typer.Option(0),
    ckpt_every: int = typer.Option(50, min=1),
    eval_every: int = typer.Option(0, min=0, help="Validation loss every N steps (0 = only at the end)."),
    stochastic_bf16: bool = typer.Option(True, help="Stochastic-BF16 gradients in the sharded step."),
    max_minutes: float = typer.Option(0.0, min=0.0, help="Stop (and checkpoint) after this long; 0 = no limit."),
    threads: int = typer.Option(0, min=0, help="torch threads (0 = default)."),
    device: str = typer.Option("cpu", help="cpu, or cuda for one process."),
    show_split: bool = typer.Option(False, help="Print which optimizer takes each parameter, then train."),
    progress: bool = typer.Option(True, help="Progress line on stderr."),
):
    """Train a preset on byte-level text; resumes from the run directory's last checkpoint."""
    from v4stack.train.trainer import TrainConfig, train

    cfg = TrainConfig(preset=preset, out=out, data=list(data or []), steps=steps, batch_size=batch_size,
                      seq_len=seq_len, grad_accum=grad_accum, pp=pp, pp_schedule=pp_schedule, pp_virtual=pp_virtual, ep=ep, ep_backend=ep_backend, cp=cp, grad_chunks=grad_chunks, grad_order=grad_order, ops=ops, recompute=recompute, optimizer=optimizer, muon_lr=muon_lr,
                      adamw_lr=adamw_lr, weight_decay=weight_decay, warmup=warmup, mtp_weight=mtp_weight,
                      seed=seed, ckpt_every=ckpt_every, eval_every=eval_every,
                      stochastic_bf16=stochastic_bf16, max_minutes=max_minutes, threads=threads,
                      device=device, progress=progress)
    try:
        cfg.validate()
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if show_split:
        print_split(preset, optimizer)
    try:
        summary = train(cfg)
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if summary:
        typer.echo(json.dumps(summary))


def print_split(preset: str, optimizer: str = "muon") -> None:
    """The Muon / AdamW split of a preset's parameters, one line each."""
    import torch

    from v4stack.config import preset as get_preset
    from v4stack.model import V4Model
    from v4stack.optim.split import split_params

    with torch.device("meta"):
        model = V4Model(get_preset(preset), seed=None)
    split = split_params((n, p.shape) for n, p in model.named_parameters())
    if optimizer == "adamw":
        typer.echo("optimizer=adamw: every parameter takes AdamW (baseline)")
    typer.echo(split.describe())
