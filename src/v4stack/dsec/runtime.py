"""What an edge runs: sandboxes = rootfs + substrate + trajectory log, and their verbs.

Every mutating request (exec, file writes and removals) is logged: INTENT durable before it
runs, RESULT (exit code, stdout/stderr blobs, duration, fs digest, change delta) durable after.
A request re-issued with a sequence number that is already logged is answered from the log
(fast-forward) and never runs twice; one whose INTENT has no RESULT is an unknown outcome (409).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from v4stack.dsec import fsdiff, validate
from v4stack.dsec import substrates as substrate_registry
from v4stack.dsec.cas import BlobStore
from v4stack.dsec.cgroups import Limits
from v4stack.dsec.errors import BadRequest, Conflict, DsecError, NotFound
from v4stack.dsec.files import Files
from v4stack.dsec.images import ImageStore
from v4stack.dsec.mounts import private_dir
from v4stack.dsec.rootfs import LayerStore, Rootfs, read_snapshot, write_snapshot
from v4stack.dsec.substrates.base import Handle, OnOutput
from v4stack.dsec.trajlog import TrajectoryLog, query, read_log, request_digest

MAX_CHAIN = 8
DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


class Sandbox:
    def __init__(self, rt: "Runtime", sid: str, image_id: str, substrate, limits: Limits):
        self.rt, self.id, self.image_id, self.substrate, self.limits = rt, sid, image_id, substrate, limits
        self.rootfs = Rootfs(rt.home, sid, rt.images.mounted(image_id), rt.layers, limits.disk_bytes)
        self.handle = Handle(sid, self.rootfs, None, limits)
        self.log = TrajectoryLog(rt.home / "logs" / sid)
        self.scanner = fsdiff.Scanner()
        self.manifest: dict = {}
        self.parent: str | None = None
        self.lock = threading.Lock()
        self.files = Files(self.rootfs.root)

    def info(self) -> dict:
        return {"id": self.id, "image": self.image_id, "substrate": self.substrate.name, "chain": self.rootfs.chain,
                "parent_snapshot": self.parent, "next_seq": self.log.next_seq, "limits": asdict(self.limits)}

    # -- logged requests --------------------------------------------------------------------
    def _logged(self, request: dict, idempotent: bool, seq: int | None, run) -> dict:
        with self.lock:
            nxt = self.log.next_seq
            if seq is not None and seq < nxt:
                e = self.log.entries.get(seq)
                if e is None:
                    raise Conflict(f"seq={seq}: not in this sandbox's log (it starts at {nxt - len(self.log.entries)})", "seq")
                if e.intent["req"] != request_digest(request):
                    raise Conflict(f"seq={seq}: logged with a different request", "seq")
                if e.result is None:
                    raise Conflict(f"seq={seq}: unknown outcome (the request was logged but never finished); "
                                   "it is not re-run", "seq")
                return self._answer(e.result, fast_forward=True)
            if seq is not None and seq > nxt:
                raise Conflict(f"seq={seq}: the next sequence number is {nxt}", "seq")
            entry = self.log.intent(request, idempotent, self.parent, seq=nxt)
            try:
                res = run()
            except DsecError as e:  # refused by the substrate or the files layer: logged as such
                res = {"exit": 127, "stderr": f"{e}\n".encode(), "refused": e}
            blobs = self.rt.blobs
            after = self.scanner.scan(self.rootfs.upper)
            d = fsdiff.delta(self.manifest, after)
            self.manifest = after
            try:
                delta = fsdiff.capture(self.rootfs.upper, d, blobs) if d else None
                capture_error = None
            except (OSError, ValueError) as e:  # e.g. a file removed while captured: said, not hidden
                delta, capture_error = None, f"{type(e).__name__}: {e}"
            rec = self.log.result(
                entry.seq,
                exit=res.get("exit", 0),
                stdout=blobs.put(res.get("stdout", b"")),
                stderr=blobs.put(res.get("stderr", b"")),
                duration=res.get("duration", 0.0),
                timed_out=res.get("timed_out", False),
                oom_killed=res.get("oom_killed", False),
                fs=fsdiff.fs_digest(after),
                delta=delta,
                changed=sorted(d)[:1000],
                **({"capture_error": capture_error} if capture_error else {}),
            )
            if "refused" in res:
                raise res["refused"]
            self.rt.touch(self.id)
            return self._answer(rec, fast_forward=False)

    def _answer(self, rec: dict, fast_forward: bool) -> dict:
        b = self.rt.blobs
        return {"seq": rec["seq"], "exit_code": rec["exit"], "stdout": b.get(rec["stdout"]).decode(errors="replace"),
                "stderr": b.get(rec["stderr"]).decode(errors="replace"), "duration": rec["duration"],
                "timed_out": rec.get("timed_out", False), "oom_killed": rec.get("oom_killed", False),
                "fs_digest": rec["fs"], "changed": rec.get("changed", []), "fast_forward": fast_forward}

    def exec(self, cmd: str | list[str], cwd: str = "/", env: dict | None = None, timeout: float = 60,
             idempotent: bool = False, seq: int | None = None, on_output: OnOutput | None = None) -> dict:
        argv = validate.argv(cmd)
        cwd = validate.inner_path(cwd, "cwd", absolute=True)
        timeout = validate.number(timeout, "timeout", 0.001, 3600)
        if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 1 << 62):
            raise BadRequest(f"seq={seq!r}: a non-negative integer is required", "seq")
        full_env = {**DEFAULT_ENV, **validate.env(env)}
        request = {"op": "exec", "argv": argv, "cwd": cwd, "env": full_env, "timeout": timeout}

        def run():
            r = self.substrate.exec(self.handle, argv, cwd, full_env, timeout, on_output)
            return {"exit": r.exit_code, "stdout": r.stdout, "stderr": r.stderr, "duration": r.duration,
                    "timed_out": r.timed_out, "oom_killed": r.oom_killed}

        return self._logged(request, idempotent, seq, run)

    def write_files(self, items: list[tuple[str, bytes, int]], seq: int | None = None) -> dict:
        """Write files (creating parents); one log entry for the whole batch."""
        for i, (p, _, m) in enumerate(items):  # refused before anything is logged
            validate.inner_path(p, "path")
            if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= 0o1777:
                raise BadRequest(f"mode={m!r}: allowed 0 .. 0o1777 (no setuid / setgid bits)", "mode")
        request = {"op": "write", "files": [[p, self.rt.blobs.put(d), m] for p, d, m in items]}

        def run():
            for p, d, m in items:
                self.files.write(p, d, m)
            return {"exit": 0}

        return self._logged(request, True, seq, run)

    def remove_file(self, path: str, seq: int | None = None) -> dict:
        validate.inner_path(path, "path")
        return self._logged({"op": "remove", "path": path}, True, seq, lambda: (self.files.remove(path), {"exit": 0})[1])

    # -- snapshots --------------------------------------------------------------------------
    def _remount(self, chain: list[str], prepare=None) -> None:
        unmounting = getattr(self.substrate, "unmounting", None)
        if unmounting and self.handle.state.get("worker") is not None:
            unmounting(self.handle)
        self.rootfs.unmount()
        self.rootfs.mount(chain, prepare)
        self.manifest = self.scanner.scan(self.rootfs.upper)

    def snapshot(self) -> dict:
        """Seal the upper as a layer, continue on a fresh upper; the snapshot names its log position."""
        with self.lock:
            t0 = time.monotonic()
            upper = self.scanner.scan(self.rootfs.upper)
            chain = list(self.rootfs.chain)
            if upper:
                layer = self.rt.layers.seal(self.rootfs.upper, self.image_id, chain, fsdiff.fs_digest(upper))
                chain = [layer] + chain
            if len(chain) > MAX_CHAIN:
                chain = [self.rt.layers.flatten(self.image_id, chain)]
            self._remount(chain)
            doc = {"id": new_id("snap"), "sandbox": self.id, "image": self.image_id, "layers": chain,
                   "seq": self.log.next_seq - 1, "parent": self.parent, "created": time.time()}
            write_snapshot(self.rt.home, doc)
            self.log.mark("snapshot", id=doc["id"], seq=doc["seq"], layers=chain)
            self.parent = doc["id"]
            doc["duration"] = time.monotonic() - t0
            return doc

    def restore(self, snapshot_id: str, replay_from: str | None = None, rerun_idempotent: bool = False) -> dict:
        """Put the sandbox back to ``snapshot_id``; with ``replay_from`` (a sandbox id, possibly dead)
        also re-apply that sandbox's logged changes after the snapshot, without re-running them.
        Replay stops at an unknown outcome; ``rerun_idempotent`` runs that one request again, and
        only if it was logged as idempotent - a non-idempotent one is reported, never re-run."""
        out = self._restore(snapshot_id, replay_from)
        unknown = out.pop("_unknown_entries")
        if rerun_idempotent and unknown and unknown[0].intent["idem"]:
            out["rerun"] = self._rerun(unknown[0])
        return out

    def _rerun(self, e) -> dict:
        req = e.intent["request"]
        if req["op"] == "exec":
            r = self.exec(req["argv"], req["cwd"], req["env"], req["timeout"], idempotent=True, seq=e.seq)
        elif req["op"] == "write":
            r = self.write_files([(p, self.rt.blobs.get(d), m) for p, d, m in req["files"]], seq=e.seq)
        else:
            r = self.remove_file(req["path"], seq=e.seq)
        return {"seq": e.seq, "exit_code": r["exit_code"], "fs_digest": r["fs_digest"]}

    def _restore(self, snapshot_id: str, replay_from: str | None) -> dict:
        snap = read_snapshot(self.rt.home, snapshot_id)
        if snap["image"] != self.image_id:
            raise BadRequest(f"snapshot_id={snapshot_id}: made from image {snap['image']}, not {self.image_id}",
                             "snapshot_id")
        with self.lock:
            t0 = time.monotonic()
            plan = self._replay_plan(snap, replay_from) if replay_from else {"apply": [], "unknown": []}
            if plan["apply"] and plan["apply"][0].seq < self.log.next_seq:
                raise Conflict(f"replay_from={replay_from}: this sandbox's log is already past seq "
                               f"{plan['apply'][0].seq}; replay into a new sandbox", "replay_from")

            def prepare(upper: Path):
                for e in plan["apply"]:
                    if e.result.get("delta"):
                        fsdiff.apply(upper, e.result["delta"], self.rt.blobs)

            self._remount(snap["layers"], prepare)
            self.parent = snapshot_id
            self.log.mark("restore", snapshot=snapshot_id, seq=snap["seq"], replay_from=replay_from,
                          replayed=[e.seq for e in plan["apply"]])
            out = {"snapshot": snapshot_id, "seq": snap["seq"], "duration": time.monotonic() - t0,
                   "replayed": [e.seq for e in plan["apply"]], "unknown_outcome": plan["unknown"],
                   "fs_digest": fsdiff.fs_digest(self.manifest)}
            if plan["apply"]:
                for e in plan["apply"]:  # the copied entries keep their sequence numbers
                    self.log.intent(e.intent["request"], e.intent["idem"], snapshot_id, seq=e.seq)
                    self.log.result(e.seq, **{k: v for k, v in e.result.items() if k not in ("t", "seq", "lsn", "ts")},
                                    replayed_from=replay_from)
                out["expected_fs_digest"] = plan["apply"][-1].result["fs"]
                out["state_matches"] = out["expected_fs_digest"] == out["fs_digest"]
            out["_unknown_entries"] = plan.get("unknown_entries", [])
            return out

    def _replay_plan(self, snap: dict, source: str) -> dict:
        entries, marks = read_log(self.rt.log_dir(source, "replay_from"))
        # the point in the source's log where its state was this snapshot (taken or restored there)
        base = [m["lsn"] for m in marks if (m.get("t") == "snapshot" and m.get("id") == snap["id"])
                or (m.get("t") == "restore" and m.get("snapshot") == snap["id"])]
        start = max(base, default=-1)
        later = [m for m in marks if m.get("t") in ("snapshot", "restore") and m["lsn"] > start]
        if later:
            raise Conflict(f"replay_from={source}: its state moved to another snapshot after "
                           f"{snap['id']}; restore the latest one", "replay_from")
        apply, unknown = [], []
        for s in sorted(entries):
            e = entries[s]
            if s <= snap["seq"] or e.intent["lsn"] < start:
                continue
            if e.result is None:
                unknown.append(e)
                break  # nothing after an unknown outcome can be trusted to follow from it
            apply.append(e)
        return {"apply": apply, "unknown": [e.seq for e in unknown], "unknown_entries": unknown}

    def destroy(self) -> None:
        with self.lock:
            self.substrate.destroy(self.handle)
            self.rootfs.destroy()
            self.log.close()


class Runtime:
    """All sandboxes of one edge, over the shared storage at ``home``."""

    def __init__(self, home: str | os.PathLike, pool_size: int = 2):
        self.home = private_dir(Path(home))
        private_dir(self.home / "run")
        self.images = ImageStore(self.home)
        self.layers = LayerStore(self.home)
        self.blobs = BlobStore(self.home / "blobs")
        self.sandboxes: dict[str, Sandbox] = {}
        self.pool_size = pool_size
        self._substrates: dict[str, object] = {}
        self._lock = threading.Lock()
        self.last_active: dict[str, float] = {}
        self.reclaimed = reclaim_orphans(self.home)

    def substrate(self, name: str):
        with self._lock:
            if name not in self._substrates:
                self._substrates[name] = substrate_registry.get(name, self.home, pool_size=self.pool_size)
            return self._substrates[name]

    def touch(self, sid: str) -> None:
        self.last_active[sid] = time.time()

    def log_dir(self, sid: str, field: str = "sandbox_id") -> Path:
        """The log directory of a sandbox id (live or dead) from this home's own table of logs."""
        d = self.home / "logs" / validate.ident(sid, "sandbox_id", field)
        if d.is_symlink() or not d.is_dir():
            raise NotFound(f"{field}={sid!r}: no log for this sandbox", field)
        return d

    def get(self, sid: str) -> Sandbox:
        try:
            return self.sandboxes[sid]
        except KeyError:
            raise NotFound(f"sandbox_id={sid!r}: no such sandbox on this edge", "sandbox_id") from None

    def create(self, image: str = "busybox", substrate: str = "container", limits: Limits | None = None,
               sid: str | None = None, snapshot: str | None = None, replay_from: str | None = None,
               allow: list[str] | None = None, rerun_idempotent: bool = False) -> Sandbox:
        """A new sandbox; ``allow`` (CIDRs) gives it egress to those networks only (container substrate)."""
        from v4stack.dsec.netns import parse_allow

        limits = (limits or Limits()).validate()
        allow = parse_allow(allow) if allow is not None else None
        if allow is not None and not substrate_registry.supports_allow(substrate):
            raise BadRequest(f"network.allow: substrate {substrate} takes no egress allow-list", "network.allow")
        sid = validate.ident(sid, "sandbox_id") if sid is not None else new_id("sbx")
        if replay_from is not None:
            self.log_dir(replay_from, "replay_from")
        sub = self.substrate(substrate)
        snap = read_snapshot(self.home, snapshot) if snapshot else None
        image_id = snap["image"] if snap else self.images.resolve(image)
        if sid in self.sandboxes or (self.home / "logs" / sid).exists():
            raise Conflict(f"sandbox_id={sid!r}: already exists", "sandbox_id")
        sbx = Sandbox(self, sid, image_id, sub, limits)
        sbx.handle.state["allow"] = allow
        try:
            sbx.log.mark("create", image=image_id, substrate=substrate, snapshot=snapshot,
                         seq_base=(snap["seq"] + 1) if snap else 0)
            sbx.rootfs.mount(snap["layers"] if snap else [])
            sub.create(sbx.handle)
        except BaseException:
            sbx.rootfs.destroy()
            sbx.log.close()
            shutil.rmtree(self.home / "logs" / sid, ignore_errors=True)
            raise
        sbx.parent = snapshot
        self.sandboxes[sid] = sbx
        self.touch(sid)
        sbx.restore_info = sbx.restore(snapshot, replay_from, rerun_idempotent) if snapshot and replay_from else None
        return sbx

    def kill(self, sid: str) -> None:
        sbx = self.sandboxes.pop(self.get(sid).id)
        sbx.destroy()

    def log(self, sid: str, since: int = 0, path: str | None = None) -> dict:
        return query(self.log_dir(sid), since, path)

    def close(self) -> None:
        for sid in list(self.sandboxes):
            try:
                self.kill(sid)
            except Exception:
                pass
        for s in self._substrates.values():
            s.close()
        self.images.release()
        release_run_dir(self.home / "run")


