"""The container substrate: every command is one short-lived OCI container (crun) on the sandbox root.

The root is the sandbox's overlay (shared read-only EROFS image + layers + a tmpfs upper), so
containers of one sandbox see each other's files, and a command's processes end with it. Limits:
the sandbox's own cgroup (memory / cpu / pids), which crun joins before it starts (crun runs with
``--cgroup-manager=disabled``: this host mounts cgroup v1 with one controller on the v2 tree, a
hybrid crun refuses to manage). Network: a fresh network namespace with only loopback, so no
egress. Capabilities: none; no_new_privs; crun's default masked and read-only /proc paths.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from v4stack.dsec import seccomp
from v4stack.dsec.cgroups import Cgroup
from v4stack.dsec.mounts import need
from v4stack.dsec.substrates.base import Collector, ExecResult, Handle, OnOutput, Substrate, pump

UNIFIED = "/sys/fs/cgroup/unified"
SECCOMP = seccomp.oci()
_NS = ["pid", "network", "ipc", "uts", "mount"]


def _base_spec(home: Path) -> dict:
    """crun's default spec (masked / read-only /proc paths, default mounts and devices), tightened."""
    tmp = home / f".spec-{os.getpid()}-{os.urandom(3).hex()}"
    tmp.mkdir(parents=True, exist_ok=True)
    subprocess.run([need("crun"), "spec"], cwd=tmp, check=True, capture_output=True)
    spec = json.loads((tmp / "config.json").read_text())
    (tmp / "config.json").unlink()
    tmp.rmdir()
    spec["linux"].pop("resources", None)
    spec["linux"]["seccomp"] = SECCOMP
    spec["linux"]["namespaces"] = [{"type": t} for t in _NS]
    spec["hostname"] = "sandbox"
    p = spec["process"]
    p["terminal"] = False
    p["noNewPrivileges"] = True
    p["capabilities"] = {k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")}
    p["rlimits"] = [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]
    return spec


class ContainerSubstrate(Substrate):
    name = "container"
    supports_allow = True

    def __init__(self, home: Path, pool_size: int = 0):
        self.home = home
        self.crun = need("crun")
        self.unshare = need("unshare")
        self.spec = _base_spec(home)

    def create(self, handle: Handle) -> None:
        handle.cgroup = Cgroup(f"dsec-{handle.sandbox}").create(handle.limits)
        if handle.state.get("allow") is not None:
            from v4stack.dsec.netns import SandboxNet

            net = SandboxNet(self.home, handle.sandbox)
            try:
                net.create(handle.state["allow"])
            except BaseException:
                handle.cgroup.destroy()
                raise
            handle.state["net"] = net
        handle.state["n"] = 0
        handle.state["bundle"] = handle.rootfs.base / "bundle"
        handle.state["bundle"].mkdir(exist_ok=True)

    def exec(self, handle: Handle, argv, cwd, env, timeout, on_output: OnOutput | None = None) -> ExecResult:
        handle.state["n"] += 1
        cid = f"dsec-{handle.sandbox}-{handle.state['n']}"
        spec = json.loads(json.dumps(self.spec))
        spec["root"] = {"path": str(handle.rootfs.root), "readonly": False}
        spec["process"]["args"] = list(argv)
        spec["process"]["env"] = [f"{k}={v}" for k, v in env.items()]
        spec["process"]["cwd"] = cwd or "/"
        if handle.state.get("net") is not None:  # join the sandbox's persistent namespace with its routes
            spec["linux"]["namespaces"] = [{"type": t} for t in _NS if t != "network"] + [
                {"type": "network", "path": handle.state["net"].path}]
        bundle: Path = handle.state["bundle"]
        cfg = bundle / "config.json"
        cfg.write_text(json.dumps(spec))
        cg: Cgroup = handle.cgroup
        oom0 = cg.oom_kills()
        t0 = time.monotonic()
        # crun sees this host's cgroup layout through a private mount namespace with the v2 tree
        # (which carries only hugetlb here) unmounted, so it takes the host for plain cgroup v1
        script = (f"{cg.join_script()}; umount -l {UNIFIED} 2>/dev/null; "
                  f"exec {self.crun} --cgroup-manager=disabled run --no-new-keyring -b {bundle} {cid}")
        proc = subprocess.Popen([self.unshare, "--mount", "--propagation", "private", "sh", "-c", script],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        col = Collector(on_output)
        timed_out = pump(proc, col, timeout, lambda: cg.kill_all(timeout=2))
        code = proc.wait()
        cg.kill_all(timeout=2)  # anything the command left behind
        if os.path.exists(f"/run/crun/{cid}"):
            subprocess.run([self.crun, "delete", "-f", cid], capture_output=True)
        return ExecResult(code if code >= 0 else 128 - code, bytes(col.buf["stdout"]), bytes(col.buf["stderr"]),
                          time.monotonic() - t0, timed_out, cg.oom_kills() > oom0, col.truncated)

    def destroy(self, handle: Handle) -> None:
        if handle.cgroup is not None:
            handle.cgroup.destroy()
        if handle.state.get("net") is not None:
            handle.state.pop("net").destroy()
