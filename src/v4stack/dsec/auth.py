"""Credentials, one per role, never shared between roles:

- client tokens, each scoped to one tenant: the public /v1 API; a tenant sees only its own
  sandboxes, snapshots and logs (another tenant's ids answer 404, as if they did not exist);
- the edge credential: what edges present to the apiserver to register and heartbeat - nothing else;
- the control credential: what the apiserver and the watcher present to edges; the edge API
  accepts nothing else, so a client token cannot drive an edge directly.

They live in ``<home>/credentials.json`` (0600, written atomically); ``dsec up`` makes one with a
``default`` tenant when there is none. Comparisons are constant-time.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Header, HTTPException

from v4stack.atomic import atomic_write
from v4stack.dsec.validate import ident

MIN_TOKEN = 16


def _check_token(t, what: str) -> str:
    if not isinstance(t, str) or len(t) < MIN_TOKEN:
        raise ValueError(f"{what}: a token of at least {MIN_TOKEN} characters is required")
    return t


@dataclass
class Credentials:
    tenants: dict[str, str] = field(default_factory=dict)  # tenant -> client token
    edge: str = ""
    control: str = ""

    def __post_init__(self):
        for t, tok in self.tenants.items():
            ident(t, "tenant")
            _check_token(tok, f"tenants.{t}")
        _check_token(self.edge, "edge")
        _check_token(self.control, "control")
        toks = list(self.tenants.values()) + [self.edge, self.control]
        if len(set(toks)) != len(toks):
            raise ValueError("credentials: every role and tenant needs its own token")

    @classmethod
    def generate(cls, tenants=("default",)) -> "Credentials":
        return cls({t: secrets.token_urlsafe(24) for t in tenants}, secrets.token_urlsafe(24), secrets.token_urlsafe(24))

    def save(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        atomic_write(p, json.dumps({"tenants": self.tenants, "edge": self.edge, "control": self.control}).encode())
        os.chmod(p, 0o600)
        return p

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Credentials":
        raw = json.loads(Path(path).read_text())
        return cls(dict(raw["tenants"]), raw["edge"], raw["control"])

    @classmethod
    def ensure(cls, home: str | os.PathLike, tenants=("default",)) -> "Credentials":
        p = Path(home) / "credentials.json"
        if p.exists():
            return cls.load(p)
        c = cls.generate(tenants)
        c.save(p)
        return c


def _deny() -> HTTPException:
    return HTTPException(status_code=401, detail="missing or wrong bearer token (header: Authorization)",
                         headers={"WWW-Authenticate": "Bearer"})


def _presented(authorization: str | None) -> bytes:
    if authorization is None or not authorization.startswith("Bearer "):
        raise _deny()
    return authorization[len("Bearer "):].encode("utf-8", "replace")


def tenant_of(creds: Credentials):
    """Dependency: the tenant whose client token is presented (401 otherwise)."""
    table = [(tok.encode(), t) for t, tok in creds.tenants.items()]

    def check(authorization: str | None = Header(default=None)) -> str:
        got = _presented(authorization)
        found = None
        for tok, t in table:  # compare with all, so timing does not tell which one matched
            if hmac.compare_digest(got, tok):
                found = t
        if found is None:
            raise _deny()
        return found

    return check


def bearer(token: str):
    """Dependency: exactly this one token (the edge credential, or the control credential)."""
    want = _check_token(token, "token").encode()

    def check(authorization: str | None = Header(default=None)) -> None:
        if not hmac.compare_digest(_presented(authorization), want):
            raise _deny()

    return check
