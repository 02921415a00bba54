"""The apiserver: the public sandbox API (client tokens, one tenant each), placement on edges,
state in SQLite.

Verbs on a sandbox are forwarded to the edge that runs it with the control credential (see
``auth``). The trajectory log is read straight from shared storage, so it answers even when that
edge is dead. Nothing here blocks the event loop on sandbox work: long verbs (exec, uploads) are
forwarded with an async client, short ones run in the thread pool, and the edges' heartbeat and
registration are answered on the loop itself so a busy pool never makes a live edge look dead.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
import json
import time
from pathlib import Path
from typing import Annotated, Optional

import httpx
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from fastapi import Body, Depends, FastAPI, Path as FPath, Query, Request
from fastapi.responses import Response, StreamingResponse

from v4stack.dsec.auth import Credentials, bearer, tenant_of
from v4stack.dsec.errors import Conflict, DsecError, NotFound, Unavailable
from v4stack.dsec.files import MAX_FILE
from v4stack.dsec.lifecycle import adopt_edge
from v4stack.dsec.mounts import private_dir
from v4stack.dsec.protocol import (AsciiJSON, read_body, CreateBody, EdgeCreateBody, ExecBody, ForkBody, RegisterBody,
                                   RestoreBody, State, UploadBody, install_errors)
from v4stack.dsec.rootfs import read_snapshot
from v4stack.dsec.runtime import new_id
from v4stack.dsec.store import Store
from v4stack.dsec.trajlog import query
from v4stack.dsec.validate import MAX_PATH, PATTERNS

SID = Annotated[str, FPath(pattern=f"^{PATTERNS['sandbox_id'].pattern}$")]
SNAP = Annotated[str, FPath(pattern=f"^{PATTERNS['snapshot_id'].pattern}$")]
EID = Annotated[str, FPath(pattern=f"^{PATTERNS['edge_id'].pattern}$")]
PathQ = Annotated[str, Query(min_length=1, max_length=MAX_PATH, pattern=r"^[^\x00]+$")]
ModeQ = Annotated[int, Query(ge=0, le=0o1777)]


def make_app(home: str | Path, creds: Credentials, db_path: str | Path | None = None) -> FastAPI:
    home = private_dir(Path(home))
    store = Store(db_path or home / "dsec.sqlite")
    store.x("UPDATE sandboxes SET busy=0")  # requests in flight died with the previous apiserver
    headers = {"Authorization": f"Bearer {creds.control}"}
    http = httpx.Client(timeout=httpx.Timeout(60, connect=5), headers=headers,
                        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
    ahttp = httpx.AsyncClient(timeout=httpx.Timeout(3700, connect=5), headers=headers,
                              limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64))

    @asynccontextmanager
    async def lifespan(app):
        async def adopt_all():  # an apiserver restart re-adopts what the edges still run
            for e in await asyncio.to_thread(store.alive_edges):
                await asyncio.to_thread(adopt_edge, store, http, e)

        task = asyncio.get_running_loop().create_task(adopt_all())
        yield
        task.cancel()
        await ahttp.aclose()
        http.close()

    app = FastAPI(title="dsec apiserver", default_response_class=AsciiJSON, lifespan=lifespan)
    app.state.store = store
    install_errors(app)
    client = Depends(tenant_of(creds))
    edge_auth = Depends(bearer(creds.edge))

    def live(sid: str, tenant: str, allow_paused: bool = False) -> dict:
        row = store.sandbox(sid)
        if row is None or row["tenant"] != tenant:
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
            return http.request(method, f"{edge_url(row)}/edge/v1/sandboxes/{row['id']}{path}", **kw)
        except httpx.HTTPError as e:
            raise Unavailable(f"sandbox_id={row['id']!r}: edge unreachable ({type(e).__name__})", "sandbox_id") from None

    async def aforward(row: dict, method: str, path: str, **kw) -> httpx.Response:
        try:
            return await ahttp.request(method, f"{edge_url(row)}/edge/v1/sandboxes/{row['id']}{path}", **kw)
        except httpx.HTTPError as e:
            raise Unavailable(f"sandbox_id={row['id']!r}: edge unreachable ({type(e).__name__})", "sandbox_id") from None

    def relay(r: httpx.Response):
        ctype = r.headers.get("content-type", "")
        if ctype.startswith("application/json"):
            try:
                return AsciiJSON(r.json(), status_code=r.status_code)
            except ValueError:
                pass
        return Response(r.content, status_code=r.status_code, media_type=ctype or None)

    # -- edges (edge credential) ----------------------------------------------------------------
    @app.post("/v1/edges/register", dependencies=[edge_auth])
    async def register(body: RegisterBody):
        store.upsert_edge(body.edge_id, body.url)
        e = store.edge(body.edge_id)
        asyncio.get_running_loop().create_task(asyncio.to_thread(adopt_edge, store, http, e))
        return {"edge_id": body.edge_id}

    @app.post("/v1/edges/{eid}/heartbeat", dependencies=[edge_auth])
    async def heartbeat(eid: EID):
        if not store.heartbeat(eid):
            raise NotFound(f"edge_id={eid!r}: not registered", "edge_id")
        return {"ok": True}

    @app.get("/v1/edges", dependencies=[client])
    def edges():
        return [{k: e[k] for k in ("id", "state", "last_seen", "registered")} for e in store.q("SELECT * FROM edges")]

    # -- sandboxes ----------------------------------------------------------------------------
    def create_for(tenant: str, body: CreateBody):
        image = body.image
        if body.snapshot_id:
            row = store.snapshot(body.snapshot_id)
            if row is None or row["tenant"] != tenant:
                raise NotFound(f"snapshot_id={body.snapshot_id!r}: no such snapshot", "snapshot_id")
            image = read_snapshot(home, body.snapshot_id)["image"]
        if body.replay_from:
            src = store.sandbox(body.replay_from)
            if src is None or src["tenant"] != tenant:
                raise NotFound(f"replay_from={body.replay_from!r}: no such sandbox", "replay_from")
        from v4stack.dsec import substrates

        substrates.cls(body.substrate)  # 400 naming the field for an unknown one
        edges_ = store.alive_edges()
        if body.edge:  # explicit placement
            edges_ = [e for e in edges_ if e["id"] == body.edge]
            if not edges_:
                if store.edge(body.edge) is None:
                    raise NotFound(f"edge={body.edge!r}: no such edge", "edge")
                raise Unavailable(f"edge={body.edge!r}: not an alive edge", "edge")
        if not edges_:
            raise Unavailable("no alive edge to place the sandbox on", "edge")
        sid = new_id("sbx")
        edge = edges_[0]
        limits = body.limits.model_dump() if body.limits else {}
        store.add_sandbox(sid, edge["id"], image, body.substrate, body.timeout, body.idle_timeout, limits,
                          body.snapshot_id, tenant)
        payload = EdgeCreateBody(sandbox_id=sid, image=image, substrate=body.substrate, limits=body.limits,
                                 snapshot_id=body.snapshot_id, replay_from=body.replay_from,
                                 rerun_idempotent=body.rerun_idempotent, network=body.network)
        try:
            r = http.post(f"{edge['url']}/edge/v1/sandboxes", json=payload.model_dump(exclude_none=True),
                          timeout=httpx.Timeout(600, connect=5))
        except httpx.HTTPError as e:
            # the edge may still have made it: the watcher asks the edge before calling it failed
            store.set_state(sid, "creating", f"edge unreachable while creating: {type(e).__name__}")
            raise Unavailable(f"edge {edge['id']} unreachable while creating", "edge") from None
        if r.status_code != 200:
            store.set_state(sid, "failed", r.text[:300])
            return relay(r)
        info = r.json()
        store.set_chain(sid, info.get("chain", []), body.snapshot_id)
        store.set_state(sid, "running")
        return {**info, "id": sid, "edge": edge["id"], "state": "running"}

    @app.post("/v1/sandboxes")
    def create(tenant: str = client, body: CreateBody = Body(default=None)):
        return create_for(tenant, body or CreateBody())

    def view(row: dict) -> dict:
        out = {k: row[k] for k in ("id", "edge", "image", "substrate", "state", "reason", "created", "timeout",
                                   "idle_timeout", "parent_snapshot")}
        out["active_seconds"] = store.active_seconds(row)
        out["chain"] = json.loads(row["chain"])
        return out

    @app.get("/v1/sandboxes")
    def list_(tenant: str = client, state: Optional[State] = None):
        return [view(r) for r in store.sandboxes(state, tenant)]

    @app.get("/v1/sandboxes/{sandbox_id}")
    def get(sandbox_id: SID, tenant: str = client):
        row = store.sandbox(sandbox_id)
        if row is None or row["tenant"] != tenant:
            raise NotFound(f"sandbox_id={sandbox_id!r}: no such sandbox", "sandbox_id")
        return view(row)

    @app.delete("/v1/sandboxes/{sandbox_id}")
    def kill(sandbox_id: SID, tenant: str = client):
        row = live(sandbox_id, tenant, allow_paused=True)
        r = forward(row, "DELETE", "")
        if r.status_code in (200, 404):  # 404: the edge no longer has it; either way it is gone
            store.set_state(sandbox_id, "killed", "by request")
            return {"killed": sandbox_id}
        return relay(r)

    @app.post("/v1/sandboxes/{sandbox_id}/pause")
    def pause(sandbox_id: SID, tenant: str = client):
        live(sandbox_id, tenant, allow_paused=True)
        store.pause(sandbox_id)
        return view(store.sandbox(sandbox_id))

    @app.post("/v1/sandboxes/{sandbox_id}/resume")
    def resume(sandbox_id: SID, tenant: str = client):
        live(sandbox_id, tenant, allow_paused=True)
        store.resume(sandbox_id)  # resuming a running sandbox is a no-op, not an error
        return view(store.sandbox(sandbox_id))

    @app.post("/v1/sandboxes/{sandbox_id}/exec")
    async def exec_(sandbox_id: SID, body: ExecBody, tenant: str = client):
        row = await asyncio.to_thread(live, sandbox_id, tenant)
        payload = body.model_dump(exclude_none=True)
        await asyncio.to_thread(store.busy, sandbox_id, +1)
        if not body.stream:
            try:
                return relay(await aforward(row, "POST", "/exec", json=payload))
            finally:
                await asyncio.to_thread(store.busy, sandbox_id, -1)
        try:
            req = ahttp.build_request("POST", f"{edge_url(row)}/edge/v1/sandboxes/{sandbox_id}/exec", json=payload)
            r = await ahttp.send(req, stream=True)
        except (httpx.HTTPError, DsecError) as e:
            await asyncio.to_thread(store.busy, sandbox_id, -1)
            if isinstance(e, DsecError):
                raise
            raise Unavailable(f"sandbox_id={sandbox_id!r}: edge unreachable ({type(e).__name__})", "sandbox_id") from None
        if r.status_code >= 400:  # refused before it ran: keep the status
            await r.aread()
            await r.aclose()
            await asyncio.to_thread(store.busy, sandbox_id, -1)
            return relay(r)

        async def gen():
            try:
                async for line in r.aiter_lines():
                    yield line + "\n"
            except httpx.HTTPError as e:
                yield json.dumps({"error": f"edge connection lost: {type(e).__name__}", "status": 503}) + "\n"
            finally:
                await r.aclose()
                await asyncio.to_thread(store.busy, sandbox_id, -1)

        return StreamingResponse(gen(), media_type="application/x-ndjson")

    @app.get("/v1/sandboxes/{sandbox_id}/files")
    async def read(sandbox_id: SID, path: PathQ, tenant: str = client):
        row = await asyncio.to_thread(live, sandbox_id, tenant)
        return relay(await aforward(row, "GET", "/files", params={"path": path}))

    @app.get("/v1/sandboxes/{sandbox_id}/files/list")
    def list_files(sandbox_id: SID, tenant: str = client, path: PathQ = "/"):
        return relay(forward(live(sandbox_id, tenant), "GET", "/files/list", params={"path": path}))

    @app.put("/v1/sandboxes/{sandbox_id}/files")
    async def write(sandbox_id: SID, request: Request, path: PathQ, tenant: str = client, mode: ModeQ = 0o644):
        row = await asyncio.to_thread(live, sandbox_id, tenant)
        data = await read_body(request)
        await asyncio.to_thread(store.touch, sandbox_id)
        return relay(await aforward(row, "PUT", "/files", params={"path": path, "mode": mode}, content=data))

    @app.post("/v1/sandboxes/{sandbox_id}/files/upload")
    async def upload(sandbox_id: SID, request: Request, tenant: str = client):
        row = await asyncio.to_thread(live, sandbox_id, tenant)
        raw = await read_body(request, 2 * MAX_FILE)
        try:
            body = UploadBody.model_validate_json(raw)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        await asyncio.to_thread(store.touch, sandbox_id)
        return relay(await aforward(row, "POST", "/files/upload", content=body.model_dump_json(exclude_none=True),
                                    headers={"content-type": "application/json"}))

    @app.delete("/v1/sandboxes/{sandbox_id}/files")
    def remove(sandbox_id: SID, path: PathQ, tenant: str = client):
        return relay(forward(live(sandbox_id, tenant), "DELETE", "/files", params={"path": path}))

    def snapshot_for(tenant: str, sid: str):
        row = live(sid, tenant, allow_paused=True)
        r = forward(row, "POST", "/snapshot", timeout=600)
        if r.status_code == 200:
            doc = r.json()
            store.add_snapshot(doc, tenant)
            store.set_chain(sid, doc["layers"], doc["id"])
        return r

    @app.post("/v1/sandboxes/{sandbox_id}/snapshot")
    def snapshot(sandbox_id: SID, tenant: str = client):
        return relay(snapshot_for(tenant, sandbox_id))

    @app.post("/v1/sandboxes/{sandbox_id}/restore")
    def restore(sandbox_id: SID, body: RestoreBody, tenant: str = client):
        row = live(sandbox_id, tenant, allow_paused=True)
        snap = store.snapshot(body.snapshot_id)
        if snap is None or snap["tenant"] != tenant:
            raise NotFound(f"snapshot_id={body.snapshot_id!r}: no such snapshot", "snapshot_id")
        if body.replay_from:
            src = store.sandbox(body.replay_from)
            if src is None or src["tenant"] != tenant:
                raise NotFound(f"replay_from={body.replay_from!r}: no such sandbox", "replay_from")
        r = forward(row, "POST", "/restore", json=body.model_dump(exclude_none=True), timeout=600)
        if r.status_code == 200:
            store.set_chain(sandbox_id, r.json()["chain"], body.snapshot_id)
        return relay(r)

    @app.post("/v1/sandboxes/{sandbox_id}/fork")
    def fork(sandbox_id: SID, tenant: str = client, body: ForkBody = Body(default=None)):
        snap = body.snapshot_id if body else None
        if not snap:
            r = snapshot_for(tenant, sandbox_id)
            if r.status_code != 200:
                return relay(r)
            snap = r.json()["id"]
        row = store.sandbox(sandbox_id)
        from v4stack.dsec.protocol import LimitsBody

        limits = json.loads(row["limits"])
        return create_for(tenant, CreateBody(snapshot_id=snap, substrate=row["substrate"],
                                             limits=LimitsBody(**limits) if limits else None,
                                             timeout=row["timeout"], idle_timeout=row["idle_timeout"]))

    @app.get("/v1/sandboxes/{sandbox_id}/log")
    def log(sandbox_id: SID, tenant: str = client, since: Annotated[int, Query(ge=0, lt=1 << 62)] = 0,
            path: Annotated[Optional[str], Query(min_length=1, max_length=MAX_PATH)] = None):
        row = store.sandbox(sandbox_id)
        if row is None or row["tenant"] != tenant:
            raise NotFound(f"sandbox_id={sandbox_id!r}: no such sandbox", "sandbox_id")
        out = query(home / "logs" / sandbox_id, since, path)
        if row["state"] == "running":  # a request in flight is not (yet) an unknown outcome
            out["in_flight"] = out["unknown_outcome"][-1:] if out["unknown_outcome"] else []
        return out

    @app.get("/v1/snapshots/{snapshot_id}")
    def get_snapshot(snapshot_id: SNAP, tenant: str = client):
        row = store.snapshot(snapshot_id)
        if row is None or row["tenant"] != tenant:
            raise NotFound(f"snapshot_id={snapshot_id!r}: no such snapshot", "snapshot_id")
        return read_snapshot(home, snapshot_id)

    @app.get("/healthz")
    async def healthz():
        return {"ok": True, "time": time.time()}

    return app
