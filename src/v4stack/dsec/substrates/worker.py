"""The process-substrate worker: PID 1 of its own pid / mount / net / ipc / uts namespaces.

Started by ``ProcessSubstrate`` under ``unshare`` before any sandbox needs it (the warm pool).
Speaks JSON lines on stdin / stdout. ``exec`` forks a child that joins the sandbox's cgroup and
enters fresh mount and pid namespaces; there the command's first process is PID 1 (so neither
the worker nor anything of the host is visible or signalable), ``pivot_root`` makes the sandbox
root its whole filesystem (so ``cwd`` and every path resolve inside it), /proc is mounted with
the sensitive files masked and /proc/sys read-only (the same list crun uses), a small /dev, every
capability is dropped, no_new_privs is set and the seccomp filter of ``dsec.seccomp`` (the one the
container substrate uses) is installed; then it execs. Output streams back as
``{"fd": "stdout", "data": <base64>}`` lines and ends with ``{"exit": ...}``. When the command
ends (or times out) the worker kills every other process of its pid namespace.
Stdlib only; imports nothing from the model.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import select
import signal
import stat
import sys
import time

from v4stack.dsec import seccomp

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
SYS_CAPSET, SYS_PIVOT_ROOT = 126, 155
FORWARD_CAP = 4 << 20
CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
# crun's defaults: masked (empty) files and directories, read-only trees
MASKED_FILES = ("kcore", "keys", "key-users", "latency_stats", "timer_list", "timer_stats", "sched_debug",
                "sysrq-trigger")
MASKED_DIRS = ("acpi", "scsi", "firmware")
READ_ONLY = ("sys", "bus", "fs", "irq")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def drop_privileges() -> None:
    for cap in range(64):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    hdr = _CapHeader(0x20080522, 0)
    data = (_CapData * 2)()
    _check(_libc.syscall(SYS_CAPSET, ctypes.byref(hdr), data), "capset")


def _mount(src, target: str, fstype, flags: int, data: str | None = None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)
    _check(_libc.mount(enc(src), target.encode(), enc(fstype), flags, enc(data)), f"mount {target}")


def _prepare_root(root: str) -> None:
    """In this process's private mount namespace: /proc (masked), /dev, then pivot into ``root``."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    proc, dev = os.path.join(root, "proc"), os.path.join(root, "dev")
    for d in (proc, dev):
        if not os.path.isdir(d):
            os.makedirs(d, exist_ok=True)
    _mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in MASKED_FILES:
        p = os.path.join(proc, name)
        if os.path.exists(p):
            _mount("/dev/null", p, None, MS_BIND)
    for name in MASKED_DIRS:
        p = os.path.join(proc, name)
        if os.path.isdir(p):
            _mount("tmpfs", p, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=0")
    for name in READ_ONLY:
        p = os.path.join(proc, name)
        if os.path.exists(p):
            _mount(p, p, None, MS_BIND | MS_REC)
            _mount(None, p, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name, minor in (("null", 3), ("zero", 5), ("full", 7), ("random", 8), ("urandom", 9)):
        p = os.path.join(dev, name)
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, minor))
        os.chmod(p, 0o666)
    os.symlink("/proc/self/fd", os.path.join(dev, "fd"))
    os.chdir(root)
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def _child(req: dict, out_w: int, err_w: int) -> None:
    """Runs in the forked child; never returns normally (execs, or exits)."""
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    for procs in req.get("cgroups") or []:  # the command (not the worker) is what the limits bind
        with open(procs, "w") as f:
            f.write("0")
    os.setsid()
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare")
    pid = os.fork()
    if pid:  # stays in the worker's pid namespace: reports the command's status as its own
        os.closerange(0, 65536)
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    os.closerange(3, 65536)
    _prepare_root(req["root"])
    os.chdir(req["cwd"])
    drop_privileges()
    seccomp.install()
    os.execvpe(req["argv"][0], req["argv"], req["env"])


def send(msg: dict) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def _kill_others(track: int | None = None) -> int | None:
    """SIGKILL every other process of this pid namespace and reap what has died; returns the wait
    status of ``track`` if this reaped it (its caller must not wait for it again)."""
    try:
        os.kill(-1, signal.SIGKILL)  # from PID 1: every other process of this pid namespace
    except ProcessLookupError:
        pass
    status = None
    while True:
        try:
            got, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if (got, st) == (0, 0):
            break
        if got == track:
            status = st
    return status


def _valid(req: dict) -> str | None:
    argv, env, cwd = req.get("argv"), req.get("env"), req.get("cwd")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) and "\x00" not in a for a in argv)):
        return "argv: a non-empty list of strings without NUL"
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) and k and "=" not in k
                                          and "\x00" not in k + v for k, v in env.items())):
        return "env: string keys without '=' and string values, no NUL"
    if not (isinstance(cwd, str) and cwd.startswith("/") and "\x00" not in cwd):
        return "cwd: an absolute path"
    return None


def run(req: dict) -> None:
    t0 = time.monotonic()
    bad = _valid(req)
    if bad:
        send({"exit": 127, "error": f"dsec worker: {bad}", "duration": 0.0})
        return
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _child(req, out_w, err_w)
        except BaseException as e:  # noqa: BLE001 - report anything, then leave
            try:
                os.write(2, f"dsec: {e}\n".encode(errors="replace"))
            finally:
                os._exit(127)
    os.close(out_w)
    os.close(err_w)
    names = {out_r: "stdout", err_r: "stderr"}
    deadline = t0 + float(req.get("timeout", 60))
    sent, timed_out, reaped = 0, False, None
    while names:
        left = deadline - time.monotonic()
        if left <= 0 and not timed_out:
            timed_out = True
            reaped = _kill_others(track=pid)  # may reap the command's own process too
        ready, _, _ = select.select(list(names), [], [], max(min(left, 0.5), 0.01))
        for fd in ready:
            data = os.read(fd, 65536)
            if not data:
                os.close(fd)
                del names[fd]
            elif sent < FORWARD_CAP:
                sent += len(data)
                send({"fd": names[fd], "data": base64.b64encode(data).decode()})
    status = reaped if reaped is not None else os.waitpid(pid, 0)[1]
    code = os.waitstatus_to_exitcode(status)
    _kill_others()
    send({"exit": code if code >= 0 else 128 - code, "timed_out": timed_out, "duration": time.monotonic() - t0})


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    try:
        _libc.sethostname(b"sandbox", 7)
        os.system("ip link set lo up >/dev/null 2>&1")
    except OSError:
        pass
    send({"ready": os.getpid()})
    for line in sys.stdin:
        try:
            req = json.loads(line)
            if req.get("op") == "exec":
                run(req)
            elif req.get("op") == "release":
                # the host is about to unmount this root: drop our copy so the fresh mount that
                # replaces it propagates in cleanly
                _libc.umount2(str(req["root"]).encode(), MNT_DETACH)
                send({"released": True})
            elif req.get("op") == "ping":
                send({"pong": True})
            else:
                send({"exit": 127, "error": "dsec worker: unknown op"})
        except Exception as e:  # noqa: BLE001 - one bad request must not end the worker
            send({"exit": 127, "error": f"dsec worker: {type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
