"""A light launcher for the Triton kernels: one C call from the wrapper to ``cuLaunchKernel``.

``triton.JITFunction.__getitem__(grid)(...)`` binds every argument, rebuilds the specialisation
key and walks its caches on every call. ``launch(kernel, grid, *args, **consts)`` keeps the
compiled kernel per a key it computes itself - the facts Triton specialises on: the device, the
constexpr values (and ``OPTIONS``: ``num_warps``, ``num_stages``, ``maxnreg``), each tensor's dtype
and 16-byte alignment, each int's class (equal to 1, i32, i64 or u64, 16-divisible or not), bools,
floats and ``None`` - and launches it with the arguments packed as the compiled kernel's parameters.

The hot path is C (``launch_c.c``, built the first time with the system C compiler through
Triton's module builder, which caches it): key, lookup, packing, the current torch stream and the
driver call, with no Python frame in between. The first call with a new key comes back to Python
(``_miss``), which compiles through Triton - so the specialisation is Triton's own - and stores an
``Entry`` the C path launches from then on; a kernel that needs what the C path does not do
(scratch buffers, clusters, cooperative launches, a parameter whose type differs from the key's
reading) keeps Triton's own C launcher for its key. Where the C module cannot be built the same key
is computed in Python (``_py_launch``).

A kernel whose body opens with ``gdc.pdl_enter()`` is launched with programmatic stream
serialisation on a Hopper (or later) GPU (``pdl_of``; ``V4STACK_PDL=0`` turns it off) inside
``programmatic(True)``: it may be placed while the kernel before it finishes, and waits for it in
its first instruction. Outside that scope every launch is the usual one (``serve/graphs.py`` says
where the engine opens it: decode graphs of few rows, whose kernels are short).

Under ``TRITON_INTERPRET=1`` (the CPU test run) it calls the kernel through Triton as usual.
"""

import os
from pathlib import Path

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
PDL = os.environ.get("V4STACK_PDL", "1") != "0" and not _INTERPRET
_SOURCE = Path(__file__).with_name("launch_c.c")
# per-argument kind of a parameter, from the key's int code (launch_c.c: arg_code)
_KIND_OF_CODE = {1: "s", 2: "i", 3: "i", 4: "l", 5: "l", 6: "u", 7: "u", 8: "b", 9: "f", 10: "s"}
# launch keywords that are compile options, not constexprs (``maxnreg``: ptxas's register cap, so
# that more programs fit an SM at once)
OPTIONS = ("num_warps", "num_stages", "maxnreg")
_KIND_OF_SIG = {"constexpr": "s", "i32": "i", "i64": "l", "u64": "u", "u1": "b", "fp32": "f"}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the wrappers' grids (``triton.cdiv`` costs microseconds a call on the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1), as ``triton.next_power_of_2`` but cheap."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def build_c():
    """Compile (or load from Triton's cache) the C hot path; raises where no compiler is found."""
    from triton.runtime.build import compile_module_from_src

    return compile_module_from_src(_SOURCE.read_text(), "v4stack_launch")


def int_code(v: int) -> int:
    """The key's code of an int argument (launch_c.c: arg_code)."""
    if v == 1:
        return 1
    d = v % 16 == 0
    if -(2**31) <= v < 2**31:
        return 2 if d else 3
    if -(2**63) <= v < 2**63:
        return 4 if d else 5
    if v < 2**64:
        return 6 if d else 7
    raise TypeError("int argument of 2**64 or more")


def py_key(kernel, dev: int, args: tuple, consts: dict) -> tuple:
    """The key the C path builds, computed in Python (the fallback path and the tests)."""
    key = [id(kernel), dev]
    for kv in consts.items():
        key += kv
    for a in args:
        dp = getattr(a, "data_ptr", None)
        if dp is not None:
            key += (a.dtype, dp() % 16 == 0)
        elif a is None:
            key += (10, None)
        elif type(a) is bool:
            key += (8, None)
        elif type(a) is int:
            key += (int_code(a), None)
        elif type(a) is float:
            key += (9, None)
        else:
            raise TypeError(f"argument of type {type(a).__name__}")
    return tuple(key)


