"""The one seccomp policy of every substrate: syscalls a sandboxed command never needs.

Defence in depth on top of "no capabilities": new user namespaces, keyrings, bpf, module loading
and the mount family widen the kernel surface, and the keyring calls would reach the host's root
keyrings (keyrings are not namespaced by the mount or pid namespace). The container substrate
hands ``oci()`` to crun; the process substrate installs ``install()`` (a classic BPF filter,
built here from the same table) right before ``execve``. x86_64 only; other ABIs are killed.
Stdlib only (the worker imports it).
"""

from __future__ import annotations

import ctypes
import struct

# name -> x86_64 syscall number
DENY = {
    "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "swapon": 167, "swapoff": 168, "reboot": 169, "init_module": 175, "finit_module": 313,
    "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320, "bpf": 321, "perf_event_open": 298,
    "userfaultfd": 323, "keyctl": 250, "add_key": 248, "request_key": 249, "ptrace": 101,
    "process_vm_readv": 310, "process_vm_writev": 311, "open_by_handle_at": 304, "name_to_handle_at": 303,
    "syslog": 103, "acct": 163, "quotactl": 179, "settimeofday": 164, "clock_settime": 227, "adjtimex": 159,
    "iopl": 172, "ioperm": 173, "fanotify_init": 300, "move_mount": 429, "open_tree": 428, "fsopen": 430,
    "fsmount": 432, "fspick": 433, "mount_setattr": 442,
}
CLONE, CLONE3, CLONE_NEWUSER = 56, 435, 0x10000000
EPERM, ENOSYS = 1, 38


def oci() -> dict:
    """The policy as an OCI runtime-spec ``linux.seccomp`` section."""
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": [
            {"names": sorted(DENY), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
            {"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
             "args": [{"index": 0, "value": CLONE_NEWUSER, "valueTwo": CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}]},
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},  # libc falls back to clone
        ],
    }


_LD_ABS, _JEQ, _JGE, _AND, _RET = 0x20, 0x15, 0x35, 0x54, 0x06
_ARCH_X86_64 = 0xC000003E
_KILL_PROCESS, _ALLOW, _ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
_X32_BIT = 0x40000000


def program() -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions; jump targets are resolved by label."""
    body: list[tuple] = [
        (_LD_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ, 1, 0, _ARCH_X86_64),
        (_RET, 0, 0, _KILL_PROCESS),
        (_LD_ABS, 0, 0, 0),  # seccomp_data.nr
        (_JGE, "eperm", 0, _X32_BIT),
    ]
    body += [(_JEQ, "eperm", 0, nr) for nr in sorted(DENY.values())]
    body += [
        (_JEQ, "enosys", 0, CLONE3),
        (_JEQ, 0, "allow", CLONE),
        (_LD_ABS, 0, 0, 16),  # low 32 bits of args[0] (clone flags)
        (_AND, 0, 0, CLONE_NEWUSER),
        (_JEQ, "eperm", "allow", CLONE_NEWUSER),
    ]
    labels = {"allow": len(body), "eperm": len(body) + 1, "enosys": len(body) + 2}
    body += [(_RET, 0, 0, _ALLOW), (_RET, 0, 0, _ERRNO | EPERM), (_RET, 0, 0, _ERRNO | ENOSYS)]
    out = []
    for i, (code, jt, jf, k) in enumerate(body):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        assert 0 <= jt < 256 and 0 <= jf < 256
        out.append((code, jt, jf, k))
    return out


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install() -> None:
    """Install the filter on the calling thread (no_new_privs must already be set)."""
    ins = program()
    raw = b"".join(struct.pack("HBBI", *x) for x in ins)
    buf = ctypes.create_string_buffer(raw, len(raw))
    prog = _Prog(len(ins), ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
