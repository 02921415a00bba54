"""The files API on a sandbox root, resolved by the kernel so no path can leave the root.

Every path goes through ``openat2(2)`` with ``RESOLVE_IN_ROOT``: ``..`` stops at the sandbox
root and absolute or relative symlinks resolve as if the root were ``/``, so a symlink to
``/etc/shadow`` inside a sandbox names the sandbox's own ``/etc/shadow``, never the host's.
Writes go to a temp file in the target directory, are fsynced and renamed into place.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from pathlib import Path

from v4stack.dsec.errors import BadRequest, NotFound
from v4stack.dsec.validate import inner_path

_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_libc = ctypes.CDLL(None, use_errno=True)
MAX_FILE = 64 << 20


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, dirfd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    return fd


def _rel(path: str) -> str:
    return inner_path(path, "path").lstrip("/") or "."


def _err(e: OSError, path: str):
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return NotFound(f"path={path!r}: no such file or directory in the sandbox", "path")
    if e.errno == errno.ENOSPC:
        return BadRequest(f"path={path!r}: the sandbox disk quota is full", "path")
    return BadRequest(f"path={path!r}: {e.strerror}", "path")


class Files:
    def __init__(self, root: Path):
        self.root = root

    def _root_fd(self) -> int:
        return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def _open(self, path: str, flags: int, mode: int = 0) -> int:
        rfd = self._root_fd()
        try:
            return openat2(rfd, _rel(path), flags, mode)
        except OSError as e:
            raise _err(e, path) from None
        finally:
            os.close(rfd)

    def _parent(self, path: str, make: bool) -> tuple[int, str]:
        rel = _rel(path).rstrip("/")
        parent, _, name = rel.rpartition("/")
        if name in ("", ".", ".."):
            raise BadRequest(f"path={path!r}: must name a file, not a directory", "path")
        if make and parent:
            self.mkdir(parent)
        return self._open(parent or ".", os.O_RDONLY | os.O_DIRECTORY), name

    def open_read(self, path: str, limit: int = MAX_FILE) -> tuple[int, int]:
        """(fd, size) of a regular file of at most ``limit`` bytes. Opened non-blocking, so a FIFO
        or a device never stalls the caller: anything but a regular file is refused."""
        fd = self._open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise BadRequest(f"path={path!r}: is a directory", "path")
            if not stat.S_ISREG(st.st_mode):
                raise BadRequest(f"path={path!r}: not a regular file", "path")
            if st.st_size > limit:
                raise BadRequest(f"path={path!r}: {st.st_size} bytes is over the {limit}-byte read limit", "path")
            return fd, st.st_size
        except BaseException:
            os.close(fd)
            raise

    def chunks(self, path: str, limit: int = MAX_FILE, chunk: int = 1 << 20):
        """Stream a regular file in chunks; never more than ``limit`` bytes (a file growing while it
        is read is cut there)."""
        fd, _ = self.open_read(path, limit)

        def gen():
            sent = 0
            try:
                while sent < limit:
                    data = os.read(fd, min(chunk, limit - sent))
                    if not data:
                        break
                    sent += len(data)
                    yield data
            finally:
                os.close(fd)

        return gen()

    def read(self, path: str, limit: int = MAX_FILE) -> bytes:
        return b"".join(self.chunks(path, limit))

    def write(self, path: str, data: bytes, mode: int = 0o644) -> int:
        if len(data) > MAX_FILE:
            raise BadRequest(f"data: {len(data)} bytes is over the {MAX_FILE}-byte limit", "data")
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o1777:
            raise BadRequest(f"mode={mode!r}: allowed 0 .. 0o1777 (no setuid / setgid bits)", "mode")
        pfd, name = self._parent(path, make=True)
        tmp = f".dsec-tmp-{os.urandom(6).hex()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=pfd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fchmod(fd, mode)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        except OSError as e:
            try:
                os.unlink(tmp, dir_fd=pfd)
            except OSError:
                pass
            raise _err(e, path) from None
        finally:
            os.close(pfd)
        return len(data)

    def mkdir(self, path: str) -> None:
        """Create ``path`` and its missing parents, one component at a time, each in-root."""
        parts = [p for p in _rel(path).split("/") if p not in ("", ".")]
        done = ""
        for part in parts:
            if part == "..":
                raise BadRequest(f"path={path!r}: '..' is not allowed when creating directories", "path")
            fd = self._open(done or ".", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            except OSError as e:
                raise _err(e, path) from None
            finally:
                os.close(fd)
            done = f"{done}/{part}" if done else part
            os.close(self._open(done, os.O_RDONLY | os.O_DIRECTORY))  # must now be a directory in-root

    def list(self, path: str = "/") -> list[dict]:
        fd = self._open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            out = []
            with os.scandir(fd) as it:
                for e in it:
                    st = e.stat(follow_symlinks=False)
                    kind = "dir" if e.is_dir(follow_symlinks=False) else "link" if e.is_symlink() else "file"
                    out.append({"name": e.name, "type": kind, "size": st.st_size, "mode": stat.S_IMODE(st.st_mode)})
            return sorted(out, key=lambda x: x["name"])
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        pfd, name = self._parent(path, make=False)
        try:
            try:
                os.unlink(name, dir_fd=pfd)
            except IsADirectoryError:
                os.rmdir(name, dir_fd=pfd)
        except OSError as e:
            raise _err(e, path) from None
        finally:
            os.close(pfd)
