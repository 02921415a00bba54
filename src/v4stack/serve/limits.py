"""The API edge's limits and options, and the checks that run before a request reaches pydantic:
body size, JSON that parses, nesting depth, strings that are valid Unicode, request ids."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from starlette.requests import ClientDisconnect, Request


class EdgeError(Exception):
    """An OpenAI-shaped error answered before any work: status, message, the field it names."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers or {}
        self.code = code


@dataclass
class ServerOptions:
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)  # CORS; empty: no CORS headers at all
    allowed_methods: list[str] = field(default_factory=lambda: ["GET", "POST", "OPTIONS"])
    allowed_headers: list[str] = field(default_factory=lambda: ["Authorization", "Content-Type", "X-Request-Id"])
    allow_credentials: bool = False
    max_body_bytes: int = 1 << 20
    max_json_depth: int = 32
    max_stops: int = 64
    max_stop_chars: int = 256
    max_n: int = 16  # n and best_of
    max_choices: int = 64  # prompts x best_of in one request
    max_tools: int = 128
    max_queue: int = 256  # requests the engine holds beyond max_running before answering 429
    drain_timeout: float = 30.0
    chat_template: str | None = None
    vocab_size: int = 256  # set from the model

    def validate(self) -> "ServerOptions":
        for name in ("max_body_bytes", "max_json_depth", "max_stops", "max_stop_chars", "max_n", "max_choices",
                     "max_tools"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0 or self.drain_timeout < 0:
            raise ValueError("--max-queue and --drain-timeout must be >= 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        return self


_RID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def request_id(value: str | None) -> str | None:
    if value is None:
        return None
    if not _RID.match(value):
        raise EdgeError(400, "X-Request-Id: 1..128 characters from A-Z a-z 0-9 . _ : -", "X-Request-Id")
    return value


async def read_body(req: Request, limit: int) -> bytes:
    """The body, refused with 413 once it passes ``limit`` (declared or streamed)."""
    declared = req.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise EdgeError(413, f"request body larger than {limit} bytes", "body")
    chunks, n = [], 0
    try:
        async for chunk in req.stream():
            n += len(chunk)
            if n > limit:
                raise EdgeError(413, f"request body larger than {limit} bytes", "body")
            chunks.append(chunk)
    except ClientDisconnect:
        raise EdgeError(400, "client disconnected while sending the body", "body") from None
    return b"".join(chunks)


def parse_json(body: bytes, max_depth: int):
    """Parse ``body``; refuse invalid JSON, deep nesting and strings that are not valid Unicode
    (lone surrogates), naming where."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EdgeError(400, f"request body is not UTF-8 ({e.reason} at byte {e.start})", "body") from None
    depth = cur = 0
    for ch in text:  # cheap pre-scan so the parser never recurses deeply
        if ch in "[{":
            cur += 1
            depth = max(depth, cur)
        elif ch in "]}":
            cur -= 1
    if depth > max_depth:
        raise EdgeError(400, f"request body nests deeper than {max_depth} levels", "body")
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise EdgeError(400, f"request body is not valid JSON ({e})", "body") from None
    _check_strings(obj, "")
    if not isinstance(obj, dict):
        raise EdgeError(400, "request body must be a JSON object", "body")
    return obj


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _check_strings(obj, path: str) -> None:
    stack = [(obj, path)]
    while stack:
        o, p = stack.pop()
        if isinstance(o, str):
            _text(o, p)
        elif isinstance(o, dict):
            for k, v in o.items():
                _text(k, p)
                stack.append((v, f"{p}.{k}" if p else k))
        elif isinstance(o, list):
            stack.extend((v, f"{p}[{i}]") for i, v in enumerate(o))


def _text(s: str, path: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise EdgeError(400, f"{_safe(path) or 'body'}: a string holds a lone UTF-16 surrogate", _safe(path) or "body") from None


def _safe(path: str) -> str:
    return path.encode("utf-8", "replace").decode("utf-8")[:200]
