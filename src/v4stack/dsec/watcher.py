"""The watcher: edge health, sandbox leases (TTL and idle, paused time not counted), reclamation
of a dead edge's sandboxes, and garbage collection of layers nothing references.

It reads and writes the apiserver's SQLite file and calls edges directly, so it runs as its own
process (or a thread in ``dsec up``) and keeps working while the apiserver restarts.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from v4stack.dsec.lifecycle import CREATING_GRACE, adopt_edge
from v4stack.dsec.rootfs import LayerStore
from v4stack.dsec.store import Store


class Watcher:
    def __init__(self, home: str | Path, control_token: str, db_path: str | Path | None = None, dead_after: float = 3.0,
                 layer_grace: float = 60.0, reclaim_local: bool = True, log_grace: float = 3600.0,
                 blob_grace: float = 300.0, gc_every: float = 60.0):
        self.home = Path(home)
        self.reclaim_local = reclaim_local  # also tear down a dead edge's leftovers on this host
        self.store = Store(db_path or self.home / "dsec.sqlite")
        self.layers = LayerStore(self.home)
        self.dead_after, self.layer_grace = dead_after, layer_grace
        self.log_grace, self.blob_grace, self.gc_every = log_grace, blob_grace, gc_every
        self._last_gc = 0.0
        self.http = httpx.Client(timeout=10, headers={"Authorization": f"Bearer {control_token}"})
        self.stop = threading.Event()

    def tick(self, now: float | None = None) -> dict:
        """One pass. ``now`` moves the lease clock only (tests); edge liveness uses the real clock."""
        real = time.time()
        now = now or real
        report = {"dead_edges": [], "lost": [], "expired": [], "idle": [], "layers_removed": []}
        for e in self.store.q("SELECT * FROM edges WHERE state='alive' AND last_seen < ?", real - self.dead_after):
            # a stale heartbeat may be a busy or restarting apiserver, not a dead edge: ask the edge
            if adopt_edge(self.store, self.http, e) is not None:
                self.store.heartbeat(e["id"])
                continue
            self.store.x("UPDATE edges SET state='dead' WHERE id=? AND last_seen < ?", e["id"], real - self.dead_after)
            report["dead_edges"].append(e["id"])
            for s in self.store.q("SELECT id FROM sandboxes WHERE edge=? AND state IN ('creating','running','paused')",
                                  e["id"]):
                self.store.set_state(s["id"], "lost", f"edge {e['id']} stopped heartbeating")
                report["lost"].append(s["id"])
        if report["dead_edges"] and self.reclaim_local:
            from v4stack.dsec.runtime import reclaim_orphans

            report["reclaimed"] = reclaim_orphans(self.home)
        stuck = self.store.q("SELECT DISTINCT edge FROM sandboxes WHERE state='creating' AND created < ?",
                             real - CREATING_GRACE)
        for row in stuck:  # an apiserver that died mid-create: the edge says whether it made it
            e = self.store.edge(row["edge"])
            if e is not None and e["state"] == "alive":
                adopt_edge(self.store, self.http, e)
            else:
                self.store.x("UPDATE sandboxes SET state='failed', reason='its edge is gone' WHERE edge=? AND "
                             "state='creating' AND created < ?", row["edge"], real - CREATING_GRACE)
        for s in self.store.q("SELECT * FROM sandboxes WHERE state IN ('running','paused')"):
            why = None
            if self.store.active_seconds(s, now) > s["timeout"]:
                why, key = f"timeout {s['timeout']:g}s of active time reached", "expired"
            elif s["state"] == "running" and not s["busy"] and now - s["last_active"] > s["idle_timeout"]:
                why, key = f"idle for more than {s['idle_timeout']:g}s", "idle"
            if why:
                self._kill(s, why)
                report[key].append(s["id"])
        report["layers_removed"] = self.gc_layers(real)
        if real - self._last_gc >= self.gc_every:
            self._last_gc = real
            report["logs_removed"], report["blobs_removed"] = self.gc_blobs(real)
        return report

    def gc_blobs(self, now: float) -> tuple[list[str], list[str]]:
        """Logs of sandboxes that ended (killed, expired, failed) go after ``log_grace``; then every
        blob no remaining log reaches (outputs, written files, deltas and their content chunks)
        goes after ``blob_grace``. A lost sandbox's log stays: it is what a replay restores from."""
        import shutil

        from v4stack.dsec.cas import BlobStore, Corrupt
        from v4stack.dsec.fsdiff import referenced
        from v4stack.dsec.trajlog import blob_refs

        logs = self.home / "logs"
        removed = []
        for row in self.store.q("SELECT id FROM sandboxes WHERE state IN ('killed','expired','failed')"):
            d = logs / row["id"]
            if d.is_dir() and not d.is_symlink() and now - d.stat().st_mtime > self.log_grace:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(row["id"])
        blobs = BlobStore(self.home / "blobs")
        refs: set[str] = set()
        for d in logs.iterdir() if logs.is_dir() else []:
            direct, deltas = blob_refs(d)
            refs |= direct
            for dd in deltas:
                try:
                    docs = referenced(blobs.get(dd))
                    refs |= docs
                    for doc in docs:
                        refs.update(x[1] for x in json.loads(blobs.get(doc))["extents"])
                except (Corrupt, ValueError, KeyError, TypeError, OSError):
                    continue  # a damaged or missing delta names nothing more
                except Exception:  # noqa: BLE001 - NotFound and friends: same
                    continue
        return removed, blobs.gc(refs, grace=self.blob_grace, now=now)

    def _kill(self, row: dict, why: str) -> None:
        e = self.store.edge(row["edge"])
        if e and e["state"] == "alive":
            try:
                self.http.delete(f"{e['url']}/edge/v1/sandboxes/{row['id']}")
            except httpx.HTTPError:
                pass
        self.store.set_state(row["id"], "expired", why)

    def gc_layers(self, now: float) -> list[str]:
        refs = self.store.referenced_layers()
        for p in (self.home / "snapshots").glob("*.json") if (self.home / "snapshots").is_dir() else []:
            try:
                refs.update(json.loads(p.read_text())["layers"])
            except (ValueError, KeyError, OSError):
                continue
        gone = []
        for lid in self.layers.ids():
            p = self.layers.dir / lid
            if lid not in refs and now - p.stat().st_mtime > self.layer_grace:
                self.layers.remove(lid)
                gone.append(lid)
        return gone

    def run(self, every: float = 1.0) -> None:
        while not self.stop.is_set():
            try:
                self.tick()
            except Exception as e:  # keep watching; one bad tick must not end reclamation
                print(f"dsec watcher: tick failed: {type(e).__name__}: {e}", flush=True)
            self.stop.wait(every)
