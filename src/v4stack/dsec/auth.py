"""Bearer-token auth shared by the apiserver and the edge: a missing or wrong token is a 401."""

from __future__ import annotations

import hmac

from fastapi import Header, HTTPException


def bearer(token: str):
    if not token or len(token) < 16:
        raise ValueError("token: at least 16 characters are required")
    want = f"Bearer {token}".encode()

    def check(authorization: str | None = Header(default=None)) -> None:
        if authorization is None or not hmac.compare_digest(authorization.encode(), want):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token (header: Authorization)",
                                headers={"WWW-Authenticate": "Bearer"})

    return check
