"""The edge: the per-host agent that runs sandboxes (a ``Runtime``) behind an internal HTTP API.

It registers with the apiserver on start and heartbeats every ``heartbeat_s``; the apiserver
places sandboxes on it and forwards verbs. Requests carry the shared bearer token.
"""

from __future__ import annotations

import base64
import json
import queue
import threading

import httpx
from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from v4stack.dsec.auth import bearer
from v4stack.dsec.cgroups import Limits
from v4stack.dsec.errors import BadRequest, DsecError
from v4stack.dsec.runtime import Runtime


def error_response(e: DsecError) -> JSONResponse:
    return JSONResponse({"error": str(e), "field": e.field, "kind": type(e).__name__}, status_code=e.status)


def limits_from(body: dict) -> Limits:
    raw = body.get("limits") or {}
    if not isinstance(raw, dict):
        raise BadRequest("limits: expected an object", "limits")
    known = set(Limits.__dataclass_fields__)
    bad = set(raw) - known
    if bad:
        raise BadRequest(f"limits.{sorted(bad)[0]}: unknown; allowed {', '.join(sorted(known))}", "limits")
    try:
        return Limits(**{k: type(getattr(Limits(), k))(v) for k, v in raw.items()}).validate()
    except (TypeError, ValueError) as e:
        raise BadRequest(f"limits: {e}", "limits") from None


def network_allow(body: dict) -> list | None:
    net = body.get("network")
    if net is None:
        return None
    if not isinstance(net, dict) or set(net) - {"allow"}:
        raise BadRequest("network: expected {\"allow\": [CIDR, ...]}", "network")
    return net.get("allow")


def make_app(rt: Runtime, token: str) -> FastAPI:
    app = FastAPI(title="dsec edge")
    auth = Depends(bearer(token))

    @app.exception_handler(DsecError)
    async def _dsec_error(request: Request, e: DsecError):
        return error_response(e)

    @app.get("/healthz")
    def healthz():
        return {"ok": True, "sandboxes": len(rt.sandboxes)}

    @app.get("/edge/v1/sandboxes", dependencies=[auth])
    def list_():
        return [s.info() for s in rt.sandboxes.values()]

    @app.post("/edge/v1/sandboxes", dependencies=[auth])
    def create(body: dict = Body(...)):
        s = rt.create(image=body.get("image", "busybox"), substrate=body.get("substrate", "container"),
                      limits=limits_from(body), sid=body.get("sandbox_id"), snapshot=body.get("snapshot_id"),
                      replay_from=body.get("replay_from"), allow=network_allow(body),
                      rerun_idempotent=bool(body.get("rerun_idempotent", False)))
        return {**s.info(), "restore": s.restore_info}

    @app.delete("/edge/v1/sandboxes/{sid}", dependencies=[auth])
    def kill(sid: str):
        rt.kill(sid)
        return {"killed": sid}

    @app.post("/edge/v1/sandboxes/{sid}/exec", dependencies=[auth])
    def exec_(sid: str, body: dict = Body(...)):
        s = rt.get(sid)
        kw = dict(cmd=body.get("cmd"), cwd=body.get("cwd") or "/", env=body.get("env") or {},
                  timeout=float(body.get("timeout", 60)), idempotent=bool(body.get("idempotent", False)),
                  seq=body.get("seq"))
        if not body.get("stream"):
            return s.exec(**kw)
        q: queue.Queue = queue.Queue()

        def run():
            try:
                res = s.exec(**kw, on_output=lambda stream, data: q.put({stream: data.decode(errors="replace")}))
                q.put({"result": res})
            except DsecError as e:
                q.put({"error": str(e), "field": e.field, "status": e.status})
            q.put(None)

        threading.Thread(target=run, daemon=True).start()

        def gen():
            while (item := q.get()) is not None:
                yield json.dumps(item) + "\n"

        return StreamingResponse(gen(), media_type="application/x-ndjson")

    @app.get("/edge/v1/sandboxes/{sid}/files", dependencies=[auth])
    def read(sid: str, path: str = Query(...)):
        return Response(rt.get(sid).files.read(path), media_type="application/octet-stream")

    @app.get("/edge/v1/sandboxes/{sid}/files/list", dependencies=[auth])
    def list_files(sid: str, path: str = Query("/")):
        return rt.get(sid).files.list(path)

    @app.put("/edge/v1/sandboxes/{sid}/files", dependencies=[auth])
    async def write(sid: str, request: Request, path: str = Query(...), mode: int = Query(0o644), seq: int | None = None):
        data = await request.body()
        return rt.get(sid).write_files([(path, data, mode)], seq=seq)

    @app.post("/edge/v1/sandboxes/{sid}/files/upload", dependencies=[auth])
    def upload(sid: str, body: dict = Body(...)):
        items = []
        for i, f in enumerate(body.get("files") or []):
            try:
                items.append((f["path"], base64.b64decode(f.get("data", ""), validate=True), int(f.get("mode", 0o644))))
            except (KeyError, ValueError, TypeError) as e:
                raise BadRequest(f"files[{i}]: needs path and base64 data ({e})", f"files[{i}]") from None
        if not items:
            raise BadRequest("files: at least one file is needed", "files")
        return rt.get(sid).write_files(items, seq=body.get("seq"))

    @app.delete("/edge/v1/sandboxes/{sid}/files", dependencies=[auth])
    def remove(sid: str, path: str = Query(...)):
        return rt.get(sid).remove_file(path)

    @app.post("/edge/v1/sandboxes/{sid}/snapshot", dependencies=[auth])
    def snapshot(sid: str):
        return rt.get(sid).snapshot()

    @app.post("/edge/v1/sandboxes/{sid}/restore", dependencies=[auth])
    def restore(sid: str, body: dict = Body(...)):
        s = rt.get(sid)
        out = s.restore(body.get("snapshot_id", ""), body.get("replay_from"), bool(body.get("rerun_idempotent")))
        return {**out, "chain": s.rootfs.chain}

    return app


class Heartbeat(threading.Thread):
    """Registers the edge, then heartbeats; re-registers when the apiserver forgets it."""

    def __init__(self, apiserver: str, token: str, edge_id: str, url: str, every: float = 1.0):
        super().__init__(daemon=True)
        self.api, self.edge_id, self.url, self.every = apiserver.rstrip("/"), edge_id, url, every
        self.headers = {"Authorization": f"Bearer {token}"}
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


def serve(home: str, apiserver: str, token: str, edge_id: str, host: str = "127.0.0.1", port: int = 0,
          pool_size: int = 2, heartbeat_s: float = 1.0) -> None:
    import socket

    import uvicorn

    rt = Runtime(home, pool_size=pool_size)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    url = f"http://{host}:{sock.getsockname()[1]}"
    hb = Heartbeat(apiserver, token, edge_id, url, heartbeat_s)
    hb.start()
    server = uvicorn.Server(uvicorn.Config(make_app(rt, token), log_level="warning", timeout_keep_alive=30))
    quiet_after_shutdown()
    try:
        server.run(sockets=[sock])
    finally:
        hb.stop.set()
        rt.close()