def kinds(key: tuple, nconsts: int) -> str:
    """Each runtime argument's parameter kind, read from its key: ``p`` pointer, ``i`` i32, ``l``
    i64, ``u`` u64, ``b`` u1, ``f`` fp32, ``s`` not a parameter (an int equal to 1, ``None``)."""
    items = key[2 + 2 * nconsts:]
    return "".join("p" if b is True or b is False else _KIND_OF_CODE[a] for a, b in zip(items[::2], items[1::2]))


_now = False  # programmatic(): whether pdl_of's kernels are launched programmatically now


class programmatic:
    """``with programmatic(on):`` the launches inside start ``pdl_of``'s kernels programmatically
    (``on``) or the usual way; the previous setting comes back on exit."""

    def __init__(self, on: bool):
        self.on = bool(on)

    def __enter__(self):
        global _now
        self.was, _now = _now, self.on
        if _C is not None:
            _C.set_pdl(self.on)
        return self

    def __exit__(self, *exc):
        global _now
        _now = self.was
        if _C is not None:
            _C.set_pdl(self.was)


_opens: dict = {}  # id(kernel) -> whether launch() starts it programmatically (kernels stay alive: _alive)
_hopper = None


def pdl_of(kernel) -> bool:
    """Whether ``kernel`` is launched with programmatic stream serialisation: PDL on, the current
    GPU a Hopper or later, and the kernel's body opening with ``gdc.pdl_enter()``."""
    global _hopper
    if not PDL:
        return False
    r = _opens.get(id(kernel))
    if r is None:
        if _hopper is None:
            import torch

            _hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
        from v4stack.kernels.gdc import opens_with_wait

        _alive.add(kernel)
        only = os.environ.get("V4STACK_PDL_ONLY")  # a measurement's restriction: these kernels' names only
        named = not only or getattr(kernel, "__name__", "") in only.split(",")
        r = _opens[id(kernel)] = bool(_hopper) and named and opens_with_wait(kernel.src)
    return r


def pdl_kwargs(kernel) -> dict:
    """The launch option for a kernel launched through Triton itself (``kernel[grid](...)``: those
    with tensor descriptors) that ``pdl_of`` would launch programmatically."""
    return {"launch_pdl": True} if _now and pdl_of(kernel) else {}


class _Entry:
    """A key Triton's own C launcher serves (what the C path does not do)."""
    __slots__ = ("launch", "head", "function", "meta", "vals", "pdl")

    def __init__(self, k, consts, pdl: bool = False):
        run = k.run
        direct = getattr(run, "launch", None)
        self.pdl = pdl
        if direct is not None and not run.global_scratch_size and not run.profile_scratch_size:
            # the driver's C launcher itself: pointers go in as ints, no scratch buffers
            self.launch, self.head = direct, (run.launch_cooperative_grid, run.launch_pdl, None, None)
        else:
            self.launch, self.head = run, ()
        self.function, self.meta = k.function, k.packed_metadata
        self.vals = tuple(v for n, v in consts.items() if n not in OPTIONS)

    def __call__(self, grid, args, stream):
        n = len(grid)
        raw = [a.data_ptr() if hasattr(a, "data_ptr") else a for a in args]
        head = self.head
        if self.pdl and _now and head:
            head = (head[0], True, None, None)
        self.launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, self.function, *head,
                    self.meta, None, None, None, *raw, *self.vals)


