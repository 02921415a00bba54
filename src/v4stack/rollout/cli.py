"""``v4stack rollout``: the durable-rollout commands (cli.py mounts ``app``).

    v4stack rollout inspect a WAL directory, read-only: trajectories by status, tokens, resumes

Heavy modules (torch) are imported inside the commands.
"""

from __future__ import annotations

import json

import typer

app = typer.Typer(help="Durable rollouts: the token WAL.", no_args_is_help=True)


@app.command("inspect")
def inspect_cmd(path: str = typer.Argument(..., help="WAL directory.")):
    """Read-only summary of a token WAL (takes no lock, repairs nothing)."""
    from v4stack.journal import JournalError
    from v4stack.rollout.wal import WALInconsistent, inspect

    try:
        typer.echo(json.dumps(inspect(path), indent=2))
    except (WALInconsistent, JournalError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1)
