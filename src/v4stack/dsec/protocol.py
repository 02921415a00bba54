"""Every request body of the apiserver and the edge as a pydantic model, and the error shape.

Models are strict (no "3" for 3, no true for 1), forbid unknown keys, refuse NaN and Infinity, and
bound every size. Identifiers carry their fixed pattern (``validate.PATTERNS``). A failed check is
a 400 whose body names the field: ``{"error", "field", "kind"}`` - the same shape every DsecError
takes. Responses are JSON with non-ASCII escaped, so a file name that is not UTF-8 is still
answered (as a ``\\udcXX`` escape) rather than failing the response.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Optional, Union

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from v4stack.dsec.errors import DsecError, TooLarge
from v4stack.dsec.files import MAX_FILE
from v4stack.dsec.validate import MAX_PATH, PATTERNS


def _id(kind: str):
    return Annotated[str, StringConstraints(pattern=f"^{PATTERNS[kind].pattern}$")]


SandboxId, SnapshotId, EdgeId = _id("sandbox_id"), _id("snapshot_id"), _id("edge_id")
ImageRef = Annotated[str, StringConstraints(pattern=f"^({PATTERNS['image_id'].pattern}|{PATTERNS['image_name'].pattern})$")]
Seconds = Annotated[float, Field(allow_inf_nan=False, ge=1, le=7 * 86400)]
Seq = Annotated[int, Field(ge=0, lt=1 << 62)]
Arg = Annotated[str, StringConstraints(max_length=65536)]
NO_NUL = r"^[^\x00]+$"
InnerPath = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATH, pattern=NO_NUL)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class LimitsBody(Strict):
    memory_bytes: Annotated[int, Field(ge=16 << 20, le=64 << 30)] = 256 << 20
    pids: Annotated[int, Field(ge=8, le=65536)] = 128
    cpu_quota: Annotated[float, Field(allow_inf_nan=False, ge=0.01, le=64)] = 1.0
    disk_bytes: Annotated[int, Field(ge=1 << 20, le=64 << 30)] = 256 << 20


class NetworkBody(Strict):
    allow: Annotated[list[Annotated[str, StringConstraints(max_length=64)]], Field(max_length=64)] = []


class CreateBody(Strict):
    image: ImageRef = "busybox"
    substrate: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9-]{0,31}$")] = "container"
    limits: Optional[LimitsBody] = None
    timeout: Seconds = 3600.0
    idle_timeout: Seconds = 600.0
    edge: Optional[EdgeId] = None
    snapshot_id: Optional[SnapshotId] = None
    replay_from: Optional[SandboxId] = None
    rerun_idempotent: bool = False
    network: Optional[NetworkBody] = None


class EdgeCreateBody(Strict):
    """What the apiserver sends an edge (the ids are the apiserver's)."""

    sandbox_id: SandboxId
    image: ImageRef
    substrate: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9-]{0,31}$")]
    limits: Optional[LimitsBody] = None
    snapshot_id: Optional[SnapshotId] = None
    replay_from: Optional[SandboxId] = None
    rerun_idempotent: bool = False
    network: Optional[NetworkBody] = None


class ExecBody(Strict):
    cmd: Union[Annotated[str, StringConstraints(min_length=1, max_length=256 << 10)],
               Annotated[list[Arg], Field(min_length=1, max_length=4096)]]
    cwd: InnerPath = "/"
    env: Annotated[dict[Annotated[str, StringConstraints(max_length=128)], Arg], Field(max_length=256)] = {}
    timeout: Annotated[float, Field(allow_inf_nan=False, gt=0, le=3600)] = 60.0
    idempotent: bool = False
    seq: Optional[Seq] = None
    stream: bool = False


class UploadItem(Strict):
    path: InnerPath
    data: Annotated[str, StringConstraints(max_length=(64 << 20) * 4 // 3 + 4)] = ""
    mode: Annotated[int, Field(ge=0, le=0o1777)] = 0o644


class UploadBody(Strict):
    files: Annotated[list[UploadItem], Field(min_length=1, max_length=1000)]
    seq: Optional[Seq] = None


class RestoreBody(Strict):
    snapshot_id: SnapshotId
    replay_from: Optional[SandboxId] = None
    rerun_idempotent: bool = False


class ForkBody(Strict):
    snapshot_id: Optional[SnapshotId] = None


class RegisterBody(Strict):
    edge_id: EdgeId
    url: Annotated[str, StringConstraints(pattern=r"^http://[A-Za-z0-9.\-\[\]:]{1,200}$")]


State = Literal["creating", "running", "paused", "lost", "failed", "killed", "expired"]


class AsciiJSON(JSONResponse):
    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


async def read_body(request: Request, cap: int = MAX_FILE) -> bytes:
    """The request body, refused (413, field data) past ``cap`` bytes without buffering more."""
    n = request.headers.get("content-length")
    if n is not None and (not n.isdigit() or int(n) > cap):
        raise TooLarge(f"data: the body is over the {cap}-byte limit", "data")
    chunks, size = [], 0
    async for c in request.stream():
        size += len(c)
        if size > cap:
            raise TooLarge(f"data: the body is over the {cap}-byte limit", "data")
        chunks.append(c)
    return b"".join(chunks)


def error_body(message: str, field: str | None, kind: str) -> dict:
    return {"error": message, "field": field, "kind": kind}


def install_errors(app) -> None:
    """DsecError -> its status; a failed model or parameter check -> 400 naming the field."""

    @app.exception_handler(DsecError)
    async def _dsec(request: Request, e: DsecError):
        return AsciiJSON(error_body(str(e), e.field, type(e).__name__), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path", "header"):  # where it came from, not a field
            loc = loc[1:]
        # a union's branch names (str, list[...]) and model class names are not fields
        loc = [x for x in loc if not x.startswith(("str", "list[", "constrained-str", "function-"))]
        field = ".".join(loc) or "body"
        return AsciiJSON(error_body(f"{field}: {first.get('msg', 'invalid')}", field, "BadRequest"), status_code=400)