def _c_entry(k, kernel, key, nargs, nconsts):
    """An ``Entry`` for the C path, or None where the compiled kernel needs Triton's launcher."""
    import triton

    if _C is None or not triton.__version__.startswith("3.6"):
        return None  # the two trailing scratch parameters are Triton 3.6's calling convention
    run, md = k.run, k.metadata
    if not all(hasattr(md, a) for a in ("launch_cooperative_grid", "launch_pdl", "num_ctas")):
        return None
    if (run.global_scratch_size or run.profile_scratch_size or md.launch_cooperative_grid or md.launch_pdl
            or md.num_ctas != 1 or k.function is None):
        return None
    kd = kinds(key, nconsts)
    sig = getattr(getattr(k, "src", None), "signature", None) or {}
    for name, kind in zip(kernel.arg_names[:nargs], kd):
        t = sig.get(name)
        if t is None or (t.startswith("*") and kind != "p") or (not t.startswith("*") and _KIND_OF_SIG.get(t) != kind):
            return None
    num_warps, _, shared = k.packed_metadata
    return _C.Entry(k.function, 32 * num_warps, shared, kd, pdl_of(kernel))


_cache: dict = {}  # the C path's (shared with the C module)
_py_cache: dict = {}  # the Python path's
_alive: set = set()
_C = None
_stream = _device = None


def _check_order(kernel, args, consts):
    """Every constexpr named, after the runtime arguments, in the kernel's order (the key holds
    their values by position; a default left out would shift them), and a warp count the GPU
    compiler takes."""
    names = kernel.arg_names
    cx = [k for k in consts if k not in OPTIONS]
    if cx != names[len(args):]:
        raise TypeError(f"{kernel.__name__}: constexprs must follow the runtime arguments in order {names}")
    w = consts.get("num_warps", 4)
    if not (isinstance(w, int) and 1 <= w <= 32 and w & (w - 1) == 0):  # the GPU compiler refuses any other
        raise ValueError(f"{kernel.__name__}: num_warps must be a power of two up to 32, got {w!r}")


def _compile(kernel, grid, args, consts, key, cache):
    _check_order(kernel, args, consts)
    k = kernel[grid](*args, **consts)
    _alive.add(kernel)  # keys hold id(kernel): the kernel outlives its entries
    c = _c_entry(k, kernel, key, len(args), len(consts)) if cache is _cache else None
    cache[key] = c or _Entry(k, consts, pdl_of(kernel))


def _miss(kernel, grid, args, consts, key):
    """The C path's way back: compile a new key through Triton, or run a key Triton's launcher serves."""
    if key is None:  # an argument the key cannot read (not a tensor, int, float, bool or None)
        kernel[grid](*args, **consts)
        return None
    e = _cache.get(key)
    if e is None:
        return _compile(kernel, grid, args, consts, key, _cache)
    e(grid, args, _stream(key[1]))
    return None


def _py_launch(kernel, grid, *args, **consts):
    """The same launcher without the C module (no compiler): the key in Python, Triton's C launcher."""
    dev = _device()
    try:
        key = py_key(kernel, dev, args, consts)
    except TypeError:  # an argument the key cannot read: Triton's own launch
        kernel[grid](*args, **consts)
        return None
    e = _py_cache.get(key)
    if e is None:
        return _compile(kernel, grid, args, consts, key, _py_cache)
    e(grid, args, _stream(dev))
    return None


def _interpret_launch(kernel, grid, *args, **consts):
    _check_order(kernel, args, consts)  # the GPU launchers' rule, so the CPU run refuses what they would
    kernel[grid](*args, **consts)


def _setup():
    """The launcher for this process: the interpreter's, the C one, or the Python one."""
    global _C, _stream, _device
    if _INTERPRET:
        return _interpret_launch, "interpret"
    import torch

    if not hasattr(torch._C, "_cuda_getDevice"):  # a CPU-only torch: nothing to launch on
        return _py_launch, "python"
    _stream, _device = torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice
    if os.environ.get("V4STACK_LAUNCH", "c") == "c":
        try:
            _C = build_c()
            _C.init(_cache, _miss, torch.Tensor, _device, _stream)
            return _C.launch, "c"
        except Exception as e:  # no compiler or headers: the Python path, and say why
            global SETUP_ERROR
            SETUP_ERROR = repr(e)[:300]
            _C = None
    return _py_launch, "python"


SETUP_ERROR = None
launch, PATH = _setup()
py_launch = _py_launch
