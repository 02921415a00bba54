"""The one `v4stack` command. Subcommands import their heavy modules (torch) lazily."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

app = typer.Typer(
    name="v4stack",
    help="The DeepSeek-V4 system loop: model, kernels, MegaMoE, Muon/ZeRO, serving, rollouts, DSec.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _config(preset: Optional[str], model: Optional[str]):
    from v4stack.config import ConfigError, ModelConfig, preset as get_preset

    try:
        if model:
            return ModelConfig.load(model)
        return get_preset(preset or "tiny")
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)


@app.command()
def info(
    preset: str = typer.Option("flash", help="Preset: tiny, flash or pro."),
    model: Optional[str] = typer.Option(None, help="A model directory (config.json) instead of a preset."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Parameter counts (total / activated) and per-token cache bytes, built on the meta device."""
    from v4stack.model.stats import model_stats

    stats = model_stats(_config(preset, model))
    if as_json:
        typer.echo(json.dumps(stats, indent=2))
        return
    typer.echo(f"preset/model        {model or preset}")
    typer.echo(f"total params        {stats['total_params']:,} ({stats['total_params'] / 1e9:.1f}B)")
    typer.echo(f"active params       {stats['active_params']:,} ({stats['active_params'] / 1e9:.2f}B)")
    layers = stats["layers"]
    typer.echo(f"layers              {layers['swa']} SWA-only, {layers['csa']} CSA, {layers['hca']} HCA, {layers['mtp']} MTP")
    typer.echo("block cache, bytes per token      bf16 reference   V4 format (FP8 + BF16 RoPE dims)")
    ref, v4 = stats["cache_bytes_per_token"], stats["cache_bytes_per_token_v4_format"]
    for kind in ref:
        typer.echo(f"  {kind:<32}{ref[kind]:>14,.1f}   {v4[kind]:>14,.1f}")
    typer.echo("state cache, bytes per request (fixed size):")
    for kind, b in stats["state_bytes_per_request"].items():
        typer.echo(f"  {kind:<32}{b:>14,}")


@app.command()
def generate(
    prompt: str = typer.Option(..., help="Prompt text (byte-level tokenizer)."),
    preset: str = typer.Option("tiny", help="Preset when no --model is given."),
    model: Optional[str] = typer.Option(None, help="Model directory with config.json + model.safetensors."),
    max_tokens: int = typer.Option(32, min=1, help="New tokens to generate."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0),
    top_k: int = typer.Option(0, min=0, help="0 = off."),
    seed: int = typer.Option(0, help="Seed for random weights and sampling."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float64."),
):
    """Generate text on the CPU with the incremental decode path (random or saved weights)."""
    from v4stack.generate import run_generate

    cfg = _config(preset, model)
    out = run_generate(cfg, model, prompt, max_tokens=max_tokens, temperature=temperature,
                       top_p=top_p, top_k=top_k, seed=seed, dtype=dtype)
    typer.echo(out["text"])
    typer.echo(json.dumps({k: v for k, v in out.items() if k != "text"}), err=True)


from v4stack.serve.cli import serve_command  # noqa: E402 (typer only)

app.command("serve")(serve_command)


from v4stack.train.cli import muon_plan_command, train_command  # noqa: E402 (typer only; torch loads per command)

plan_app = typer.Typer(help="Plans: how the model's work maps onto ranks.", no_args_is_help=True)
plan_app.command("muon")(muon_plan_command)
app.add_typer(plan_app, name="plan")
app.command("train")(train_command)

from v4stack.check import app as check_app  # noqa: E402 (no torch at import)
from v4stack.convert import convert_command  # noqa: E402 (torch loads when the command runs)

app.command("convert")(convert_command)
from v4stack.dsec.cli import app as dsec_app  # noqa: E402 (heavy imports live inside the commands)

app.add_typer(check_app, name="check")
app.add_typer(dsec_app, name="dsec")

from v4stack.rollout.cli import app as rollout_app  # noqa: E402

app.add_typer(rollout_app, name="rollout")

from v4stack.rl.cli import loop_command  # noqa: E402 (typer only; torch and Ray load when it runs)

app.command("loop")(loop_command)

from v4stack.bench_cli import app as bench_app  # noqa: E402 (the benchmarks live in bench/, outside the library)

app.add_typer(bench_app, name="bench")


def main() -> None:  # console entry point
    try:
        app()
    except BrokenPipeError:  # pragma: no cover
        sys.exit(0)


if __name__ == "__main__":
    main()
