"""The edge: the per-host agent that runs sandboxes (a ``Runtime``) behind an internal HTTP API.

It registers with the apiserver on start and heartbeats every ``heartbeat_s`` (edge credential);
the apiserver places sandboxes on it and forwards verbs. The edge API accepts only the control
credential (the apiserver's and the watcher's), validates every body with the models of
``protocol`` and every sandbox id with its pattern, and runs sandbox work on its own thread pool,
so a crowd of long commands never starves ``/healthz`` or the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import queue
import threading
from contextlib import asynccontextmanager
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import httpx
from fastapi import Depends, FastAPI, Path as FPath, Query, Request
from fastapi.responses import StreamingResponse

from v4stack.dsec.auth import bearer
from v4stack.dsec.cgroups import Limits
from v4stack.dsec.errors import BadRequest, DsecError
from v4stack.dsec.files import MAX_FILE
from v4stack.dsec.protocol import (AsciiJSON, EdgeCreateBody, ExecBody, RestoreBody, UploadBody, install_errors,
                                   read_body)
from v4stack.dsec.runtime import Runtime
from v4stack.dsec.validate import MAX_PATH, PATTERNS

SID = Annotated[str, FPath(pattern=f"^{PATTERNS['sandbox_id'].pattern}$")]
PathQ = Annotated[str, Query(min_length=1, max_length=MAX_PATH, pattern=r"^[^\x00]+$")]


def make_app(rt: Runtime, control_token: str, workers: int = 256) -> FastAPI:
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dsec-edge")

    @asynccontextmanager
    async def lifespan(app):
        yield
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="dsec edge", default_response_class=AsciiJSON, lifespan=lifespan)
    install_errors(app)
    auth = Depends(bearer(control_token))

    async def off(fn, *a, **kw):
        """Sandbox work on the edge's own pool (never the event loop, never the shared small pool)."""
        return await asyncio.get_running_loop().run_in_executor(pool, lambda: fn(*a, **kw))

    @app.get("/healthz")
    async def healthz():
        return {"ok": True, "sandboxes": len(rt.sandboxes)}

    @app.get("/edge/v1/sandboxes", dependencies=[auth])
    async def list_():
        return [s.info() for s in list(rt.sandboxes.values())]

    @app.post("/edge/v1/sandboxes", dependencies=[auth])
    async def create(body: EdgeCreateBody):
        limits = Limits(**body.limits.model_dump()) if body.limits else None
        s = await off(rt.create, image=body.image, substrate=body.substrate, limits=limits, sid=body.sandbox_id,
                      snapshot=body.snapshot_id, replay_from=body.replay_from,
                      allow=body.network.allow if body.network else None, rerun_idempotent=body.rerun_idempotent)
        return {**s.info(), "restore": s.restore_info}

    @app.delete("/edge/v1/sandboxes/{sandbox_id}", dependencies=[auth])
    async def kill(sandbox_id: SID):
        await off(rt.kill, sandbox_id)
        return {"killed": sandbox_id}

    @app.post("/edge/v1/sandboxes/{sandbox_id}/exec", dependencies=[auth])
    async def exec_(sandbox_id: SID, body: ExecBody):
        s = rt.get(sandbox_id)
        kw = dict(cmd=body.cmd, cwd=body.cwd, env=body.env, timeout=body.timeout, idempotent=body.idempotent,
                  seq=body.seq)
        if not body.stream:
            return await off(s.exec, **kw)
        q: queue.Queue = queue.Queue()

        def run():
            try:
                res = s.exec(**kw, on_output=lambda stream, data: q.put({stream: data.decode(errors="replace")}))
                q.put({"result": res})
            except DsecError as e:
                q.put({"error": str(e), "field": e.field, "status": e.status})
            except Exception as e:  # noqa: BLE001 - the stream must end with a status, whatever happened
                q.put({"error": f"{type(e).__name__}: {e}", "field": None, "status": 500})
            q.put(None)

        pool.submit(run)

        def gen():
            while (item := q.get()) is not None:
                yield json.dumps(item) + "\n"

        return StreamingResponse(gen(), media_type="application/x-ndjson")

    @app.get("/edge/v1/sandboxes/{sandbox_id}/files", dependencies=[auth])
    async def read(sandbox_id: SID, path: PathQ):
        chunks = await off(rt.get(sandbox_id).files.chunks, path)
        return StreamingResponse(chunks, media_type="application/octet-stream")

    @app.get("/edge/v1/sandboxes/{sandbox_id}/files/list", dependencies=[auth])
    async def list_files(sandbox_id: SID, path: PathQ = "/"):
        return await off(rt.get(sandbox_id).files.list, path)

    @app.put("/edge/v1/sandboxes/{sandbox_id}/files", dependencies=[auth])
    async def write(sandbox_id: SID, request: Request, path: PathQ, mode: Annotated[int, Query(ge=0, le=0o1777)] = 0o644,
                    seq: Annotated[int | None, Query(ge=0, lt=1 << 62)] = None):
        s = rt.get(sandbox_id)
        data = await read_body(request, MAX_FILE)
        return await off(s.write_files, [(path, data, mode)], seq=seq)

    @app.post("/edge/v1/sandboxes/{sandbox_id}/files/upload", dependencies=[auth])
    async def upload(sandbox_id: SID, body: UploadBody):
        s = rt.get(sandbox_id)
        items = []
        for i, f in enumerate(body.files):
            try:
                items.append((f.path, base64.b64decode(f.data, validate=True), f.mode))
            except (binascii.Error, ValueError):
                raise BadRequest(f"files[{i}].data: not base64", f"files.{i}.data") from None
        return await off(s.write_files, items, seq=body.seq)

    @app.delete("/edge/v1/sandboxes/{sandbox_id}/files", dependencies=[auth])
    async def remove(sandbox_id: SID, path: PathQ):
        return await off(rt.get(sandbox_id).remove_file, path)

    @app.post("/edge/v1/sandboxes/{sandbox_id}/snapshot", dependencies=[auth])
    async def snapshot(sandbox_id: SID):
        return await off(rt.get(sandbox_id).snapshot)

    @app.post("/edge/v1/sandboxes/{sandbox_id}/restore", dependencies=[auth])
    async def restore(sandbox_id: SID, body: RestoreBody):
        s = rt.get(sandbox_id)
        out = await off(s.restore, body.snapshot_id, body.replay_from, body.rerun_idempotent)
        return {**out, "chain": s.rootfs.chain}

    return app


