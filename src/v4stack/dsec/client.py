"""The Python SDK for the apiserver.

    sbx = Sandbox.create(image="busybox")
    sbx.files.write("/workspace/a.txt", "hi")
    r = sbx.commands.run("cat /workspace/a.txt")
    snap = sbx.snapshot()
    twin = Sandbox.restore(snap["id"])

Address and token come from the arguments or ``DSEC_API_URL`` / ``DSEC_TOKEN``. Every call has a
timeout; a failed call raises ``SandboxError`` with the HTTP status and the field at fault.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from typing import Callable

import httpx


class SandboxError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.field = status, message, field


@dataclass
class CommandResult:
    exit_code: int
    stdout: str
    stderr: str
    seq: int
    duration: float
    timed_out: bool = False
    oom_killed: bool = False
    fast_forward: bool = False
    fs_digest: str = ""
    changed: list | None = None


class _Conn:
    def __init__(self, api_url: str | None, token: str | None, request_timeout: float):
        self.url = (api_url or os.environ.get("DSEC_API_URL") or "http://127.0.0.1:8470").rstrip("/")
        tok = token or os.environ.get("DSEC_TOKEN") or ""
        self.http = httpx.Client(base_url=self.url, timeout=request_timeout, headers={"Authorization": f"Bearer {tok}"})

    def call(self, method: str, path: str, **kw):
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise SandboxError(0, f"{method} {path}: {type(e).__name__}: {e}") from None
        if r.status_code >= 400:
            try:
                body = r.json()
                raise SandboxError(r.status_code, body.get("error") or body.get("detail") or r.text, body.get("field"))
            except ValueError:
                raise SandboxError(r.status_code, r.text) from None
        return r


class Commands:
    def __init__(self, sbx: "Sandbox"):
        self.sbx = sbx

    def run(self, cmd: str | list[str], cwd: str = "/", env: dict | None = None, timeout: float = 60,
            idempotent: bool = False, seq: int | None = None, on_stdout: Callable[[str], None] | None = None,
            on_stderr: Callable[[str], None] | None = None) -> CommandResult:
        body = {"cmd": cmd, "cwd": cwd, "env": env or {}, "timeout": timeout, "idempotent": idempotent, "seq": seq}
        path = f"/v1/sandboxes/{self.sbx.id}/exec"
        if on_stdout or on_stderr:
            body["stream"] = True
            res = None
            with self.sbx._c.http.stream("POST", path, json=body, timeout=timeout + 30) as r:
                if r.status_code >= 400:
                    r.read()
                    try:
                        err = r.json()
                    except ValueError:
                        err = {}
                    raise SandboxError(r.status_code, err.get("error") or err.get("detail") or r.text, err.get("field"))
                for line in r.iter_lines():
                    if not line:
                        continue
                    item = json.loads(line)
                    if "stdout" in item and on_stdout:
                        on_stdout(item["stdout"])
                    elif "stderr" in item and on_stderr:
                        on_stderr(item["stderr"])
                    elif "error" in item:
                        raise SandboxError(item.get("status", 500), item["error"], item.get("field"))
                    elif "result" in item:
                        res = item["result"]
            if res is None:
                raise SandboxError(0, "the stream ended without a result")
        else:
            res = self.sbx._c.call("POST", path, json=body, timeout=timeout + 30).json()
        return CommandResult(res["exit_code"], res["stdout"], res["stderr"], res["seq"], res["duration"],
                             res.get("timed_out", False), res.get("oom_killed", False), res.get("fast_forward", False),
                             res.get("fs_digest", ""), res.get("changed"))


class Files:
    def __init__(self, sbx: "Sandbox"):
        self.sbx = sbx

    def _p(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{self.sbx.id}/files{suffix}"

    def write(self, path: str, data: str | bytes, mode: int = 0o644) -> dict:
        if isinstance(data, str):
            data = data.encode()
        return self.sbx._c.call("PUT", self._p(), params={"path": path, "mode": mode}, content=data).json()

    def write_many(self, files: list[tuple[str, str | bytes]]) -> dict:
        """Bulk upload; parent directories are created."""
        items = [{"path": p, "data": base64.b64encode(d.encode() if isinstance(d, str) else d).decode()} for p, d in files]
        return self.sbx._c.call("POST", self._p("/upload"), json={"files": items}).json()

    def read(self, path: str) -> bytes:
        return self.sbx._c.call("GET", self._p(), params={"path": path}).content

    def list(self, path: str = "/") -> list[dict]:
        return self.sbx._c.call("GET", self._p("/list"), params={"path": path}).json()

    def remove(self, path: str) -> dict:
        return self.sbx._c.call("DELETE", self._p(), params={"path": path}).json()


class Sandbox:
    def __init__(self, info: dict, conn: _Conn):
        self.id: str = info["id"]
        self.info_at_create = info
        self._c = conn
        self.commands = Commands(self)
        self.files = Files(self)

    @classmethod
    def create(cls, image: str = "busybox", substrate: str = "container", limits: dict | None = None,
               timeout: float | None = None, idle_timeout: float | None = None, snapshot_id: str | None = None,
               replay_from: str | None = None, api_url: str | None = None, token: str | None = None,
               request_timeout: float = 120, edge: str | None = None,
               allow_egress: list[str] | None = None, rerun_idempotent: bool = False) -> "Sandbox":
        """``allow_egress``: CIDRs the sandbox may reach (container substrate); default none."""
        c = _Conn(api_url, token, request_timeout)
        body = {"image": image, "substrate": substrate, "limits": limits or {}, "snapshot_id": snapshot_id,
                "replay_from": replay_from, "edge": edge}
        if allow_egress is not None:
            body["network"] = {"allow": allow_egress}
        if rerun_idempotent:
            body["rerun_idempotent"] = True
        if timeout is not None:
            body["timeout"] = timeout
        if idle_timeout is not None:
            body["idle_timeout"] = idle_timeout
        return cls(c.call("POST", "/v1/sandboxes", json=body).json(), c)

    @classmethod
    def restore(cls, snapshot_id: str, replay_from: str | None = None, substrate: str = "container",
                rerun_idempotent: bool = False, **kw) -> "Sandbox":
        """A new sandbox from ``snapshot_id``; with ``replay_from`` it also re-applies that sandbox's
        logged changes after the snapshot (fast-forward, nothing re-run). An unknown outcome stops
        the replay; ``rerun_idempotent`` runs it again only if it was logged as idempotent."""
        return cls.create(snapshot_id=snapshot_id, replay_from=replay_from, substrate=substrate,
                          rerun_idempotent=rerun_idempotent, **kw)

    @classmethod
    def connect(cls, sandbox_id: str, api_url: str | None = None, token: str | None = None) -> "Sandbox":
        c = _Conn(api_url, token, 120)
        return cls(c.call("GET", f"/v1/sandboxes/{sandbox_id}").json(), c)

    def info(self) -> dict:
        return self._c.call("GET", f"/v1/sandboxes/{self.id}").json()

    def snapshot(self) -> dict:
        return self._c.call("POST", f"/v1/sandboxes/{self.id}/snapshot").json()

    def restore_to(self, snapshot_id: str, replay_from: str | None = None) -> dict:
        return self._c.call("POST", f"/v1/sandboxes/{self.id}/restore",
                            json={"snapshot_id": snapshot_id, "replay_from": replay_from}).json()

    def fork(self, snapshot_id: str | None = None) -> "Sandbox":
        return Sandbox(self._c.call("POST", f"/v1/sandboxes/{self.id}/fork", json={"snapshot_id": snapshot_id}).json(),
                       self._c)

    def pause(self) -> dict:
        return self._c.call("POST", f"/v1/sandboxes/{self.id}/pause").json()

    def resume(self) -> dict:
        return self._c.call("POST", f"/v1/sandboxes/{self.id}/resume").json()

    def log(self, since: int = 0, path: str | None = None) -> dict:
        params = {"since": since} | ({"path": path} if path else {})
        return self._c.call("GET", f"/v1/sandboxes/{self.id}/log", params=params).json()

    def kill(self) -> None:
        self._c.call("DELETE", f"/v1/sandboxes/{self.id}")

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.kill()
        except SandboxError:
            pass
