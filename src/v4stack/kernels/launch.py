"""A light launcher for the Triton kernels: one dict lookup and the driver call.

``triton.JITFunction.__getitem__(grid)(...)`` binds every argument, rebuilds the specialisation
key and walks its caches on every call. The launcher keeps the compiled kernel per a key it
computes itself - the same facts Triton specialises on (each tensor's dtype and 16-byte
alignment, each integer's being 1 or a multiple of 16, the constexpr values) - and then calls
the driver's C launcher of the compiled kernel directly, with pointers passed as integers (the
launcher then skips its per-pointer driver query; the contract check has already placed every
tensor on the kernel's device). The first call with a new key goes through Triton, which
compiles the kernel for the same specialisation.

Under ``TRITON_INTERPRET=1`` (the CPU test run) it calls the kernel through Triton as usual.
"""

import os

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class _Entry:
    __slots__ = ("launch", "head", "function", "meta")

    def __init__(self, k):
        run = k.run
        direct = getattr(run, "launch", None)
        if direct is not None and not run.global_scratch_size and not run.profile_scratch_size:
            # the driver's C launcher itself: pointers go in as ints, no scratch buffers
            self.launch, self.head = direct, (run.launch_cooperative_grid, run.launch_pdl, None, None)
        else:
            self.launch, self.head = run, ()
        self.function, self.meta = k.function, k.packed_metadata


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the wrappers' grids (``triton.cdiv`` costs microseconds a call on the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1), as ``triton.next_power_of_2`` but cheap."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


_cache: dict = {}
_stream = _device = None


def launch(kernel, grid, *args, **consts):
    """Run ``kernel[grid](*args, **consts)``; constexprs (and ``num_warps`` / ``num_stages``) are
    passed by keyword, constexprs in the kernel's parameter order (they are its last parameters)."""
    if _INTERPRET:
        kernel[grid](*args, **consts)
        return None
    global _stream, _device
    key = [kernel]
    raw = []
    for a in args:
        dp = getattr(a, "data_ptr", None)
        if dp is not None:
            p = dp()
            key.append(a.dtype)
            key.append(p % 16 == 0)
            raw.append(p)
        else:
            if type(a) is int:
                key.append(a == 1)
                key.append(a % 16 == 0)
            raw.append(a)
    key.extend(consts.values())
    key = tuple(key)
    e = _cache.get(key)
    if e is None:
        import torch

        _stream, _device = torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice
        names = kernel.arg_names
        cx = [k for k in consts if k not in ("num_warps", "num_stages")]
        if cx != names[len(args):]:
            raise TypeError(f"{kernel.__name__}: constexprs must follow the runtime arguments in order {names}")
        k = kernel[grid](*args, **consts)
        _cache[key] = _Entry(k)
        return None
    n = len(grid)
    g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
    vals = [v for k, v in consts.items() if k != "num_warps" and k != "num_stages"]
    e.launch(g0, g1, g2, _stream(_device()), e.function, *e.head, e.meta, None, None, None, *raw, *vals)
    return None