class Heartbeat(threading.Thread):
    """Registers the edge, then heartbeats; re-registers when the apiserver forgets it."""

    def __init__(self, apiserver: str, edge_token: str, edge_id: str, url: str, every: float = 1.0):
        super().__init__(daemon=True)
        self.api, self.edge_id, self.url, self.every = apiserver.rstrip("/"), edge_id, url, every
        self.headers = {"Authorization": f"Bearer {edge_token}"}
        self.stop = threading.Event()

    def run(self) -> None:
        registered = False
        with httpx.Client(timeout=5) as c:
            while not self.stop.is_set():
                try:
                    if not registered:
                        c.post(f"{self.api}/v1/edges/register", json={"edge_id": self.edge_id, "url": self.url},
                               headers=self.headers).raise_for_status()
                        registered = True
                    else:
                        r = c.post(f"{self.api}/v1/edges/{self.edge_id}/heartbeat", headers=self.headers)
                        registered = r.status_code == 200
                except httpx.HTTPError:
                    registered = False
                self.stop.wait(self.every)


def quiet_after_shutdown() -> None:
    """uvicorn shuts down gracefully on SIGTERM / SIGINT and then raises the signal again with the
    handlers it found installed; make those no-ops so our own cleanup (``finally``) still runs."""
    import signal

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)


def serve(home: str, apiserver: str, edge_token: str, control_token: str, edge_id: str, host: str = "127.0.0.1",
          port: int = 0, pool_size: int = 2, heartbeat_s: float = 1.0) -> None:
    import socket

    import uvicorn

    rt = Runtime(home, pool_size=pool_size)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    url = f"http://{host}:{sock.getsockname()[1]}"
    hb = Heartbeat(apiserver, edge_token, edge_id, url, heartbeat_s)
    hb.start()
    server = uvicorn.Server(uvicorn.Config(make_app(rt, control_token), log_level="warning", timeout_keep_alive=30,
                                           timeout_graceful_shutdown=5))
    quiet_after_shutdown()
    try:
        server.run(sockets=[sock])
    finally:
        hb.stop.set()
        rt.close()
