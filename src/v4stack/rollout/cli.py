"""Rollout commands for the one ``v4stack`` command; ``register`` adds them to its sub-apps.

    v4stack bench wal       token WAL cost per decode step (bare / inline fsync / pipelined fsync)
    v4stack bench prefix    on-disk prefix restore under the SWA strategies
    v4stack rollout inspect a WAL directory, read-only: trajectories by status, tokens, resumes

Heavy modules (torch) are imported inside the commands.
"""

from __future__ import annotations

import json

import typer


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``bench wal``, ``bench prefix`` to ``bench_app`` and a ``rollout`` sub-app to ``app``."""

    @bench_app.command("wal")
    def bench_wal_cmd(
        preset: str = typer.Option("tiny", help="Model preset (random weights)."),
        trajectories: int = typer.Option(8, min=1, help="Trajectories decoded together."),
        prompt_len: int = typer.Option(32, min=1),
        max_tokens: int = typer.Option(32, min=2),
        rounds: int = typer.Option(2, min=1, help="Interleaved repetitions of the three modes."),
        out: str = typer.Option("bench/results/rollout_wal.json", help="JSON output path."),
    ):
        """Token WAL cost per decode step: bare engine vs fsync inline vs fsync overlapped."""
        from v4stack.rollout.bench import bench_wal

        res = bench_wal(preset, trajectories, prompt_len, max_tokens, rounds, out=out)
        for m, d in res["modes"].items():
            typer.echo(f"{m:<9} step p50 {d['step']['p50_ms']:8.2f} ms   WAL on critical path mean "
                       f"{d['wal_on_critical_path']['mean_ms']:6.3f} ms ({100 * d['wal_fraction_of_step']:.2f}% of a step)")
        typer.echo(f"fsync of one batch p50 {res['fsync_append_batch']['p50_ms']:.3f} ms; "
                   f"tokens identical across modes: {res['tokens_identical']}; JSON in {out}")

    @bench_app.command("prefix")
    def bench_prefix_cmd(
        preset: str = typer.Option("tiny", help="Model preset (random weights)."),
        prefixes: int = typer.Option(3, min=1, help="Distinct shared prefixes."),
        prefix_len: int = typer.Option(232, min=1),
        suffix_len: int = typer.Option(8, min=1),
        requests_per_prefix: int = typer.Option(2, min=1),
        rounds: int = typer.Option(2, min=1),
        strategies: str = typer.Option("full,periodic:64,periodic:128,none", help="Comma-separated SWA strategies."),
        out: str = typer.Option("bench/results/prefix_cpu_tiny.json", help="JSON output path (PNG next to it)."),
    ):
        """Shared-prefix restore from disk: disk bytes/token, restore latency, recomputed tokens, TTFT."""
        from v4stack.rollout.prefix_bench import bench_prefix

        try:
            res = bench_prefix(preset, prefixes, prefix_len, suffix_len, requests_per_prefix,
                               tuple(s for s in strategies.split(",") if s), rounds=rounds, out=out)
        except ValueError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)
        for name, r in res["strategies"].items():
            typer.echo(f"{name:<13} disk B/token {r.get('disk_bytes_per_prefix_token', 0):9.1f}   restore p50 "
                       f"{r.get('restore_ms_p50', 0):8.2f} ms   recomputed {r['recomputed_tokens_mean']:6.1f}   "
                       f"TTFT p50 {r['ttft_ms_p50']:8.2f} ms   equal {r['tokens_equal_recompute']}")
        typer.echo(f"JSON in {out}")

    rollout_app = typer.Typer(help="Durable rollouts: the token WAL.", no_args_is_help=True)
    app.add_typer(rollout_app, name="rollout")

    @rollout_app.command("inspect")
    def inspect_cmd(path: str = typer.Argument(..., help="WAL directory.")):
        """Read-only summary of a token WAL (takes no lock, repairs nothing)."""
        from v4stack.rollout.wal import WALInconsistent, inspect

        try:
            typer.echo(json.dumps(inspect(path), indent=2))
        except WALInconsistent as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1)
