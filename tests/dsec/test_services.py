"""apiserver + edge (a real subprocess) + watcher over real HTTP on 127.0.0.1, driven by the SDK."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

TOKEN = "test-token-" + "x" * 16
EDGE_TOKEN = "edge-token-" + "e" * 16


def test_auth_missing_or_wrong_token_is_401_and_changes_nothing(cluster):
    before = cluster.api().get("/v1/sandboxes").json()
    for token in (None, "wrong-token-" + "y" * 16):
        h = {} if token is None else {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=cluster.url, timeout=30, headers=h) as c:
            assert c.post("/v1/sandboxes", json={"image": "busybox"}).status_code == 401
            assert c.get("/v1/sandboxes").status_code == 401
            assert c.post("/v1/edges/register", json={"edge_id": "evil", "url": "http://127.0.0.1:1"}).status_code == 401
    assert cluster.api().get("/v1/sandboxes").json() == before
    edge_url = cluster.store_edge_url()  # the edge's own API takes the control credential only
    for tok in (None, "nope", TOKEN, EDGE_TOKEN):
        h = {"Authorization": f"Bearer {tok}"} if tok else {}
        assert httpx.post(f"{edge_url}/edge/v1/sandboxes", json={}, headers=h, timeout=10).status_code == 401
        assert httpx.get(f"{edge_url}/edge/v1/sandboxes", headers=h, timeout=10).status_code == 401
    with cluster.api() as c:  # a client token cannot act as an edge
        assert c.post("/v1/edges/register", json={"edge_id": "evil", "url": "http://127.0.0.1:1"}).status_code == 401
    assert all(e["id"] != "evil" for e in cluster.api().get("/v1/edges").json())
    r = cluster.api().post("/v1/sandboxes", json={"substrate": "vm"})
    assert r.status_code == 400 and r.json()["field"] == "substrate"
    r = cluster.api().post("/v1/sandboxes", json={"timeout": -1})
    assert r.status_code == 400 and r.json()["field"] == "timeout"


@pytest.mark.parametrize("sub", ["container", "process"])
def test_sdk_end_to_end(cluster, sub):
    from v4stack.dsec.client import Sandbox, SandboxError

    with Sandbox.create(image="busybox", substrate=sub) as sbx:
        sbx.files.write("/workspace/src/a.txt", "alpha")
        sbx.files.write_many([("/workspace/src/deep/b.txt", "beta"), ("/workspace/c.bin", b"\x00\x01")])
        assert [e["name"] for e in sbx.files.list("/workspace/src")] == ["a.txt", "deep"]
        chunks = []
        r = sbx.commands.run("cat /workspace/src/a.txt /workspace/src/deep/b.txt; echo E >&2",
                             on_stdout=chunks.append)
        assert r.exit_code == 0 and r.stdout == "alphabeta" and "".join(chunks) == "alphabeta" and r.stderr == "E\n"
        snap = sbx.snapshot()
        sbx.commands.run("echo after > /workspace/after")
        twin = Sandbox.restore(snap["id"], substrate=sub)
        try:
            assert twin.files.read("/workspace/src/a.txt") == b"alpha"
            assert twin.commands.run("ls /workspace").stdout == "c.bin\nsrc\n"
        finally:
            twin.kill()
        fork = sbx.fork()
        try:
            assert fork.files.read("/workspace/after") == b"after\n"
        finally:
            fork.kill()
        sbx.pause()
        with pytest.raises(SandboxError) as e:
            sbx.commands.run("true")
        assert e.value.status == 409
        with pytest.raises(SandboxError) as e:  # the streamed form keeps the status too
            sbx.commands.run("true", on_stdout=print)
        assert e.value.status == 409 and e.value.field == "sandbox_id"
        sbx.resume()
        sbx.resume()  # a second resume is not an error
        with pytest.raises(SandboxError) as e:
            sbx.commands.run("true", seq=10_000, on_stdout=print)
        assert e.value.status == 409 and e.value.field == "seq"
        assert sbx.commands.run("cat /workspace/after").stdout == "after\n"
        log = sbx.log(path="workspace/after")
        assert log["provenance"] and log["unknown_outcome"] == []
        with pytest.raises(SandboxError) as e:
            sbx.files.read("/workspace/nope")
        assert e.value.status == 404 and e.value.field == "path"


def test_ttl_and_idle_leave_paused_time_out(cluster):
    from v4stack.dsec.client import Sandbox

    a = Sandbox.create(substrate="process", timeout=5, idle_timeout=5)
    a.pause()
    now = time.time()
    assert a.id not in cluster.watcher.tick(now + 30)["expired"]  # 30 s paused: neither TTL nor idle
    a.resume()
    rep = cluster.watcher.tick(time.time() + 2)
    assert a.id not in rep["expired"] + rep["idle"]
    rep = cluster.watcher.tick(time.time() + 6)
    assert a.id in rep["expired"] + rep["idle"]
    assert a.info()["state"] == "expired"

    # a command running longer than the idle timeout keeps its sandbox: it is busy, not idle
    b = Sandbox.create(substrate="process", timeout=600, idle_timeout=1)
    t = threading.Thread(target=lambda: b.commands.run("sleep 3", timeout=30))
    t.start()
    time.sleep(2)
    rep = cluster.watcher.tick()
    assert b.id not in rep["idle"]
    t.join()
    assert cluster.watcher.tick(time.time() + 2)["idle"] == [b.id]


@pytest.mark.parametrize("sub", ["container", "process"])
def test_parallel_create_of_32_never_hangs(cluster, sub):
    from v4stack.dsec.client import Sandbox, SandboxError

    def one(i):
        try:
            s = Sandbox.create(substrate=sub, request_timeout=90)
            out = s.commands.run(f"echo {i}").stdout
            s.kill()
            return out == f"{i}\n"
        except SandboxError as e:
            return str(e)  # a clear error is allowed; a hang is not

    t0 = time.time()
    with ThreadPoolExecutor(32) as ex:
        results = list(ex.map(one, range(32), timeout=150))
    assert time.time() - t0 < 150
    assert all(r is True for r in results), results


def test_edge_sigkill_mid_command_then_restore_and_fast_forward(cluster):
    from v4stack.dsec.client import Sandbox, SandboxError

    edge_b = cluster.start_edge("edge-b")
    sbx = Sandbox.create(substrate="container", edge="edge-b")
    assert sbx.info()["edge"] == "edge-b"
    sbx.commands.run("echo base > /workspace/base")
    snap = sbx.snapshot()
    sbx.commands.run("echo $$ > /workspace/nonidem; rm /workspace/base")
    sbx.commands.run("mkdir /workspace/d; echo z > /workspace/d/z", idempotent=True)
    want = sbx.commands.run("cat /workspace/nonidem; ls -R /workspace").stdout

    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(SandboxError, sbx.commands.run,
                                                                    "echo doomed > /workspace/doomed; sleep 30")))
    t.start()
    deadline = time.time() + 20
    while time.time() < deadline and not sbx.log()["unknown_outcome"]:
        time.sleep(0.05)
    in_flight = sbx.log()["unknown_outcome"]
    assert in_flight == [4]
    edge_b.kill()  # SIGKILL mid-command
    edge_b.wait()
    t.join(30)
    assert errors, "the client call did not fail when its edge died"
    time.sleep(1.2)
    rep = cluster.watcher.tick()
    assert "edge-b" in rep["dead_edges"] and sbx.id in rep["lost"]
    # on this host the watcher also tears down what the dead edge left: mounts, processes, cgroups
    assert sbx.id in rep["reclaimed"]
    assert not (cluster.home / "run" / sbx.id).exists()
    assert not Path(f"/sys/fs/cgroup/pids/dsec-{sbx.id}").exists()
    assert sbx.info()["state"] == "lost"
    log = sbx.log()
    assert log["unknown_outcome"] == [4]
    assert [e["status"] for e in log["entries"]] == ["done"] * 4 + ["unknown_outcome"]

    again = Sandbox.restore(snap["id"], replay_from=sbx.id, substrate="container", rerun_idempotent=True)
    try:
        info = again.info_at_create["restore"]
        assert info["replayed"] == [1, 2, 3] and info["unknown_outcome"] == [4] and info["state_matches"]
        assert "rerun" not in info  # the doomed command was not idempotent: reported, never re-run
        assert again.commands.run("cat /workspace/nonidem; ls -R /workspace").stdout == want
        assert not again.files.list("/workspace") or "doomed" not in [e["name"] for e in again.files.list("/workspace")]
        # the replayed entries answer a re-issued request from the log (fast-forward)
        ff = again.commands.run("mkdir /workspace/d; echo z > /workspace/d/z", idempotent=True, seq=2)
        assert ff.fast_forward and ff.exit_code == 0
    finally:
        again.kill()


def test_watcher_collects_only_unreferenced_layers(cluster):
    from v4stack.dsec.client import Sandbox

    with Sandbox.create(substrate="process") as sbx:
        sbx.commands.run("echo keep > /workspace/keep")
        snap = sbx.snapshot()
    stray = cluster.home / "layers" / ("0" * 32)
    (stray / "workspace").mkdir(parents=True)
    removed = cluster.watcher.tick()["layers_removed"]
    assert stray.name in removed and not stray.exists()
    assert all((cluster.home / "layers" / lid).is_dir() for lid in snap["layers"])
    again = Sandbox.restore(snap["id"], substrate="process")
    try:
        assert again.files.read("/workspace/keep") == b"keep\n"
    finally:
        again.kill()
