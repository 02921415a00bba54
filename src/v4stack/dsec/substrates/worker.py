"""The process-substrate worker: PID 1 of its own pid / mount / net / ipc / uts namespaces.

Started by ``ProcessSubstrate`` under ``unshare`` before any sandbox needs it (the warm pool).
Speaks JSON lines on stdin / stdout. ``exec`` forks a child that enters the sandbox root
(chroot), drops every capability and sets no_new_privs, then runs the command; output streams
back as ``{"fd": "stdout", "data": <base64>}`` lines and ends with ``{"exit": ...}``. When the
command ends (or times out) the worker kills every other process of its pid namespace.
Stdlib only; imports nothing from the model.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import selectors
import signal
import stat
import subprocess
import sys
import time

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
SYS_CAPSET = 126
FORWARD_CAP = 4 << 20


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges() -> None:
    for cap in range(64):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS)")
    hdr = _CapHeader(0x20080522, 0)
    data = (_CapData * 2)()
    if _libc.syscall(SYS_CAPSET, ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


_MS = {"nosuid": 2, "nodev": 4, "noexec": 8}


def _mount(fstype: str, target: str, opts: str = "") -> None:
    flags = sum(_MS.get(o, 0) for o in opts.split(","))
    data = ",".join(o for o in opts.split(",") if o and o not in _MS)
    if _libc.mount(fstype.encode(), target.encode(), fstype.encode(), flags, data.encode() or None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {fstype} on {target}: {os.strerror(e)}")


def prepare(root: str) -> None:
    """Mount /proc (this pid namespace's) and a small /dev in the sandbox root, once per mount."""
    proc, dev = os.path.join(root, "proc"), os.path.join(root, "dev")
    os.makedirs(proc, exist_ok=True)
    os.makedirs(dev, exist_ok=True)
    if not os.path.ismount(proc):
        _mount("proc", proc, "nosuid,nodev,noexec")
    if not os.path.ismount(dev):
        _mount("tmpfs", dev, "nosuid,noexec,size=64k,mode=0755")
        for name, minor in (("null", 3), ("zero", 5), ("full", 7), ("random", 8), ("urandom", 9)):
            p = os.path.join(dev, name)
            os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, minor))
            os.chmod(p, 0o666)


def _kill_others() -> None:
    try:
        os.kill(-1, signal.SIGKILL)  # from PID 1: every other process of this pid namespace
    except ProcessLookupError:
        pass
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                break
        except ChildProcessError:
            break


def send(msg: dict) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def run(req: dict) -> None:
    root = req["root"]
    prepare(root)
    cwd = req.get("cwd") or "/"

    def enter():
        for procs in req.get("cgroups") or []:  # the command (not the worker) is what the limits bind
            with open(procs, "w") as f:
                f.write("0")
        os.chroot(root)
        os.chdir(cwd)
        os.setsid()
        drop_privileges()

    t0 = time.monotonic()
    try:
        p = subprocess.Popen(req["argv"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=req.get("env") or {}, preexec_fn=enter, close_fds=True)
    except (OSError, subprocess.SubprocessError) as e:
        send({"exit": 127, "error": f"{type(e).__name__}: {e}", "duration": time.monotonic() - t0})
        return
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ, "stdout")
    sel.register(p.stderr, selectors.EVENT_READ, "stderr")
    deadline = t0 + float(req.get("timeout", 60))
    sent, timed_out, open_ = 0, False, 2
    while open_:
        left = deadline - time.monotonic()
        if left <= 0 and not timed_out:
            timed_out = True
            _kill_others()
        for key, _ in sel.select(timeout=max(min(left, 0.5), 0.01)):
            data = os.read(key.fileobj.fileno(), 65536)
            if not data:
                sel.unregister(key.fileobj)
                open_ -= 1
            elif sent < FORWARD_CAP:
                sent += len(data)
                send({"fd": key.data, "data": base64.b64encode(data).decode()})
    code = p.wait()
    _kill_others()
    send({"exit": code if code >= 0 else 128 - code, "timed_out": timed_out, "duration": time.monotonic() - t0})


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        _libc.sethostname(b"sandbox", 7)
        subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True)
    except OSError:
        pass
    send({"ready": os.getpid()})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "exec":
            run(req)
        elif req.get("op") == "release":
            # the host is about to unmount this root: drop our copy (with our /proc and /dev on it),
            # so the fresh mount that replaces it propagates in cleanly
            _libc.umount2(req["root"].encode(), 2)  # MNT_DETACH
            send({"released": True})
        elif req.get("op") == "ping":
            send({"pong": True})


if __name__ == "__main__":
    main()
