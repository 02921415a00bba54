"""``v4stack convert``: released checkpoint layout <-> the project's layout (model/released.py).

The direction follows the source: a released checkpoint (``model.safetensors.index.json`` and no
project marker) becomes a project checkpoint, and a project checkpoint becomes a released one
(byte for byte when it came from one). Torch loads only when the command runs.
"""

from __future__ import annotations

from typing import Optional

import typer


def convert_command(
    src: str = typer.Argument(..., help="Source checkpoint directory."),
    dst: str = typer.Argument(..., help="Destination directory (must not exist)."),
    to: Optional[str] = typer.Option(None, help="'project' or 'released' (default: the other layout)."),
    shards: int = typer.Option(1, help="Shards when writing a released checkpoint from scratch."),
):
    """Convert a checkpoint between the released layout and the project's; errors name the tensor."""
    from v4stack.model.released import detect_layout, to_project, to_released
    from v4stack.model.weights import WeightsError

    try:
        target = to or ("project" if detect_layout(src) == "released" else "released")
        if target not in ("project", "released"):
            raise WeightsError(f"option 'to' must be 'project' or 'released', got {target!r}")
        out = to_project(src, dst) if target == "project" else to_released(src, dst, shards=shards)
    except (WeightsError, ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote {target} checkpoint {out}")
