"""The OpenAI-compatible HTTP API: the app, its edge (auth, request ids, CORS, OpenAI-shaped
errors for everything, limits) and the small endpoints: health, version, models, tokenize,
detokenize, metrics. Completions and chat live in ``serve/completions.py``."""

from __future__ import annotations

import asyncio
import hmac
import json
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, PlainTextResponse

from v4stack.serve import metrics as prom
from v4stack.serve.chat_template import ChatTemplate
from v4stack.serve.limits import EdgeError, ServerOptions, parse_json, read_body, request_id
from v4stack.serve.protocol import Unsupported, _Strict
from v4stack.serve.render import error_body
from v4stack.serve.runner import EngineRunner
from v4stack.tokenizer import ByteTokenizer

_PROTECTED = ("/v1/", "/tokenize", "/detokenize")
_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function", "literal"}


class Json(JSONResponse):
    """ASCII-only JSON (nothing a client sent can make rendering fail), NaN refused."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
          headers: dict | None = None, code=None) -> Json:
    return Json(error_body(message, kind, param, code), status_code=status, headers=headers)


def _param(loc) -> str:
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif isinstance(p, str) and not ("[" in p or "(" in p or p.lower() in _TAGS or p[:1].isupper()):
            parts.append(("." if parts else "") + p)
    return "".join(parts) or "body"


def validation_error(e: ValidationError) -> EdgeError:
    first = e.errors(include_url=False)[0]
    param = _param(first.get("loc", ()))
    msg = "unknown field" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid value")
    return EdgeError(400, f"{param}: {msg}", param)


class EdgeMiddleware:
    """Bearer auth on the API routes, ``X-Request-Id`` checked and echoed on every response."""

    def __init__(self, app, api_key: str | None):
        self.app, self.key = app, api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        raw = headers.get(b"x-request-id")
        try:
            scope["v4_rid"] = request_id(raw.decode("latin-1")) if raw is not None else None
        except EdgeError as e:
            return await error(e.status, e.message, e.param)(scope, receive, send)
        path = scope.get("path", "")
        if self.key is not None and scope.get("method") != "OPTIONS" and path.startswith(_PROTECTED):
            auth = headers.get(b"authorization", b"")
            if not (auth.startswith(b"Bearer ") and hmac.compare_digest(auth[7:].strip(), self.key)):
                return await error(401, "invalid or missing API key (Authorization: Bearer <key>)", None,
                                   "authentication_error", {"WWW-Authenticate": "Bearer"})(scope, receive, send)

        async def send_rid(msg):
            if msg["type"] == "http.response.start" and scope.get("v4_rid"):
                msg = {**msg, "headers": list(msg.get("headers", [])) + [(b"x-request-id", scope["v4_rid"].encode())]}
            await send(msg)

        await self.app(scope, receive, send_rid)


class Edge:
    """Shared by the handlers: the runner, options, template, metrics and the request checks."""

    def __init__(self, app: FastAPI, runner: EngineRunner, model_name: str, opts: ServerOptions):
        self.app, self.runner, self.model_name, self.opts = app, runner, model_name, opts
        self.tok = ByteTokenizer()
        self.template = ChatTemplate(opts.chat_template)
        self.metrics = prom.ApiMetrics()
        self.inflight = 0  # engine requests submitted by the API and not yet finished
        self.draining = False

    @property
    def max_context(self) -> int:
        return self.runner.engine.max_context

    async def body(self, http: Request, model: type[_Strict]):
        if self.draining:
            self.metrics.rejected[503] += 1
            raise EdgeError(503, "the server is shutting down", None, "service_unavailable", {"Retry-After": "5"})
        raw = await read_body(http, self.opts.max_body_bytes)
        if len(raw) > 1 << 16:  # keep the event loop free while a large body parses
            obj = await asyncio.to_thread(parse_json, raw, self.opts.max_json_depth)
        else:
            obj = parse_json(raw, self.opts.max_json_depth)
        try:
            body = model.model_validate(obj)
        except ValidationError as e:
            raise validation_error(e) from None
        if hasattr(body, "check"):
            try:
                body.check(self.opts)
            except Unsupported as e:
                raise EdgeError(400, str(e), e.param) from None
        if getattr(body, "model", self.model_name) not in (self.model_name, None):
            raise EdgeError(404, f"the model {body.model!r} does not exist (serving {self.model_name!r})",
                            "model", code="model_not_found")
        return body

    def admit(self, n_jobs: int) -> None:
        """Refuse with 429 when the engine already holds ``max_running + max_queue`` requests."""
        limit = self.runner.engine.config.max_running + self.opts.max_queue
        if self.inflight + n_jobs > limit:
            self.metrics.rejected[429] += 1
            raise EdgeError(429, f"too many requests in flight ({self.inflight}, limit {limit}); retry later",
                            None, "rate_limit_error", {"Retry-After": "1"})

    def check_prompt(self, prompt: list[int], params, field: str) -> None:
        try:
            self.runner.engine.validate(prompt, params)
        except ValueError as err:
            msg = str(err)
            param = field if ("prompt" in msg or "exceeds" in msg) else msg.split(" ", 1)[0]
            raise EdgeError(400, msg, param) from None


def _edge_error(status_kind: EdgeError):
    return error(status_kind.status, status_kind.message, status_kind.param, status_kind.kind, status_kind.headers,
                 getattr(status_kind, "code", None))


def build_app(runner: EngineRunner, model_name: str, options: ServerOptions | None = None) -> FastAPI:
    opts = (options or ServerOptions()).validate()
    opts.vocab_size = runner.engine.model.cfg.vocab_size
    app = FastAPI(title="v4stack", version=_version(), docs_url=None, redoc_url=None, openapi_url=None)
    edge = Edge(app, runner, model_name, opts)
    app.state.runner, app.state.edge = runner, edge
    app.add_middleware(EdgeMiddleware, api_key=opts.api_key)
    if opts.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=opts.allowed_origins, allow_methods=opts.allowed_methods,
                           allow_headers=opts.allowed_headers, allow_credentials=opts.allow_credentials,
                           expose_headers=["X-Request-Id"])

    @app.exception_handler(EdgeError)
    async def _edge(_req: Request, e: EdgeError):
        return _edge_error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http(req: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error(e.status_code, f"{e.detail}: {req.method} {req.url.path}", None, kind,
                     dict(e.headers or {}), e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, e: RequestValidationError):
        first = (e.errors() or [{}])[0]
        param = _param(first.get("loc", ())[1:])
        return error(400, f"{param}: {first.get('msg', 'invalid')}", param)

    @app.exception_handler(Exception)
    async def _internal(_req: Request, e: Exception):
        return error(500, f"internal error ({type(e).__name__})", None, "server_error")

    @app.get("/health")
    async def health():
        return Json({"status": "ok", "engine_error": runner.last_error})

    @app.get("/version")
    async def version():
        return Json({"version": _version()})

    def _model_card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "v4stack", "root": model_name,
                "parent": None, "max_model_len": edge.max_context}

    @app.get("/v1/models")
    async def models():
        return Json({"object": "list", "data": [_model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise EdgeError(404, f"the model {model_id!r} does not exist", "model", "not_found_error")
        return Json(_model_card())

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prom.render(runner, edge.metrics, model_name, edge.inflight), media_type="text/plain; version=0.0.4")

    from v4stack.serve import completions

    completions.mount(app, edge)
    return app


def _version() -> str:
    try:
        return metadata.version("v4stack")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"
