"""``v4stack loop``: the closed loop (registered in v4stack.cli; torch and Ray load when it runs)."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer


def loop_command(
    preset: str = typer.Option("tiny", help="Model preset (tiny runs on a CPU)."),
    minutes: float = typer.Option(5.0, min=0.0, help="Wall-clock budget of the RL steps (0 = --steps only)."),
    steps: int = typer.Option(0, min=0, help="Stop after this many GRPO steps (0 = as many as --minutes allow)."),
    out: str = typer.Option("runs/loop", help="Run directory: policy/, trainer/, rollouts/, loop.json, loop.png."),
    workers: int = typer.Option(2, min=1, help="Rollout workers (Ray actors)."),
    groups: int = typer.Option(4, min=1, help="Training questions per step."),
    group_size: int = typer.Option(8, min=2, help="Samples per question (GRPO group)."),
    max_tokens: int = typer.Option(48, min=8, help="Token budget of one episode (both turns and the observation)."),
    temperature: float = typer.Option(0.5, min=0.01, help="Sampling temperature of rollouts and evaluations."),
    eval_n: int = typer.Option(256, min=1, help="Held-out questions per evaluation."),
    eval_every: int = typer.Option(0, min=0, help="Evaluate every N steps (0 = at the start and the end)."),
    muon_lr: float = typer.Option(0.003, min=0.0, help="Muon learning rate of the GRPO step."),
    sft_steps: int = typer.Option(600, min=1, help="Steps of the supervised policy (reused once trained)."),
    sft_minutes: float = typer.Option(15.0, min=0.0, help="Wall-clock cap of the supervised run."),
    seed: int = typer.Option(0),
    threads: int = typer.Option(1, min=0, help="torch threads per actor (0 = torch default)."),
    trainer_procs: int = typer.Option(1, min=1, help="Trainer processes: a gloo group with ZeRO (launched by the "
                                      "trainer actor) when > 1."),
    ray: bool = typer.Option(True, "--ray/--no-ray", help="Run the fleet as Ray actors (default) or in this process."),
    address: Optional[str] = typer.Option(None, help="Join this Ray cluster instead of starting a local Ray."),
    edges: int = typer.Option(1, min=1, help="Sandbox edges to start (when DSEC_API_URL is not set)."),
    edge_resource: Optional[str] = typer.Option(None, help="Ray resource each edge actor needs (pins edges to the hosts "
                                                "that may run sandboxes)."),
    policy: Optional[str] = typer.Option(None, help="Directory of supervised runs (default OUT/policy)."),
    fault: List[str] = typer.Option([], help="Fault injection, KIND@STEP: worker@N, trainer@N, edge@N (repeatable)."),
    fresh: bool = typer.Option(False, "--fresh", help="Start the RL steps over in --out (the supervised policy is kept)."),
    as_json: bool = typer.Option(False, "--json", help="JSON lines on stdout (steps, evals, then the summary)."),
):
    """Agentic RL end to end: rollouts with tool calls in DSec sandboxes, the token WAL, the
    metadata/heavy data path, GRPO with Muon, versioned weights back to the engines."""
    from v4stack.rl.grpo import GRPOConfig
    from v4stack.rl.loop import LoopConfig, run
    from v4stack.rl.policy import SFTConfig

    try:
        cfg = LoopConfig(preset=preset, out=out, minutes=minutes, steps=steps, workers=workers, groups=groups,
                         group_size=group_size, max_tokens=max_tokens, temperature=temperature, eval_n=eval_n, eval_every=eval_every,
                         seed=seed, threads=threads, trainer_procs=trainer_procs, ray=ray, address=address, edges=edges, edge_resource=edge_resource, policy=policy,
                         faults=list(fault),
                         sft=SFTConfig(preset=preset, steps=sft_steps, minutes=sft_minutes, seed=seed, threads=threads),
                         grpo=GRPOConfig(muon_lr=muon_lr)).validate()
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if fresh:
        from v4stack.rl.loop import clear_rl_state

        clear_rl_state(out)
    summary = run(cfg, log=sys.stdout if as_json else None)
    if as_json:
        typer.echo(json.dumps({"event": "summary", **summary}))
    else:
        a, b = summary["sft_eval"], summary["final_eval"]
        typer.echo(f"held-out reward: supervised {a['reward_mean']:.3f} +- {a['reward_se']:.3f} -> "
                   f"step {b['step']} {b['reward_mean']:.3f} +- {b['reward_se']:.3f} (n={b['n']})")
        typer.echo(f"log {out}/loop.json, curve {out}/loop.png")
