"""A light launcher for the Triton kernels: one dict lookup and the driver call.

``triton.JITFunction.__getitem__(grid)(...)`` binds every argument, rebuilds the specialisation
key and walks its caches on every call. The launcher keeps the compiled kernel per a key it
computes itself - the same facts Triton specialises on (each tensor's dtype and 16-byte
alignment, each integer's being 1 or a multiple of 16, the constexpr values) - and then calls
the compiled kernel's launcher directly. The first call with a new key goes through Triton
(compiling if needed) and must agree: the launcher checks that Triton returned a kernel for the
same specialisation.

Under ``TRITON_INTERPRET=1`` (the CPU test run) it calls the kernel through Triton as usual.
"""

import os

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _spec(a):
    dp = getattr(a, "data_ptr", None)
    if dp is not None:
        return (a.dtype, dp() % 16 == 0)
    if type(a) is int:
        return (a == 1, a % 16 == 0)
    return type(a)


class _Entry:
    __slots__ = ("run", "function", "meta")

    def __init__(self, k):
        self.run, self.function, self.meta = k.run, k.function, k.packed_metadata


_cache: dict = {}
_stream = _device = None


def launch(kernel, grid, *args, **consts):
    """Run ``kernel[grid](*args, **consts)``; constexprs are passed by keyword, in the kernel's
    parameter order (they are its last parameters)."""
    if _INTERPRET:
        kernel[grid](*args, **consts)
        return None
    global _stream, _device
    opts = {k: consts.pop(k) for k in ("num_warps", "num_stages") if k in consts}
    key = (kernel, tuple(map(_spec, args)), *consts.values(), *opts.values())
    e = _cache.get(key)
    if e is None:
        import torch

        _stream, _device = torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice
        names = kernel.arg_names
        if list(consts) != names[len(args):]:
            raise TypeError(f"{kernel.__name__}: constexprs must follow the runtime arguments in order {names}")
        k = kernel[grid](*args, **consts, **opts)
        e = _cache[key] = _Entry(k)
        return None
    g = grid + (1, 1) if len(grid) == 1 else (grid + (1,) if len(grid) == 2 else grid)
    e.run(g[0], g[1], g[2], _stream(_device()), e.function, e.meta, None, None, None, *args,
          *consts.values())
    return None
