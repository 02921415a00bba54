"""Liveness and lifecycle over real HTTP: a busy apiserver, an apiserver restart, a create cut
short, stalling reads - and, after 200 mixed abusive requests, nothing of a deleted sandbox left
on the host (mounts, cgroups, network namespaces, container state, processes, blobs)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

TOKEN = "test-token-" + "x" * 16
OTHER = "other-tenant-" + "o" * 16
CONTROL = "control-token-" + "c" * 16


def _mk(api, **body) -> str:
    r = api.post("/v1/sandboxes", json={"substrate": "process", **body})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _state(cluster, sid):
    return cluster.server.config.app.state.store.sandbox(sid)["state"]


def test_busy_apiserver_keeps_edges_and_sandboxes_alive(cluster):
    api = cluster.api()
    sids = [_mk(api) for _ in range(4)]
    try:
        def run(i):
            with cluster.api() as c:
                return c.post(f"/v1/sandboxes/{sids[i % 4]}/exec", json={"cmd": "sleep 0.3"}, timeout=120).status_code

        with ThreadPoolExecutor(48) as ex:
            futs = [ex.submit(run, i) for i in range(48)]
            time.sleep(1.5)  # the storm is on: 48 requests in flight, most waiting on their sandbox
            t0 = time.monotonic()
            assert httpx.get(f"{cluster.url}/healthz", timeout=10).status_code == 200
            healthz_s = time.monotonic() - t0
            rep = cluster.watcher.tick()
            codes = [f.result() for f in futs]
        assert codes == [200] * 48
        assert healthz_s < 5, healthz_s
        assert not rep["dead_edges"] and not rep["lost"], rep
        assert all(_state(cluster, s) == "running" for s in sids)
    finally:
        for s in sids:
            api.delete(f"/v1/sandboxes/{s}")


def test_apiserver_restart_keeps_and_readopts_sandboxes(cluster):
    api = cluster.api()
    sid = _mk(api)
    try:
        cluster.stop_apiserver()
        time.sleep(2.5)  # longer than dead_after: heartbeats have failed for a while
        rep = cluster.watcher.tick()
        assert not rep["dead_edges"] and sid not in rep["lost"], rep  # the edge answered its probe
        store = cluster.watcher.store
        store.set_state(sid, "lost", "as an older watcher would have left it")
        cluster.start_apiserver()
        deadline = time.time() + 20
        while time.time() < deadline and store.sandbox(sid)["state"] != "running":
            time.sleep(0.1)
        assert store.sandbox(sid)["state"] == "running", store.sandbox(sid)
        with cluster.api() as c:
            assert c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo back"}).json()["stdout"] == "back\n"
    finally:
        cluster.api().delete(f"/v1/sandboxes/{sid}")


def test_create_cut_short_is_resolved(cluster):
    """An apiserver killed mid-create leaves rows 'creating': the watcher asks the edge."""
    store = cluster.watcher.store
    made, never = f"sbx-{uuid.uuid4().hex[:12]}", f"sbx-{uuid.uuid4().hex[:12]}"
    edge = store.edge("edge-a")
    r = httpx.post(f"{edge['url']}/edge/v1/sandboxes", headers={"Authorization": f"Bearer {CONTROL}"},
                   json={"sandbox_id": made, "image": "busybox", "substrate": "process"}, timeout=60)
    assert r.status_code == 200, r.text
    old = time.time() - 600
    for sid in (made, never):
        store.add_sandbox(sid, "edge-a", "busybox", "process", 3600, 600, {}, None, "default")
        store.x("UPDATE sandboxes SET created=? WHERE id=?", old, sid)
    cluster.watcher.tick()
    assert store.sandbox(made)["state"] == "running" and store.sandbox(never)["state"] == "failed"
    cluster.api().delete(f"/v1/sandboxes/{made}")


def test_fifo_reads_never_stall_the_edge(cluster):
    api = cluster.api()
    sid = _mk(api)
    try:
        api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "mkfifo /workspace/p"})

        def read(_):
            with cluster.api() as c:
                return c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/workspace/p"}, timeout=30).status_code

        with ThreadPoolExecutor(45) as ex:
            codes = list(ex.map(read, range(45)))
        assert codes == [400] * 45
        assert httpx.get(f"{cluster.url}/healthz", timeout=5).status_code == 200
        edge_url = cluster.store_edge_url()
        assert httpx.get(f"{edge_url}/healthz", timeout=5).status_code == 200
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_non_utf8_names_over_http(cluster):
    api = cluster.api()
    sid = _mk(api)
    try:
        r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "touch \"$(printf '/workspace/\\377x')\""})
        assert r.status_code == 200 and any("\udcff" in c for c in r.json()["changed"])
        assert api.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/workspace"}).status_code == 200
        assert api.get(f"/v1/sandboxes/{sid}/log").status_code == 200
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def _abuse(api, sid: str, n: int) -> int:
    """One round of mixed abusive requests against ``sid``; returns how many were sent."""
    bad = [
        ("POST", "/exec", {"json": {"cmd": ["/bin/echo", "a\x00b"]}}),
        ("POST", "/exec", {"json": {"cmd": "true", "env": {"A=B": "1"}}}),
        ("POST", "/exec", {"json": {"cmd": "true", "env": {"A": 1}}}),
        ("POST", "/exec", {"json": {"cmd": "true", "timeout": "soon"}}),
        ("POST", "/exec", {"content": b'{"cmd": "true", "timeout": NaN}'}),
        ("POST", "/exec", {"json": {"cmd": "kill -INT 1; kill -9 1; true"}}),
        ("POST", "/exec", {"json": {"cmd": "true", "cwd": ".."}}),
        ("POST", "/exec", {"json": {"cmd": "mkfifo /workspace/f$$; truncate -s 1G /workspace/s$$"}}),
        ("GET", "/files", {"params": {"path": "/workspace/../../../etc/shadow"}}),
        ("GET", "/files", {"params": {"path": "/dev/zero"}}),
        ("PUT", "/files", {"params": {"path": "/workspace/suid", "mode": 0o4755}, "content": b"x"}),
        ("POST", "/files/upload", {"json": {"files": [{"path": "/workspace/u", "data": "!!", "mode": 1}]}}),
        ("POST", "/restore", {"json": {"snapshot_id": "/etc/passwd"}}),
        ("POST", "/restore", {"json": {"snapshot_id": "snap-000000000000", "replay_from": "../../x"}}),
        ("GET", "/log", {"params": {"since": -1}}),
    ]
    sent = 0
    for i in range(n):
        method, suffix, kw = bad[i % len(bad)]
        if "content" in kw and suffix == "/exec":
            kw = {**kw, "headers": {"content-type": "application/json"}}
        r = api.request(method, f"/v1/sandboxes/{sid}{suffix}", **kw)
        assert r.status_code < 500, (suffix, kw, r.status_code, r.text[:200])
        sent += 1
    return sent


def test_nothing_of_a_deleted_sandbox_remains_after_abuse(cluster):
    api = cluster.api()
    keep = _mk(api)
    keep_out = f"kept-{uuid.uuid4().hex}"
    api.post(f"/v1/sandboxes/{keep}/exec", json={"cmd": f"echo {keep_out}"})
    gone, outputs, sent = [], [], 0
    for sub, extra in (("process", {}), ("container", {}), ("container", {"network": {"allow": ["10.9.0.0/16"]}}),
                       ("process", {"limits": {"memory_bytes": 512 << 20}})):
        sid = _mk(api, substrate=sub, **extra)
        gone.append(sid)
        out = f"gone-{uuid.uuid4().hex}"
        outputs.append(out)
        api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": f"echo {out}; sleep 30 &"})
        api.post(f"/v1/sandboxes/{sid}/files/upload",
                 json={"files": [{"path": "/workspace/blob", "data": base64.b64encode(out.encode() * 3).decode()}]})
        api.post(f"/v1/sandboxes/{sid}/snapshot")
        sent += _abuse(api, sid, 48)
    for bad in ({"image": "/tmp/x"}, b'{"limits": {"cpu_quota": Infinity}}', {"snapshot_id": 5}, {"substrate": "vm"},
                {"network": {"allow": ["0.0.0.0/0"]}, "substrate": "process"}, {"replay_from": "sbx-%00"}):
        raw = bad if isinstance(bad, bytes) else json.dumps(bad).encode()
        r = api.post("/v1/sandboxes", content=raw, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (bad, r.text)
        sent += 1
    with cluster.api(OTHER) as other:
        for sid in gone:
            assert other.delete(f"/v1/sandboxes/{sid}").status_code == 404
            sent += 1
    live_mounts = Path("/proc/self/mountinfo").read_text()  # the inverse control: the checks below can fail
    assert all(f"{cluster.home}/run/{sid}/root" in live_mounts for sid in gone)
    assert Path(f"/run/netns/dsec-{gone[2]}").exists() and Path(f"/sys/fs/cgroup/pids/dsec-{gone[1]}").exists()
    for sid in gone:
        assert api.delete(f"/v1/sandboxes/{sid}").status_code == 200
        sent += 1
    assert sent >= 200
    w = cluster.watcher
    w.log_grace, w.blob_grace, w._last_gc = 0.0, 0.0, 0.0
    time.sleep(0.05)
    rep = w.tick()
    assert set(gone) <= set(rep["logs_removed"]), rep

    home = cluster.home
    mounts = Path("/proc/self/mountinfo").read_text()
    edge_pids = tuple(f"dsec-w{p.pid}-" for p in cluster.edges if p.poll() is None)
    for sid in gone:
        assert f"{home}/run/{sid}" not in mounts, f"a mount of {sid} remains"
        assert not (home / "run" / sid).exists()
        for ctrl in ("pids", "memory", "cpu", "freezer"):
            assert not Path(f"/sys/fs/cgroup/{ctrl}/dsec-{sid}").exists(), f"cgroup {ctrl} of {sid} remains"
        assert not Path(f"/run/netns/dsec-{sid}").exists(), f"network namespace of {sid} remains"
        assert not list(Path("/run/crun").glob(f"dsec-{sid}-*")) if Path("/run/crun").is_dir() else True
        assert not (home / "logs" / sid).exists()
    workers = [d for d in Path("/sys/fs/cgroup/pids").glob("dsec-w*") if d.name.startswith(edge_pids)]
    assert len(workers) <= 2 + 1, [d.name for d in workers]  # the kept sandbox's worker + the warm pool
    for d in workers:  # and every process in them belongs to a live worker, not a deleted sandbox
        for pid in (d / "cgroup.procs").read_text().split():
            assert "sleep" not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    blobs = home / "blobs"
    for out in outputs:
        d = hashlib.sha256(f"{out}\n".encode()).hexdigest()
        assert not (blobs / d[:2] / d[2:]).exists(), "a blob of a deleted sandbox remains"
    kept = hashlib.sha256(f"{keep_out}\n".encode()).hexdigest()
    assert (blobs / kept[:2] / kept[2:]).exists(), "GC removed a live sandbox's blob"  # the inverse control
    images = list((home / "images").glob("*.erofs"))
    for img in images:
        loops = os.popen(f"losetup -j {img}").read().strip().splitlines()
        assert len(loops) <= 1, loops
    assert api.post(f"/v1/sandboxes/{keep}/exec", json={"cmd": "echo still"}).json()["stdout"] == "still\n"
    assert json.loads(api.get(f"/v1/sandboxes/{keep}/log").text)["damaged"] is None
    api.delete(f"/v1/sandboxes/{keep}")
