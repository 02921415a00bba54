"""``v4stack dsec``: start the services (together or one by one), build images, drive sandboxes.

Also runnable as ``python -m v4stack.dsec.cli``. Service verbs read the token from ``--token``
or ``DSEC_TOKEN``; client verbs use ``DSEC_API_URL`` / ``DSEC_TOKEN``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(name="dsec", help="DSec sandboxes: apiserver, edge, watcher, images, sandbox verbs.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
image_app = typer.Typer(help="Sandbox images (EROFS, content-addressed).", no_args_is_help=True)
app.add_typer(image_app, name="image")

DEFAULT_HOME = os.environ.get("DSEC_HOME", "/var/lib/v4stack-dsec")
HOME_OPT = typer.Option(DEFAULT_HOME, "--home", help="Shared storage: images, layers, logs, state.")
CREDS_OPT = typer.Option(None, "--credentials", envvar="DSEC_CREDENTIALS",
                         help="Credentials file (default: <home>/credentials.json; `dsec credentials` makes one).")


def _creds(home: str, path: Optional[str]):
    from v4stack.dsec.auth import Credentials

    p = Path(path) if path else Path(home) / "credentials.json"
    try:
        return Credentials.load(p)
    except (OSError, ValueError, KeyError) as e:
        typer.echo(f"error: --credentials {p}: {e} (run `v4stack dsec credentials --home {home}`)", err=True)
        raise typer.Exit(2)


@app.command()
def credentials(home: str = HOME_OPT, tenant: list[str] = typer.Option(["default"], "--tenant",
                help="A tenant to make a client token for (repeatable)."), force: bool = False):
    """Make <home>/credentials.json (0600): a client token per tenant, an edge and a control credential."""
    from v4stack.dsec.auth import Credentials
    from v4stack.dsec.mounts import private_dir

    p = private_dir(Path(home)) / "credentials.json"
    if p.exists() and not force:
        typer.echo(f"error: {p} exists (--force makes new ones)", err=True)
        raise typer.Exit(2)
    from v4stack.dsec.errors import DsecError

    try:
        c = Credentials.generate(tenant)
    except (ValueError, DsecError) as e:
        typer.echo(f"error: --tenant: {e}", err=True)
        raise typer.Exit(2)
    c.save(p)
    for t, tok in c.tenants.items():
        typer.echo(f"DSEC_TOKEN={tok}  # tenant {t}")


@app.command()
def apiserver(home: str = HOME_OPT, creds: Optional[str] = CREDS_OPT, host: str = "127.0.0.1", port: int = 8470):
    """Run the apiserver alone."""
    import uvicorn

    from v4stack.dsec.apiserver import make_app

    uvicorn.run(make_app(home, _creds(home, creds)), host=host, port=port, log_level="warning")


@app.command()
def edge(home: str = HOME_OPT, creds: Optional[str] = CREDS_OPT, apiserver_url: str = typer.Option(
        "http://127.0.0.1:8470", "--apiserver"), edge_id: str = typer.Option("", "--id"), host: str = "127.0.0.1",
        port: int = 0, pool: int = typer.Option(2, min=0, max=256, help="Warm process-substrate workers."),
        heartbeat: float = typer.Option(1.0, min=0.05, max=60)):
    """Run an edge agent alone (registers with the apiserver, then heartbeats)."""
    from v4stack.dsec.edge import serve

    c = _creds(home, creds)
    serve(home, apiserver_url, c.edge, c.control, edge_id or f"edge-{os.uname().nodename}-{os.getpid()}", host, port,
          pool, heartbeat)


@app.command()
def watcher(home: str = HOME_OPT, creds: Optional[str] = CREDS_OPT, every: float = typer.Option(1.0, min=0.05),
            dead_after: float = typer.Option(3.0, min=0.1)):
    """Run the watcher alone (TTL / idle / dead-edge reclamation, layer and blob GC)."""
    from v4stack.dsec.watcher import Watcher

    Watcher(home, _creds(home, creds).control, dead_after=dead_after).run(every)


@app.command()
def up(home: str = HOME_OPT, port: int = 8470, pool: int = 2,
       image: str = typer.Option("busybox", help="Image recipe to build before serving ('' to skip).")):
    """Start apiserver + one edge + watcher on this machine (the embedded default)."""
    import uvicorn

    from v4stack.dsec.apiserver import make_app
    from v4stack.dsec.auth import Credentials
    from v4stack.dsec.images import ImageStore
    from v4stack.dsec.mounts import private_dir
    from v4stack.dsec.watcher import Watcher

    private_dir(Path(home))
    creds = Credentials.ensure(home)
    typer.echo(f"DSEC_TOKEN={next(iter(creds.tenants.values()))}  (tenant {next(iter(creds.tenants))}; "
               f"all in {Path(home) / 'credentials.json'})")
    if image:
        typer.echo(f"image {image}: {ImageStore(Path(home)).build(image)}")
    env = dict(os.environ)

    def die_with_parent():  # if `up` itself is killed outright, its edge goes too (main thread, no threads yet)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG

    edge_proc = subprocess.Popen([sys.executable, "-m", "v4stack.dsec.cli", "edge", "--home", home, "--apiserver",
                                  f"http://127.0.0.1:{port}", "--pool", str(pool)], env=env,
                                 preexec_fn=die_with_parent)
    w = Watcher(home, creds.control)
    threading.Thread(target=w.run, daemon=True).start()
    typer.echo(f"dsec up: apiserver http://127.0.0.1:{port}, edge pid {edge_proc.pid}, home {home}")
    from v4stack.dsec.edge import quiet_after_shutdown

    quiet_after_shutdown()
    try:
        uvicorn.run(make_app(home, creds), host="127.0.0.1", port=port, log_level="warning")
    finally:
        w.stop.set()
        edge_proc.send_signal(signal.SIGTERM)
        try:
            edge_proc.wait(10)
        except subprocess.TimeoutExpired:
            edge_proc.kill()


@image_app.command("build")
def image_build(recipe: str = typer.Argument("busybox", help="busybox or debian"), home: str = HOME_OPT,
                force: bool = False):
    """Build (or find cached) an image; prints its content address."""
    from v4stack.dsec.errors import DsecError
    from v4stack.dsec.images import ImageStore

    try:
        typer.echo(ImageStore(Path(home)).build(recipe, force=force))
    except DsecError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)


@image_app.command("list")
def image_list(home: str = HOME_OPT):
    from v4stack.dsec.images import ImageStore

    typer.echo(json.dumps(ImageStore(Path(home)).list(), indent=2))


def _client(fn):
    from v4stack.dsec.client import SandboxError

    try:
        return fn()
    except SandboxError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1)


@app.command()
def create(image: str = "busybox", substrate: str = "container", timeout: Optional[float] = None):
    """Create a sandbox; prints its id."""
    from v4stack.dsec.client import Sandbox

    typer.echo(_client(lambda: Sandbox.create(image=image, substrate=substrate, timeout=timeout)).id)


@app.command("exec")
def exec_(sandbox_id: str, cmd: str, timeout: float = 60, idempotent: bool = False, seq: Optional[int] = None):
    """Run a shell command in a sandbox, streaming its output; exits with its exit code."""
    from v4stack.dsec.client import Sandbox

    sbx = _client(lambda: Sandbox.connect(sandbox_id))
    r = _client(lambda: sbx.commands.run(cmd, timeout=timeout, idempotent=idempotent, seq=seq,
                                         on_stdout=lambda s: sys.stdout.write(s),
                                         on_stderr=lambda s: sys.stderr.write(s)))
    raise typer.Exit(r.exit_code)


@app.command()
def snapshot(sandbox_id: str):
    from v4stack.dsec.client import Sandbox

    typer.echo(json.dumps(_client(lambda: Sandbox.connect(sandbox_id).snapshot()), indent=2))


@app.command()
def restore(snapshot_id: str, replay_from: Optional[str] = None, substrate: str = "container"):
    """A new sandbox from a snapshot (optionally fast-forwarded with another sandbox's log)."""
    from v4stack.dsec.client import Sandbox

    typer.echo(_client(lambda: Sandbox.restore(snapshot_id, replay_from=replay_from, substrate=substrate)).id)


@app.command()
def kill(sandbox_id: str):
    from v4stack.dsec.client import Sandbox

    _client(lambda: Sandbox.connect(sandbox_id).kill())


@app.command()
def log(sandbox_id: str, since: int = 0, path: Optional[str] = None):
    """The sandbox's trajectory log (and provenance of --path)."""
    from v4stack.dsec.client import Sandbox

    typer.echo(json.dumps(_client(lambda: Sandbox.connect(sandbox_id).log(since, path)), indent=2))


if __name__ == "__main__":
    app()
