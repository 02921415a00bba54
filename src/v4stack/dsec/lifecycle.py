"""Keeping the apiserver's table true to what the edges really run.

``adopt_edge`` asks one edge for its live sandboxes (with the control credential) and reconciles:
a sandbox the edge runs is ``running`` again (re-adopted after an apiserver restart, or after a
stale heartbeat that turned out not to be a dead edge); one left ``creating`` by an apiserver that
died mid-create is ``running`` if the edge made it and ``failed`` if not; one the table has as
running that the edge no longer has is ``lost`` - only then, because the edge said so.
"""

from __future__ import annotations

import time

import httpx

CREATING_GRACE = 120.0  # a create still in flight is left alone this long


def edge_listing(http: httpx.Client, edge: dict, timeout: float = 5.0) -> set[str] | None:
    """The ids an edge runs, or None if it cannot be reached (or does not answer sensibly)."""
    try:
        r = http.get(f"{edge['url']}/edge/v1/sandboxes", timeout=timeout)
        if r.status_code != 200:
            return None
        return {s["id"] for s in r.json() if isinstance(s, dict) and isinstance(s.get("id"), str)}
    except (httpx.HTTPError, ValueError, TypeError):
        return None


def adopt_edge(store, http: httpx.Client, edge: dict, now: float | None = None) -> dict | None:
    now = now or time.time()
    # the rows first: one seen running here was running before the edge was asked, so its absence
    # from the answer means the edge lost it (every update below also requires the state seen)
    rows = store.q("SELECT id, state, created FROM sandboxes WHERE edge=? AND state IN "
                   "('creating','running','paused','lost')", edge["id"])
    ids = edge_listing(http, edge)
    if ids is None:
        return None
    report = {"adopted": [], "failed": [], "lost": []}

    def move(sid, old, new, why):
        return store.x("UPDATE sandboxes SET state=?, reason=? WHERE id=? AND state=?", new, why, sid, old) == 1

    for row in rows:
        sid, state = row["id"], row["state"]
        if sid in ids:
            if state in ("creating", "lost") and move(sid, state, "running", f"re-adopted from edge {edge['id']}"):
                report["adopted"].append(sid)
        elif state == "creating" and now - row["created"] > CREATING_GRACE:
            if move(sid, state, "failed", f"edge {edge['id']} never made it"):
                report["failed"].append(sid)
        elif state in ("running", "paused"):
            if move(sid, state, "lost", f"edge {edge['id']} no longer runs it"):
                report["lost"].append(sid)
    return report
