"""What a command did to a sandbox's filesystem, seen in its overlay upper directory.

``scan(upper)`` gives a manifest ``{relpath: entry}``; ``fs_digest`` hashes it; ``delta(before,
after)`` lists what changed (the provenance of a command); ``capture`` stores the changed file
contents in the blob store so ``apply`` can reproduce the same upper on a fresh sandbox without
running the command again. Overlay's own markers travel too: a whiteout (char device 0:0) and the
``trusted.overlay.opaque`` directory attribute.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import stat

from v4stack.dsec.cas import BlobStore

OPAQUE = "trusted.overlay.opaque"


def _opaque(p: str) -> bool:
    try:
        return os.getxattr(p, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


CHUNK = 4 << 20


def extents(fd: int, size: int):
    """(offset, length) of the data extents of a file (holes skipped): a sparse 2 GiB file with
    no data has none, so reading, hashing and storing it costs what it really occupies."""
    off = 0
    while off < size:
        try:
            start = os.lseek(fd, off, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole from here on
            return
        end = os.lseek(fd, start, os.SEEK_HOLE)
        while start < end:
            n = min(CHUNK, end - start)
            yield start, n
            start += n
        off = end


def _hash_file(p: str) -> str:
    """Digest of (size, non-zero chunks of the data extents with their offsets): a hole and a
    chunk of written zeros hash alike, so a file restored sparsely keeps its digest."""
    h = hashlib.sha256()
    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        size = os.fstat(fd).st_size
        h.update(f"size={size};".encode())
        for off, n in extents(fd, size):
            data = os.pread(fd, n, off)
            if data.count(0) == len(data):
                continue  # written zeros and holes read the same
            h.update(f"{off}+{len(data)};".encode())
            h.update(data)
    finally:
        os.close(fd)
    return "sha256:" + h.hexdigest()


def capture_file(path: str, blobs: BlobStore) -> str:
    """Store a file as {size, extents: [[offset, chunk digest]]} (zero chunks left out); returns
    the digest of that document. What is stored is bounded by what the file occupies."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        size = os.fstat(fd).st_size
        ext = []
        for off, n in extents(fd, size):
            data = os.pread(fd, n, off)
            if data.count(0) != len(data):
                ext.append([off, blobs.put(data)])
    finally:
        os.close(fd)
    return blobs.put(json.dumps({"size": size, "extents": ext}, separators=(",", ":")).encode())


def restore_file(p: str, doc_digest: str, blobs: BlobStore) -> None:
    doc = json.loads(blobs.get(doc_digest))
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        for off, d in doc["extents"]:
            data = blobs.get(d)
            view, pos = memoryview(data), int(off)
            while view:
                n = os.pwrite(fd, view, pos)
                view, pos = view[n:], pos + n
        os.ftruncate(fd, int(doc["size"]))
    finally:
        os.close(fd)


def _walk(top: str):
    """(dir, entry names) for every directory under ``top``, iteratively (a tree 10,000 levels
    deep costs memory, not Python stack); directories that cannot be listed are skipped."""
    stack = [top]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError:
            continue
        yield d, [e.name for e in entries]
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
            except OSError:
                continue


class Scanner:
    """Scans an upper dir, re-hashing only files whose (inode, size, mtime, ctime) changed."""

    def __init__(self):
        self._cache: dict[tuple, str] = {}

    def scan(self, upper: str | os.PathLike) -> dict[str, dict]:
        upper = str(upper)
        out: dict[str, dict] = {}
        cache: dict[tuple, str] = {}
        for dirpath, names in _walk(upper):
            for name in names:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, upper)
                try:
                    st = os.lstat(full)
                except OSError:  # a path past PATH_MAX: recorded, never fatal
                    out[rel] = {"t": "unreadable"}
                    continue
                m = st.st_mode
                e = {"mode": stat.S_IMODE(m), "uid": st.st_uid, "gid": st.st_gid}
                if stat.S_ISDIR(m):
                    e["t"] = "dir"
                    if _opaque(full):
                        e["opaque"] = True
                elif stat.S_ISREG(m):
                    key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                    try:
                        h = self._cache.get(key) or _hash_file(full)
                    except OSError:
                        out[rel] = {"t": "unreadable"}
                        continue
                    cache[key] = h
                    e.update(t="file", size=st.st_size, sha=h)
                elif stat.S_ISLNK(m):
                    try:
                        e.update(t="link", target=os.readlink(full))
                    except OSError:
                        e = {"t": "unreadable"}
                elif stat.S_ISCHR(m) and st.st_rdev == 0:
                    e = {"t": "whiteout"}
                elif stat.S_ISFIFO(m):
                    e["t"] = "fifo"
                else:
                    e = {"t": "other"}
                out[rel] = e
        self._cache = cache
        return out


