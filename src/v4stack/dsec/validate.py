"""Every API field that names something is an identifier of a fixed shape, looked up in DSec's own
tables; every path a caller gives is a path *inside* a sandbox. Nothing here touches the disk.
Stdlib only (the worker imports it)."""

from __future__ import annotations

import math
import posixpath
import re

from v4stack.dsec.errors import BadRequest

PATTERNS = {
    "sandbox_id": re.compile(r"sbx-[0-9a-f]{12}"),
    "snapshot_id": re.compile(r"snap-[0-9a-f]{12}"),
    "image_id": re.compile(r"[0-9a-f]{32}"),
    "layer_id": re.compile(r"[0-9a-f]{32}"),
    "image_name": re.compile(r"[a-z][a-z0-9-]{0,31}"),
    "edge_id": re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"),
    "tenant": re.compile(r"[a-z][a-z0-9-]{0,31}"),
    "env_key": re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}"),
}
MAX_PATH = 4000
MAX_ARGV_BYTES = 256 << 10
MAX_ENV = 256


def ident(value, kind: str, field: str | None = None) -> str:
    """``value`` if it matches the ``kind`` pattern exactly, else a 400 naming ``field``."""
    field = field or kind
    if not isinstance(value, str) or not PATTERNS[kind].fullmatch(value):
        shown = repr(value)[:80]
        raise BadRequest(f"{field}={shown}: not a valid {kind.replace('_', ' ')} "
                         f"(pattern {PATTERNS[kind].pattern})", field)
    return value


def is_ident(value, kind: str) -> bool:
    return isinstance(value, str) and PATTERNS[kind].fullmatch(value) is not None


def inner_path(value, field: str = "path", absolute: bool = False) -> str:
    """A path inside the sandbox: a string without NUL of at most MAX_PATH bytes; with
    ``absolute`` also starting at '/' and free of '..' (returned normalised)."""
    if not isinstance(value, str) or not value or "\x00" in value:
        raise BadRequest(f"{field}={repr(value)[:80]}: a non-empty path without NUL bytes is required", field)
    if len(value.encode("utf-8", "surrogateescape")) > MAX_PATH:
        raise BadRequest(f"{field}: longer than {MAX_PATH} bytes", field)
    if absolute:
        if not value.startswith("/") or ".." in value.split("/"):
            raise BadRequest(f"{field}={value[:80]!r}: an absolute path inside the sandbox without '..' is required",
                             field)
        return posixpath.normpath(value).replace("//", "/")
    return value


def argv(cmd) -> list[str]:
    if isinstance(cmd, str):
        cmd = ["/bin/sh", "-c", cmd]
    if not isinstance(cmd, list) or not cmd or not all(isinstance(a, str) for a in cmd):
        raise BadRequest("cmd: a shell string or a non-empty list of strings", "cmd")
    if any("\x00" in a for a in cmd):
        raise BadRequest("cmd: NUL bytes are not allowed in arguments", "cmd")
    if sum(len(a.encode("utf-8", "surrogateescape")) + 1 for a in cmd) > MAX_ARGV_BYTES or not cmd[0]:
        raise BadRequest(f"cmd: a non-empty program and at most {MAX_ARGV_BYTES} bytes of arguments", "cmd")
    return cmd


def env(value) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_ENV:
        raise BadRequest(f"env: an object of at most {MAX_ENV} string values", "env")
    for k, v in value.items():
        if not is_ident(k, "env_key"):
            raise BadRequest(f"env: key {repr(k)[:60]} is not a variable name ({PATTERNS['env_key'].pattern})", "env")
        if not isinstance(v, str) or "\x00" in v or len(v) > 32768:
            raise BadRequest(f"env.{k}: a string without NUL bytes of at most 32768 characters", f"env.{k}")
    return dict(value)


def number(value, field: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{field}={repr(value)[:40]}: a number is required", field)
    v = float(value)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise BadRequest(f"{field}={value!r}: allowed {lo:g} .. {hi:g}", field)
    return v
