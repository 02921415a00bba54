"""Errors every dsec layer raises; the HTTP layers map them to status codes."""

from __future__ import annotations


class DsecError(Exception):
    """Base error; ``status`` is the HTTP status the apiserver and edge answer with."""

    status = 500

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class BadRequest(DsecError):
    status = 400


class NotFound(DsecError):
    status = 404


class Conflict(DsecError):
    status = 409


class TooLarge(DsecError):
    status = 413


class Unavailable(DsecError):
    status = 503


class Unsupported(DsecError):
    """The host lacks an OS capability (a command, a filesystem, a cgroup controller)."""

    status = 501
