"""CUDA C++ kernels of the project: built with ``nvcc`` for Hopper on first use, loaded through the
driver, launched on torch's current stream (so a CUDA graph being captured records them).

``build(source)`` compiles a ``.cu`` file beside this module to a cubin for ``sm_90a`` and keeps
it in a cache directory (``$V4STACK_CUDA_CACHE``, else ``~/.cache/v4stack/cuda``) under a name
made from the source's bytes, the compiler's version and the flags, written atomically, so a
changed source or compiler builds again and a half-written file is never loaded. ``usable()``
says whether this process can run them: a CUDA device of compute capability 9.0 and an ``nvcc``
on the PATH (whose version is part of the cache key); where it cannot, callers keep their Triton
kernels. These kernels have no Z3-proved contract: their wrappers check shapes, dtypes, strides
and alignment, and the kernels bound every index they read by (``0 <= i < N``).

``Function.launch(grid, block, smem, *args)`` packs each argument by its declared C type
(``"p"`` a device pointer from a tensor or an int, ``"i32"``, ``"i64"``, ``"f32"``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from v4stack.atomic import atomic_write

HERE = Path(__file__).parent
FLAGS = ("-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3", "-std=c++17")
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def cache_dir() -> Path:
    return Path(os.environ.get("V4STACK_CUDA_CACHE") or Path.home() / ".cache" / "v4stack" / "cuda")


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str | None:
    exe = shutil.which("nvcc")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[-1] if out.strip() else None


def source_bytes(source: str) -> bytes:
    """``source``'s bytes followed by those of the local headers it includes (``#include "x.cuh"``,
    beside the source, where nvcc finds them: an A/B's old source outside the package reads its own),
    so a changed header builds again."""
    path = HERE / source
    src = path.read_bytes()
    heads = re.findall(rb'^\s*#include\s+"([A-Za-z0-9_.]+)"', src, flags=re.M)
    return src + b"".join(b"\0" + h + b"\0" + (path.parent / h.decode()).read_bytes() for h in heads)


def cubin_path(source: str) -> Path:
    src = source_bytes(source)
    key = hashlib.sha256(src + b"\0" + (nvcc_version() or "").encode() + b"\0" + " ".join(FLAGS).encode())
    return cache_dir() / f"{Path(source).stem}-{key.hexdigest()[:20]}.cubin"


def build(source: str) -> tuple[Path, str]:
    """The cubin of ``source`` (compiled now unless cached) and ptxas's report (empty if cached)."""
    out = cubin_path(source)
    if out.exists():
        return out, ""
    if nvcc_version() is None:
        raise RuntimeError(f"cubin: no nvcc to build {source}, and no cached build at {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj = Path(tmp) / "k.cubin"
        r = subprocess.run(["nvcc", *FLAGS, "-Xptxas", "-v", "-o", str(obj), str(HERE / source)],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"cubin: nvcc failed on {source}:\n{r.stderr[-4000:]}")
        atomic_write(out, obj.read_bytes())
    return out, r.stderr


@functools.lru_cache(maxsize=None)
def ready(source: str, fallback: str) -> bool:
    """This process can build and launch ``source``'s kernels: a Hopper GPU, and nvcc builds it
    (asked once; a compiler that cannot - too old for sm_90a, say - leaves the caller on
    ``fallback``, with a warning that says why)."""
    if not usable():
        return False
    try:
        build(source)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        warnings.warn(f"{Path(source).stem}: not built, {fallback}: {e}", RuntimeWarning)
        return False
    return True


@functools.lru_cache(maxsize=None)
def _driver():
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    cu.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
    cu.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    cu.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p,
                                                                            ctypes.POINTER(ctypes.c_void_p),
                                                                            ctypes.c_void_p]
    cu.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    return cu


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"cubin: {what} failed with CUDA driver error {rc}")


_PACK = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float, "p": ctypes.c_uint64}


class Function:
    """One kernel of a loaded cubin, on the device that was current when it was loaded."""

    def __init__(self, module, handle, types: tuple[str, ...], smem: int):
        self._module, self._handle, self.types, self.smem = module, handle, types, smem

    def launch(self, grid: tuple[int, int, int], block: int, *args) -> None:
        import torch

        if len(args) != len(self.types):
            raise TypeError(f"cubin: {len(self.types)} arguments declared, {len(args)} given")
        vals = []
        for a, ty in zip(args, self.types):
            if ty == "p" and isinstance(a, torch.Tensor):
                a = a.data_ptr()
            vals.append(_PACK[ty](a))
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        stream = torch.cuda.current_stream().cuda_stream
        _check(_driver().cuLaunchKernel(self._handle, *grid, block, 1, 1, self.smem, stream, params, None),
               "cuLaunchKernel")


@functools.lru_cache(maxsize=None)
def load(source: str, name: str, types: tuple[str, ...], smem: int, device: int) -> Function:
    """Kernel ``name`` of ``source``'s cubin, built if needed, with ``smem`` bytes of dynamic shared
    memory allowed (loaded once per device)."""
    import torch

    path, _ = build(source)
    with torch.cuda.device(device):
        torch.cuda.current_stream()  # the device's primary context current on this thread
        cu = _driver()
        ctx = ctypes.c_void_p()
        _check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            torch.zeros(1, device=f"cuda:{device}")
            _check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        data = path.read_bytes()
        buf = ctypes.create_string_buffer(data, len(data))
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        _check(cu.cuModuleLoadData(ctypes.byref(mod), buf), f"loading {path.name}")
        _check(cu.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), f"finding {name}")
        if smem > 48 * 1024:
            _check(cu.cuFuncSetAttribute(fn, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                   f"raising {name}'s shared memory to {smem}")
    return Function(mod, fn, types, smem)


@functools.lru_cache(maxsize=None)
def usable() -> bool:
    """A Hopper device (compute capability 9.0) and ``nvcc`` to build (or find the cached) cubin."""
    import torch

    if os.environ.get("V4STACK_NO_CUDA_KERNELS"):
        return False
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    return nvcc_version() is not None
