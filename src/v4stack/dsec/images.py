"""Sandbox images: a root tree from Debian packages, packed read-only as EROFS, content-addressed.

Recipes: ``busybox`` (the static busybox from the busybox-static package plus its applet links, a
few /etc files; builds in well under a second) and ``debian`` (debootstrap minbase with python3;
needs the Debian archive and takes minutes). The image id is the sha256 of the EROFS file, built
with a fixed timestamp and UUID so the same tree gives the same id. Each image is loop-mounted
once, read-only, and shared as the bottom layer of every sandbox made from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from v4stack.atomic import atomic_write
from v4stack.dsec.errors import BadRequest, Conflict, NotFound
from v4stack.dsec.mounts import file_lock, is_mount, mount, need, private_dir, run, umount
from v4stack.dsec.validate import ident, is_ident

RECIPES = ("busybox", "debian")
_ETC = {
    "passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hostname": "sandbox\n",
    "hosts": "127.0.0.1 localhost sandbox\n",
}


def _busybox_tree(root: Path) -> None:
    bb = "/bin/busybox" if os.path.exists("/bin/busybox") else need("busybox")
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "proc", "sys", "dev", "tmp", "root", "workspace"):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    shutil.copy2(bb, root / "bin" / "busybox")
    applets = subprocess.run([bb, "--list-full"], capture_output=True, text=True, check=True).stdout.split()
    for a in applets:
        link = root / a
        if a != "bin/busybox" and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink("/bin/busybox", link)
    for name, text in _ETC.items():
        (root / "etc" / name).write_text(text)


def _debian_tree(root: Path) -> None:
    need("debootstrap")
    run(["debootstrap", "--variant=minbase", "--include=python3", "bookworm", str(root),
         "http://deb.debian.org/debian"], timeout=1800)
    (root / "workspace").mkdir(exist_ok=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class ImageStore:
    def __init__(self, home: Path):
        private_dir(home)
        self.dir = home / "images"
        self.mnt = home / "mnt"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mounted_here: set[str] = set()

    def _ref(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def build(self, recipe: str = "busybox", force: bool = False) -> str:
        """Build (or find cached) the image for ``recipe``; returns its id."""
        if recipe not in RECIPES:
            raise BadRequest(f"recipe={recipe!r}: allowed {', '.join(RECIPES)}", "recipe")
        with file_lock(self.dir / ".build.lock"):
            if not force:
                try:
                    return self.resolve(recipe)
                except NotFound:
                    pass
            mkfs = need("mkfs.erofs")
            with tempfile.TemporaryDirectory(dir=self.dir) as tmp:
                tree = Path(tmp) / "root"
                tree.mkdir()
                (_busybox_tree if recipe == "busybox" else _debian_tree)(tree)
                out = Path(tmp) / "image.erofs"
                run([mkfs, "--quiet", "-T0", "-U", "00000000-0000-0000-0000-000000000000", "--all-root",
                     str(out), str(tree)], timeout=1800)
                image_id = _sha256(out)[:32]
                final = self.dir / f"{image_id}.erofs"
                if not final.exists():
                    fd = os.open(out, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
                    os.rename(out, final)
            atomic_write(self._ref(recipe), json.dumps({"id": image_id, "recipe": recipe}).encode())
            return image_id

    def _file(self, image_id: str) -> Path | None:
        p = self.dir / f"{image_id}.erofs"
        try:
            return p if stat.S_ISREG(os.lstat(p).st_mode) else None
        except FileNotFoundError:
            return None

    def resolve(self, name: str) -> str:
        """An image name (a recipe built here) or an image id (its content address) -> id. Never a
        path: both are identifiers of a fixed shape looked up in this store."""
        if is_ident(name, "image_id"):
            if self._file(name) is None:
                raise NotFound(f"image={name!r}: no image with this id in the store", "image")
            return name
        if not is_ident(name, "image_name"):
            ident(name, "image_name", "image")
        try:
            ref = self._ref(name)
            if ref.is_symlink():
                raise ValueError
            image_id = json.loads(ref.read_text())["id"]
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            raise NotFound(f"image={name!r}: not built (try `v4stack dsec image build {name}`)", "image") from None
        if not is_ident(image_id, "image_id") or self._file(image_id) is None:
            raise NotFound(f"image={name!r}: its file {image_id}.erofs is missing", "image")
        return image_id

    def list(self) -> list[dict]:
        out = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                out.append({"name": p.stem, **json.loads(p.read_text())})
            except ValueError:
                continue
        return out

    def mounted(self, image_id: str) -> Path:
        """Mount the image read-only once (shared by every sandbox of it); returns the mount point."""
        ident(image_id, "image_id", "image")
        target = self.mnt / image_id
        if is_mount(target):
            return target
        with file_lock(self.mnt / f".{image_id}.lock"):
            if not is_mount(target):
                src = self._file(image_id)
                if src is None:
                    raise NotFound(f"image={image_id!r}: no image with this id in the store", "image")
                if _sha256(src)[:32] != image_id:  # only what the store built, by its digest
                    raise Conflict(f"image={image_id!r}: the file no longer matches its digest", "image")
                if target.is_symlink() or (target.exists() and not target.is_dir()):
                    target.unlink()
                target.mkdir(parents=True, exist_ok=True)
                mount("erofs", str(src), target, "loop,ro")
                self.mounted_here.add(image_id)
        return target

    def release(self) -> list[str]:
        """Unmount (lazily: sandboxes still running on an image keep it) what this process mounted;
        the loop device is freed with the last user (mount(8) sets autoclear)."""
        gone = []
        for image_id in sorted(self.mounted_here):
            target = self.mnt / image_id
            while is_mount(target):
                umount(target)
            gone.append(image_id)
        self.mounted_here.clear()
        return gone
