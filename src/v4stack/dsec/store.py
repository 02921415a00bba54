"""The apiserver's state in SQLite (WAL mode; the watcher opens the same file): edges, sandboxes.

Time accounting for TTL and idle timeouts leaves paused time out: ``active_used`` sums the
running stretches before the current one, ``resumed_at`` starts the current one (NULL while
paused), and resuming moves ``last_active`` forward by the pause so idleness skips it too.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS edges (
    id TEXT PRIMARY KEY, url TEXT NOT NULL, state TEXT NOT NULL, last_seen REAL NOT NULL, registered REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY, edge TEXT NOT NULL, image TEXT NOT NULL, substrate TEXT NOT NULL,
    state TEXT NOT NULL, reason TEXT, created REAL NOT NULL,
    timeout REAL NOT NULL, idle_timeout REAL NOT NULL,
    active_used REAL NOT NULL DEFAULT 0, resumed_at REAL, paused_at REAL, last_active REAL NOT NULL,
    chain TEXT NOT NULL DEFAULT '[]', parent_snapshot TEXT, limits TEXT NOT NULL DEFAULT '{}',
    busy INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS snapshots (
    id TEXT PRIMARY KEY, sandbox TEXT NOT NULL, image TEXT NOT NULL, layers TEXT NOT NULL,
    seq INTEGER NOT NULL, created REAL NOT NULL
);
"""

LIVE = ("running", "paused")


class Store:
    def __init__(self, path: str | Path):
        self.path = str(path)
        self._lock = threading.Lock()
        self.db = sqlite3.connect(self.path, check_same_thread=False, timeout=30, isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        for table in ("sandboxes", "snapshots"):  # files made before tenants existed
            cols = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            if "tenant" not in cols:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default'")

    def q(self, sql: str, *args) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self.db.execute(sql, args).fetchall()]

    def x(self, sql: str, *args) -> int:
        with self._lock:
            return self.db.execute(sql, args).rowcount

    # -- edges --------------------------------------------------------------------------------
    def upsert_edge(self, edge_id: str, url: str) -> None:
        now = time.time()
        self.x("INSERT INTO edges VALUES (?,?,?,?,?) ON CONFLICT(id) DO UPDATE SET url=excluded.url, "
               "state='alive', last_seen=excluded.last_seen", edge_id, url, "alive", now, now)

    def heartbeat(self, edge_id: str) -> bool:
        return self.x("UPDATE edges SET last_seen=?, state='alive' WHERE id=?", time.time(), edge_id) == 1

    def alive_edges(self) -> list[dict]:
        return self.q("SELECT e.*, (SELECT COUNT(*) FROM sandboxes s WHERE s.edge=e.id AND s.state IN "
                      "('running','paused','creating')) AS load FROM edges e WHERE e.state='alive' ORDER BY load, id")

    def edge(self, edge_id: str) -> dict | None:
        rows = self.q("SELECT * FROM edges WHERE id=?", edge_id)
        return rows[0] if rows else None

    # -- sandboxes ----------------------------------------------------------------------------
    def add_sandbox(self, sid: str, edge: str, image: str, substrate: str, timeout: float, idle_timeout: float,
                    limits: dict, parent: str | None, tenant: str = "default") -> None:
        now = time.time()
        self.x("INSERT INTO sandboxes (id, edge, image, substrate, state, created, timeout, idle_timeout, "
               "resumed_at, last_active, parent_snapshot, limits, tenant) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
               sid, edge, image, substrate, "creating", now, timeout, idle_timeout, now, now, parent, json.dumps(limits),
               tenant)

    def sandbox(self, sid: str) -> dict | None:
        rows = self.q("SELECT * FROM sandboxes WHERE id=?", sid)
        return rows[0] if rows else None

    def sandboxes(self, state: str | None = None, tenant: str | None = None) -> list[dict]:
        sql, args = "SELECT * FROM sandboxes WHERE 1=1", []
        if state:
            sql, args = sql + " AND state=?", args + [state]
        if tenant:
            sql, args = sql + " AND tenant=?", args + [tenant]
        return self.q(sql + " ORDER BY created", *args)

    def set_state(self, sid: str, state: str, reason: str | None = None) -> None:
        self.x("UPDATE sandboxes SET state=?, reason=? WHERE id=?", state, reason, sid)

    def set_chain(self, sid: str, chain: list[str], parent: str | None) -> None:
        self.x("UPDATE sandboxes SET chain=?, parent_snapshot=? WHERE id=?", json.dumps(chain), parent, sid)

    def touch(self, sid: str) -> None:
        self.x("UPDATE sandboxes SET last_active=? WHERE id=?", time.time(), sid)

    def busy(self, sid: str, delta: int) -> None:
        """Requests in flight: a sandbox running a long command is not idle."""
        self.x("UPDATE sandboxes SET busy=MAX(0, busy+?), last_active=? WHERE id=?", delta, time.time(), sid)

    def pause(self, sid: str) -> None:
        now = time.time()
        self.x("UPDATE sandboxes SET state='paused', active_used=active_used + (? - resumed_at), resumed_at=NULL, "
               "paused_at=? WHERE id=? AND state='running'", now, now, sid)

    def resume(self, sid: str) -> None:
        now = time.time()
        self.x("UPDATE sandboxes SET state='running', resumed_at=?, last_active=last_active + (? - paused_at), "
               "paused_at=NULL WHERE id=? AND state='paused'", now, now, sid)

    @staticmethod
    def active_seconds(row: dict, now: float | None = None) -> float:
        now = now or time.time()
        return row["active_used"] + ((now - row["resumed_at"]) if row["resumed_at"] else 0.0)

    def add_snapshot(self, doc: dict, tenant: str = "default") -> None:
        self.x("INSERT OR REPLACE INTO snapshots (id, sandbox, image, layers, seq, created, tenant) "
               "VALUES (?,?,?,?,?,?,?)", doc["id"], doc["sandbox"], doc["image"], json.dumps(doc["layers"]),
               doc["seq"], doc["created"], tenant)

    def snapshot(self, snap_id: str) -> dict | None:
        rows = self.q("SELECT * FROM snapshots WHERE id=?", snap_id)
        return rows[0] if rows else None

    def referenced_layers(self) -> set[str]:
        refs: set[str] = set()
        for r in self.q("SELECT layers FROM snapshots"):
            refs.update(json.loads(r["layers"]))
        for r in self.q("SELECT chain FROM sandboxes WHERE state IN ('creating','running','paused','lost')"):
            refs.update(json.loads(r["chain"]))
        return refs
