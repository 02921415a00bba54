"""`dsec up` starts apiserver + edge + watcher as one command; the SDK works against it; SIGTERM stops it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

TOKEN = "cli-token-" + "z" * 16


def test_dsec_up_serves_and_stops(dsec_home, unmount, tmp_path):
    from v4stack.dsec.auth import Credentials

    home = tmp_path / "up-home"
    home.mkdir()
    Credentials({"default": TOKEN}, "edge-" + "e" * 16, "ctl-" + "c" * 16).save(home / "credentials.json")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {**os.environ, "DSEC_TOKEN": TOKEN}
    log = open(tmp_path / "up.out", "wb")
    p = subprocess.Popen([sys.executable, "-m", "v4stack.dsec.cli", "up", "--home", str(home), "--port", str(port),
                          "--pool", "1"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        h = {"Authorization": f"Bearer {TOKEN}"}
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if any(e["state"] == "alive" for e in httpx.get(f"{url}/v1/edges", headers=h, timeout=2).json()):
                    break
            except (httpx.HTTPError, ValueError, TypeError):
                pass
            time.sleep(0.2)
        else:
            raise AssertionError((tmp_path / "up.out").read_text())
        from v4stack.dsec.client import Sandbox

        with Sandbox.create(substrate="process", api_url=url, token=TOKEN) as sbx:
            assert sbx.commands.run("echo up").stdout == "up\n"
        assert httpx.get(f"{url}/v1/sandboxes", timeout=5).status_code == 401

        # the client verbs, as a user types them
        cenv = {**env, "DSEC_API_URL": url}

        def cli(*args):
            return subprocess.run([sys.executable, "-m", "v4stack.dsec.cli", *args], env=cenv, capture_output=True,
                                  text=True, timeout=60)

        made = cli("create", "--substrate", "process")
        sid = made.stdout.strip()
        assert sid.startswith("sbx-"), made.stderr
        r = cli("exec", sid, "echo hi; echo oops >&2; exit 3")
        assert (r.returncode, r.stdout, r.stderr) == (3, "hi\n", "oops\n")
        assert '"seq": 0' in cli("log", sid).stdout
        assert cli("kill", sid).returncode == 0
        bad = cli("exec", sid, "true")
        assert bad.returncode == 1 and "409" in bad.stderr
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        left = [ln.split()[4] for ln in open("/proc/self/mountinfo") if ln.split()[4].startswith(str(home) + "/")]
        unmount(home)
    assert p.returncode == 0
    assert not left, f"dsec up left mounts behind (image mount, sandbox roots): {left}"
    out = (tmp_path / "up.out").read_text()
    edge_pid = int(out.split("edge pid ")[1].split(",")[0])
    deadline = time.time() + 20
    while time.time() < deadline and _alive(edge_pid):
        time.sleep(0.1)
    assert not _alive(edge_pid), "dsec up left its edge running"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_image_build_cli_is_content_addressed(dsec_home, tmp_path):
    out = [subprocess.run([sys.executable, "-m", "v4stack.dsec.cli", "image", "build", "busybox", "--home",
                           str(tmp_path), *extra], capture_output=True, text=True, check=True).stdout.strip()
           for extra in ([], ["--force"])]
    assert out[0] == out[1] and len(out[0]) == 32
    bad = subprocess.run([sys.executable, "-m", "v4stack.dsec.cli", "image", "build", "alpine", "--home", str(tmp_path)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "recipe='alpine'" in bad.stderr


def test_credentials_cli_makes_one_private_file(dsec_home, tmp_path):
    import json
    import stat

    home = tmp_path / "cred-home"
    cmd = [sys.executable, "-m", "v4stack.dsec.cli", "credentials", "--home", str(home), "--tenant", "a", "--tenant", "b"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.count("DSEC_TOKEN=") == 2, r.stderr
    f = home / "credentials.json"
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and stat.S_IMODE(home.stat().st_mode) == 0o700
    c = json.loads(f.read_text())
    toks = [*c["tenants"].values(), c["edge"], c["control"]]
    assert sorted(c["tenants"]) == ["a", "b"] and len(set(toks)) == 4
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)  # never overwritten by accident
    assert again.returncode == 2 and json.loads(f.read_text()) == c
    bad = subprocess.run(cmd[:6] + ["--tenant", "../x", "--force"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "tenant" in bad.stderr
