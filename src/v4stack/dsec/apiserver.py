"""The apiserver: the public sandbox API (bearer auth), placement on edges, state in SQLite.

Verbs on a sandbox are forwarded to the edge that runs it. The trajectory log is read straight
from shared storage, so it answers even when that edge is dead.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from v4stack.dsec.auth import bearer
from v4stack.dsec.errors import BadRequest, Conflict, DsecError, NotFound, Unavailable
from v4stack.dsec.rootfs import read_snapshot
from v4stack.dsec.runtime import new_id
from v4stack.dsec.store import Store
from v4stack.dsec.trajlog import query

DEFAULT_TIMEOUT = 3600.0
DEFAULT_IDLE = 600.0


def _num(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    try:
        v = float(v)
    except (TypeError, ValueError):
        raise BadRequest(f"{key}={v!r}: expected a number of seconds", key) from None
    if not lo <= v <= hi:
        raise BadRequest(f"{key}={v}: allowed {lo} .. {hi} seconds", key)
    return v


def make_app(home: str | Path, token: str, db_path: str | Path | None = None) -> FastAPI:
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    store = Store(db_path or home / "dsec.sqlite")
    store.x("UPDATE sandboxes SET busy=0")  # requests in flight died with the previous apiserver
    app = FastAPI(title="dsec apiserver")
    app.state.store = store
    auth = Depends(bearer(token))
    headers = {"Authorization": f"Bearer {token}"}
    http = httpx.Client(timeout=httpx.Timeout(3700, connect=5), headers=headers,
                        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))

    @app.exception_handler(DsecError)
    async def _dsec_error(request: Request, e: DsecError):
        return JSONResponse({"error": str(e), "field": e.field, "kind": type(e).__name__}, status_code=e.status)

    def live(sid: str, allow_paused: bool = False) -> dict:
        row = store.sandbox(sid)
        if row is None:
            raise NotFound(f"sandbox_id={sid!r}: no such sandbox", "sandbox_id")
        ok = ("running", "paused") if allow_paused else ("running",)
        if row["state"] not in ok:
            raise Conflict(f"sandbox_id={sid!r}: is {row['state']}" + (f" ({row['reason']})" if row["reason"] else ""),
                           "sandbox_id")
        return row

    def edge_url(row: dict) -> str:
        e = store.edge(row["edge"])
        if e is None or e["state"] != "alive":
            raise Unavailable(f"sandbox_id={row['id']!r}: its edge {row['edge']} is not alive", "sandbox_id")
        return e["url"]

    def forward(row: dict, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = http.request(method, f"{edge_url(row)}/edge/v1/sandboxes/{row['id']}{path}", **kw)
        except httpx.HTTPError as e:
            raise Unavailable(f"sandbox_id={row['id']!r}: edge unreachable ({type(e).__name__})", "sandbox_id") from None
        return r

    def relay(r: httpx.Response):
        ctype = r.headers.get("content-type", "")
        if ctype.startswith("application/json"):
            return JSONResponse(r.json(), status_code=r.status_code)
        return Response(r.content, status_code=r.status_code, media_type=ctype or None)

    # -- edges --------------------------------------------------------------------------------
    @app.post("/v1/edges/register", dependencies=[auth])
    def register(body: dict = Body(...)):
        eid, url = body.get("edge_id"), body.get("url")
        if not isinstance(eid, str) or not eid:
            raise BadRequest("edge_id: a non-empty string is required", "edge_id")
        if not isinstance(url, str) or not url.startswith("http://"):
            raise BadRequest("url: an http:// address is required", "url")
        store.upsert_edge(eid, url)
        return {"edge_id": eid}

    @app.post("/v1/edges/{eid}/heartbeat", dependencies=[auth])
    def heartbeat(eid: str):
        if not store.heartbeat(eid):
            raise NotFound(f"edge_id={eid!r}: not registered", "edge_id")
        return {"ok": True}

    @app.get("/v1/edges", dependencies=[auth])
    def edges():
        return store.q("SELECT * FROM edges")

    # -- sandboxes ----------------------------------------------------------------------------
    @app.post("/v1/sandboxes", dependencies=[auth])
    def create(body: dict = Body(default={})):
        timeout = _num(body, "timeout", DEFAULT_TIMEOUT, 1, 7 * 86400)
        idle = _num(body, "idle_timeout", DEFAULT_IDLE, 1, 7 * 86400)
        substrate = body.get("substrate", "container")
        if substrate not in ("process", "container"):
            raise BadRequest(f"substrate={substrate!r}: allowed process, container", "substrate")
        snap = body.get("snapshot_id")
        image = body.get("image", "busybox")
        if snap:
            image = read_snapshot(home, snap)["image"]
        edges_ = store.alive_edges()
        if body.get("edge"):  # explicit placement
            edges_ = [e for e in edges_ if e["id"] == body["edge"]]
            if not edges_:
                raise Unavailable(f"edge={body['edge']!r}: not an alive edge", "edge")
        if not edges_:
            raise Unavailable("no alive edge to place the sandbox on", "edge")
        sid = new_id("sbx")
        edge = edges_[0]
        store.add_sandbox(sid, edge["id"], image, substrate, timeout, idle, body.get("limits") or {}, snap)
        payload = {k: body.get(k) for k in ("image", "substrate", "limits", "snapshot_id", "replay_from", "network",
                                        "rerun_idempotent")}
        payload.update(sandbox_id=sid, substrate=substrate, image=image)
        try:
            r = http.post(f"{edge['url']}/edge/v1/sandboxes", json=payload)
        except httpx.HTTPError as e:
            store.set_state(sid, "failed", f"edge unreachable: {type(e).__name__}")
            raise Unavailable(f"edge {edge['id']} unreachable while creating", "edge") from None
        if r.status_code != 200:
            store.set_state(sid, "failed", r.text[:300])
            return relay(r)
        info = r.json()
        store.set_chain(sid, info.get("chain", []), snap)
        store.set_state(sid, "running")
        return {**info, "id": sid, "edge": edge["id"], "state": "running"}

    def view(row: dict) -> dict:
        out = {k: row[k] for k in ("id", "edge", "image", "substrate", "state", "reason", "created", "timeout",
                                   "idle_timeout", "parent_snapshot")}
        out["active_seconds"] = store.active_seconds(row)
        out["chain"] = json.loads(row["chain"])
        return out

    @app.get("/v1/sandboxes", dependencies=[auth])
    def list_(state: str | None = None):
        return [view(r) for r in store.sandboxes(state)]

    @app.get("/v1/sandboxes/{sid}", dependencies=[auth])
    def get(sid: str):
        row = store.sandbox(sid)
        if row is None:
            raise NotFound(f"sandbox_id={sid!r}: no such sandbox", "sandbox_id")
        return view(row)

    @app.delete("/v1/sandboxes/{sid}", dependencies=[auth])
    def kill(sid: str):
        row = live(sid, allow_paused=True)
        r = forward(row, "DELETE", "")
        store.set_state(sid, "killed", "by request")
        return relay(r) if r.status_code != 200 else {"killed": sid}

    @app.post("/v1/sandboxes/{sid}/pause", dependencies=[auth])
    def pause(sid: str):
        live(sid, allow_paused=True)
        store.pause(sid)
        return view(store.sandbox(sid))

    @app.post("/v1/sandboxes/{sid}/resume", dependencies=[auth])
    def resume(sid: str):
        live(sid, allow_paused=True)
        store.resume(sid)  # resuming a running sandbox is a no-op, not an error
        return view(store.sandbox(sid))

    @app.post("/v1/sandboxes/{sid}/exec", dependencies=[auth])
    def exec_(sid: str, body: dict = Body(...)):
        row = live(sid)
        store.touch(sid)
        if body.get("stream"):
            url = f"{edge_url(row)}/edge/v1/sandboxes/{sid}/exec"
            try:
                r = http.send(http.build_request("POST", url, json=body), stream=True)
            except httpx.HTTPError as e:
                raise Unavailable(f"sandbox_id={sid!r}: edge unreachable ({type(e).__name__})", "sandbox_id") from None
            if r.status_code >= 400:  # refused before it ran: keep the status
                r.read()
                r.close()
                return relay(r)

            def gen():
                store.busy(sid, +1)
                try:
                    for line in r.iter_lines():
                        yield line + "\n"
                except httpx.HTTPError as e:
                    yield json.dumps({"error": f"edge connection lost: {type(e).__name__}", "status": 503}) + "\n"
                finally:
                    r.close()
                    store.busy(sid, -1)

            return StreamingResponse(gen(), media_type="application/x-ndjson")
        store.busy(sid, +1)
        try:
            return relay(forward(row, "POST", "/exec", json=body))
        finally:
            store.busy(sid, -1)

    @app.get("/v1/sandboxes/{sid}/files", dependencies=[auth])
    def read(sid: str, path: str = Query(...)):
        return relay(forward(live(sid), "GET", "/files", params={"path": path}))

    @app.get("/v1/sandboxes/{sid}/files/list", dependencies=[auth])
    def list_files(sid: str, path: str = Query("/")):
        return relay(forward(live(sid), "GET", "/files/list", params={"path": path}))

    @app.put("/v1/sandboxes/{sid}/files", dependencies=[auth])
    async def write(sid: str, request: Request, path: str = Query(...), mode: int = Query(0o644)):
        data = await request.body()
        row = live(sid)
        store.touch(sid)
        return relay(forward(row, "PUT", "/files", params={"path": path, "mode": mode}, content=data))

    @app.post("/v1/sandboxes/{sid}/files/upload", dependencies=[auth])
    def upload(sid: str, body: dict = Body(...)):
        row = live(sid)
        store.touch(sid)
        return relay(forward(row, "POST", "/files/upload", json=body))

    @app.delete("/v1/sandboxes/{sid}/files", dependencies=[auth])
    def remove(sid: str, path: str = Query(...)):
        return relay(forward(live(sid), "DELETE", "/files", params={"path": path}))

    @app.post("/v1/sandboxes/{sid}/snapshot", dependencies=[auth])
    def snapshot(sid: str):
        row = live(sid, allow_paused=True)
        r = forward(row, "POST", "/snapshot")
        if r.status_code == 200:
            doc = r.json()
            store.add_snapshot(doc)
            store.set_chain(sid, doc["layers"], doc["id"])
        return relay(r)

    @app.post("/v1/sandboxes/{sid}/restore", dependencies=[auth])
    def restore(sid: str, body: dict = Body(...)):
        row = live(sid, allow_paused=True)
        r = forward(row, "POST", "/restore", json=body)
        if r.status_code == 200:
            store.set_chain(sid, r.json()["chain"], body.get("snapshot_id"))
        return relay(r)

    @app.post("/v1/sandboxes/{sid}/fork", dependencies=[auth])
    def fork(sid: str, body: dict = Body(default={})):
        snap = body.get("snapshot_id")
        if not snap:
            resp = snapshot(sid)
            if resp.status_code != 200:
                return resp
            snap = json.loads(resp.body)["id"]
        row = store.sandbox(sid)
        return create({"snapshot_id": snap, "substrate": row["substrate"], "limits": json.loads(row["limits"]),
                       "timeout": row["timeout"], "idle_timeout": row["idle_timeout"]})

    @app.get("/v1/sandboxes/{sid}/log", dependencies=[auth])
    def log(sid: str, since: int = 0, path: str | None = None):
        if store.sandbox(sid) is None:
            raise NotFound(f"sandbox_id={sid!r}: no such sandbox", "sandbox_id")
        out = query(home / "logs" / sid, since, path)
        row = store.sandbox(sid)
        if row["state"] == "running":  # a request in flight is not (yet) an unknown outcome
            out["in_flight"] = out["unknown_outcome"][-1:] if out["unknown_outcome"] else []
        return out

    @app.get("/v1/snapshots/{snap}", dependencies=[auth])
    def get_snapshot(snap: str):
        return read_snapshot(home, snap)

    @app.get("/healthz")
    def healthz():
        return {"ok": True, "time": time.time()}

    return app