def reclaim_orphans(home: Path) -> list[str]:
    """Tear down what a dead edge left on this host: sandboxes whose log no live process holds
    (the journal's flock dies with its owner) and worker groups of processes that are gone.
    Logs, layers and snapshots stay: they are what recovery restores from."""
    import fcntl
    import subprocess

    from v4stack.dsec.cgroups import ROOT, Cgroup, mode

    gone = []
    run_dir = home / "run"
    for d in sorted(run_dir.iterdir()) if run_dir.is_dir() else []:
        if not d.is_dir():
            continue
        lock = home / "logs" / d.name / "LOCK"
        if lock.exists():
            fd = os.open(lock, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live edge runs it
            finally:
                os.close(fd)
        if mode() != "none":
            Cgroup(f"dsec-{d.name}").destroy()
        for c in Path("/run/crun").glob(f"dsec-{d.name}-*") if Path("/run/crun").is_dir() else []:
            subprocess.run(["crun", "delete", "-f", c.name], capture_output=True)
        if Path(f"/run/netns/dsec-{d.name}"[:51]).exists():
            from v4stack.dsec.netns import SandboxNet

            SandboxNet(home, d.name).destroy()
        Rootfs(home, d.name, Path("/"), LayerStore(home), 0).destroy()
        gone.append(d.name)
    if mode() == "v1":
        from v4stack.dsec.substrates.process import home_tag

        for g in (ROOT / "pids").glob(f"dsec-w*-{home_tag(home)}*"):  # this home's workers only
            pid = g.name[len("dsec-w"):].split("-")[0]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                Cgroup(g.name).destroy()
                gone.append(g.name)
    return gone


def release_run_dir(run: Path) -> bool:
    """Unmount the shared bind of ``run/`` once no sandbox of any edge is mounted under it."""
    from v4stack.dsec.mounts import is_mount, umount

    prefix = str(run.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        if any(line.split()[4].startswith(prefix) for line in f):
            return False
    while is_mount(run):
        umount(run)
    return True


def snapshot_doc(home: Path, snapshot_id: str) -> dict:
    return read_snapshot(home, snapshot_id)


def dump(obj) -> bytes:
    return json.dumps(obj).encode()