def fs_digest(manifest: dict[str, dict]) -> str:
    blob = json.dumps(sorted(manifest.items()), separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict | None]:
    """Changed or new entries, and ``None`` for entries gone from the upper."""
    d: dict[str, dict | None] = {k: v for k, v in after.items() if before.get(k) != v}
    for k in before:
        if k not in after:
            d[k] = None
    return d


def capture(upper: str | os.PathLike, d: dict[str, dict | None], blobs: BlobStore) -> str:
    """Store the contents of changed files (sparse-aware, chunked); returns the digest of the delta
    document, whose file entries name their content document (``doc``)."""
    out = {}
    for rel, e in d.items():
        if e is not None and e["t"] == "file":
            e = {**e, "doc": capture_file(os.path.join(upper, rel), blobs)}
        out[rel] = e
    return blobs.put(json.dumps(sorted(out.items()), separators=(",", ":")).encode())


def referenced(delta_doc: bytes) -> set[str]:
    """The blobs a delta document needs (its content documents, and their chunks, are read by GC)."""
    return {e["doc"] for _, e in json.loads(delta_doc) if e and e.get("t") == "file" and e.get("doc")}


def remove_tree(p: str | os.PathLike) -> None:
    """Remove a file or a whole tree, however deep (rm(1): no Python recursion limit)."""
    p = str(p)
    if os.path.isdir(p) and not os.path.islink(p):
        subprocess.run(["rm", "-rf", "--one-file-system", "--", p], check=True, capture_output=True)
    elif os.path.lexists(p):
        os.unlink(p)


_remove = remove_tree


def _inside(upper: str, rel: str) -> str:
    """``upper/rel`` if ``rel`` is a plain relative path whose parent resolves inside ``upper``
    (no '..', no absolute path, no symlinked parent); a recorded delta never names anything else."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\x00" in rel or ".." in rel.split("/"):
        raise ValueError(f"delta path {rel!r} is not inside the sandbox")
    p = os.path.join(upper, rel)
    parent = os.path.realpath(os.path.dirname(p))
    if parent != upper and not parent.startswith(upper + "/"):
        raise ValueError(f"delta path {rel!r} leaves the sandbox through a symlink")
    return p


def apply(upper: str | os.PathLike, delta_digest: str, blobs: BlobStore) -> None:
    """Make ``upper`` carry the changes recorded in ``delta_digest`` (parents before children)."""
    upper = os.path.realpath(upper)
    items = json.loads(blobs.get(delta_digest))
    gone = sorted((k for k, e in items if e is None), key=len, reverse=True)
    for rel in gone:
        _remove(_inside(upper, rel))
    for rel, e in sorted(((k, e) for k, e in items if e is not None), key=lambda kv: kv[0].count("/")):
        p = _inside(upper, rel)
        t = e["t"]
        if t == "dir":
            if not os.path.isdir(p) or os.path.islink(p):
                _remove(p)
                os.mkdir(p)
            if e.get("opaque"):
                os.setxattr(p, OPAQUE, b"y", follow_symlinks=False)
        else:
            _remove(p)
            if t == "file" and e.get("doc"):
                restore_file(p, e["doc"], blobs)
            elif t == "file":  # a log written before content documents: the whole file is one blob
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(blobs.get(e["sha"]))
            elif t == "link":
                os.symlink(e["target"], p)
            elif t == "whiteout":
                os.mknod(p, stat.S_IFCHR | 0o000, 0)
                continue
            elif t == "fifo":
                os.mkfifo(p, 0o600)
            else:
                continue
        if t != "link":
            os.chown(p, e["uid"], e["gid"])
            os.chmod(p, e["mode"])
        else:
            os.chown(p, e["uid"], e["gid"], follow_symlinks=False)
