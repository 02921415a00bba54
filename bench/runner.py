"""The one place benchmark results are written: atomically, stamped with what produced them.

Every result file records the commit, whether the tree was dirty, the host, the device, the command
line and, when the ops dispatch table is loaded, which implementation served each op. On a machine
without git, or whose copy of the tree carries git metadata of another commit (a GPU box), set
V4STACK_COMMIT / V4STACK_DIRTY: ``commit_from`` says which source the stamp took, and ``package``
the directory the ``v4stack`` package was imported from (``src``, or an A/B's older tree).

    from bench.runner import write_result
    write_result("bench/results/x.json", {"rows": [...]})
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def _device() -> dict:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        i = torch.cuda.current_device()
        return {"kind": "cuda", "name": torch.cuda.get_device_name(i), "count": torch.cuda.device_count()}
    return {"kind": "cpu", "name": platform.processor() or platform.machine(), "cores": os.cpu_count()}


def _ops_counters() -> dict | None:
    ops = sys.modules.get("v4stack.ops")
    counters = getattr(ops, "counters", None)
    return counters() if callable(counters) else None


def _package() -> str | None:
    """The directory holding the imported ``v4stack`` package, relative to the repository if inside it."""
    f = getattr(sys.modules.get("v4stack"), "__file__", None)
    if not f:
        return None
    d = Path(f).resolve().parents[1]
    try:
        return str(d.relative_to(ROOT))
    except ValueError:
        return str(d)


def stamp() -> dict:
    """Commit, dirty flag, host, device, command, time and versions of the process writing a result."""
    from_env = bool(os.environ.get("V4STACK_COMMIT"))
    commit = os.environ.get("V4STACK_COMMIT") or (_git("rev-parse", "HEAD") or "").strip() or None
    if "V4STACK_DIRTY" in os.environ:
        dirty: bool | None = os.environ["V4STACK_DIRTY"] not in ("", "0", "false")
    else:
        status = _git("status", "--porcelain", "--untracked-files=no")
        dirty = None if status is None else bool(status.strip())
    torch = sys.modules.get("torch")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "commit": commit,
        "commit_from": "env" if from_env else ("git" if commit else None),
        "dirty": dirty,
        "package": _package(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "device": _device(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": getattr(torch, "__version__", None),
        "load_average": list(load) if load else None,
        "ops_counters": _ops_counters(),
        **({"side": os.environ["V4STACK_SIDE"]} if os.environ.get("V4STACK_SIDE") else {}),  # an A/B run's side
        # the settings the code reads from the environment (V4STACK_PDL, ...): part of what was run
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith("V4STACK_") and k not in ("V4STACK_COMMIT", "V4STACK_DIRTY", "V4STACK_SIDE")},
    }


def write_result(path: str | os.PathLike, payload: dict) -> Path:
    """Write ``payload`` plus a ``stamp`` to ``path`` as JSON, whole or not at all."""
    from v4stack.atomic import atomic_write

    path = Path(path)
    body = {**payload, "stamp": stamp()}
    atomic_write(path, (json.dumps(body, indent=2, default=str) + "\n").encode())
    return path


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Save a matplotlib figure atomically (PNG)."""
    from v4stack.atomic import atomic_png

    atomic_png(fig, path, dpi=110)
    return Path(path)
