"""The light launcher's C path builds on the CPU and reads arguments as Triton does.

- its key separates exactly what Triton's own specialisation separates (dtype, 16-byte alignment,
  int == 1 / i32 / i64 / u64 and 16-divisibility, bool, float, None), and the Python fallback
  computes the same key;
- the parameter kinds read from a key are the types Triton's specialisation gives, and the bytes
  packed for a kernel are the little-endian values ``struct`` writes;
- a key not in the cache goes to the fallback with that key; the inverse control: a kernel whose
  argument changes dtype or alignment gets another key.
On the GPU (``gpu``): the C path's results equal Triton's own launch bit for bit for each new
specialisation, and each one is compiled once.
"""

import struct

import pytest
import torch

triton = pytest.importorskip("triton")
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

from v4stack.kernels import launch as L  # noqa: E402


@pytest.fixture(scope="module")
def C():
    c = L.build_c()  # the system C compiler, as the GPU machine builds it
    return c


def _triton_spec(a):
    return native_specialize_impl(BaseBackend, a, False, True, True)


def _samples():
    x = torch.zeros(64)
    return [x, x[1:], x[4:], x.to(torch.bfloat16), x.to(torch.bfloat16)[1:], torch.zeros(8, dtype=torch.int64),
            1, 0, 16, 17, -5, -16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1, 2**62, 2**63, 2**63 + 16,
            True, False, 1.5, 0.0, None]


def test_key_classes_are_tritons(C):
    misses = []
    C.init({}, lambda *a: misses.append(a), torch.Tensor, lambda: 0, lambda d: 0)
    args = _samples()
    keys = [C.key(None, 0, (a,), {})[2:] for a in args]
    specs = [_triton_spec(a) for a in args]
    for i in range(len(args)):
        for j in range(len(args)):
            same_key, same_spec = keys[i] == keys[j], specs[i] == specs[j]
            if type(args[i]) is int and type(args[j]) is int and specs[i][0] == "constexpr":
                same_spec = args[i] == args[j]  # Triton bakes an int equal to 1 into the kernel
            assert same_key == same_spec, (args[i], args[j], keys[i], keys[j], specs[i], specs[j])


def test_c_key_equals_python_key_and_kinds(C):
    C.init({}, lambda *a: None, torch.Tensor, lambda: 3, lambda d: 0)
    args = tuple(_samples())
    consts = dict(LOG=True, BLOCK=64, num_warps=4)
    k = object()
    key = C.key(k, 3, args, consts)
    assert key == L.py_key(k, 3, args, consts)
    assert key[:2] == (id(k), 3)
    kinds = L.kinds(key, len(consts))
    sig = {"constexpr": "s", "i32": "i", "i64": "l", "u64": "u", "u1": "b", "fp32": "f"}
    want = "".join("p" if _triton_spec(a)[0].startswith("*") else sig[_triton_spec(a)[0]] for a in args)
    assert kinds == want


def test_pack_writes_the_parameters(C):
    C.init({}, lambda *a: None, torch.Tensor, lambda: 0, lambda d: 0)
    x = torch.zeros(16)
    args = (x, 1, 17, 2**40 + 3, 2**63 + 1, True, 2.5, None, -7)
    key = C.key(None, 0, args, {})
    e = C.Entry(0, 128, 0, L.kinds(key, 0))
    got = C.pack(e, args)
    want = b"".join([struct.pack("<Q", x.data_ptr()), struct.pack("<i", 17) + b"\0" * 4, struct.pack("<q", 2**40 + 3),
                     struct.pack("<Q", 2**63 + 1), b"\1" + b"\0" * 7, struct.pack("<f", 2.5) + b"\0" * 4,
                     struct.pack("<i", -7) + b"\0" * 4, b"\0" * 16])  # then Triton 3.6's two scratch pointers
    assert got == want
    with pytest.raises(TypeError):
        C.pack(e, args[:-1])  # the wrong number of arguments is refused, not read past
    with pytest.raises(ValueError):
        C.Entry(0, 128, 0, "px")


def test_miss_goes_to_fallback_with_the_key_and_new_specialisations_miss(C):
    seen, cache = [], {}

    def fallback(kernel, grid, args, consts, key):
        seen.append(key)
        cache[key] = "python-entry"  # not an Entry: later hits come back to the fallback too
        return "fallback"

    C.init(cache, fallback, torch.Tensor, lambda: 0, lambda d: 0)
    k = object()
    x = torch.zeros(64)
    assert C.launch(k, (1,), x, 64, BLOCK=64) == "fallback"
    assert seen[-1] == C.key(k, 0, (x, 64), {"BLOCK": 64})
    C.launch(k, (1,), x, 64, BLOCK=64)
    assert seen[-1] == seen[-2]  # the same key again
    C.launch(k, (1,), x.to(torch.bfloat16), 64, BLOCK=64)
    C.launch(k, (1,), x[1:], 64, BLOCK=64)
    C.launch(k, (1,), x, 1, BLOCK=64)
    C.launch(k, (1,), x, 64, BLOCK=128)
    assert len(set(seen)) == 5  # dtype, alignment, an int equal to 1 and a constexpr each make a new key
    C.launch(k, (1,), x, "not a key argument", BLOCK=64)
    assert seen[-1] is None  # the fallback launches it through Triton itself


def test_entry_hit_without_a_driver_is_a_clear_error(C):
    import ctypes.util

    if ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver is installed")
    cache = {}
    C.init(cache, lambda *a: None, torch.Tensor, lambda: 0, lambda d: 0)
    k, x = object(), torch.zeros(64)
    key = C.key(k, 0, (x,), {})
    cache[key] = C.Entry(0, 128, 0, L.kinds(key, 0))
    with pytest.raises(RuntimeError, match="libcuda"):
        C.launch(k, (1,), x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_c_launch_equals_triton_per_specialisation():
    from v4stack.kernels import triton_rows as tr

    assert L.PATH == "c", L.SETUP_ERROR
    base = torch.randn(4, 80, device="cuda")
    # (input, new cache entries): one row of the first case is the same key (the grid is not in it)
    for x, new in ((base[:, :64], 1), (base[:, 1:65], 1), (base[:, :64].to(torch.bfloat16), 1), (base[:1, :64], 0),
                   (base.half()[:, 3:67], 1)):
        R, N = x.shape
        y, y2 = torch.empty(R, N, device="cuda", dtype=x.dtype), torch.empty(R, N, device="cuda", dtype=x.dtype)
        before = len(L._cache)
        for _ in range(2):
            L.launch(tr.softmax_kernel, (R,), x, y, N, x.stride(0), N, LOG=False, BLOCK=64)
        assert len(L._cache) == before + new  # compiled once for each new specialisation
        tr.softmax_kernel[(R,)](x, y2, N, x.stride(0), N, LOG=False, BLOCK=64)
        assert torch.equal(y, y2)
    assert any(isinstance(e, L._C.Entry) for e in L._cache.values())


def test_every_constexpr_is_named_in_order_or_the_call_is_refused():
    """The launch key holds constexpr values by position, so a call must name every one, in the
    kernel's order, defaults included; the CPU run (the interpreter's launch) refuses what the GPU
    launchers refuse - a call leaving out a defaulted constexpr was refused on the H200 and served
    by its torch composition while every CPU test passed."""
    from v4stack.kernels import triton_mhc as tm

    x = torch.randn(2, 3, 192).bfloat16()
    pos = torch.tensor([5, 9])
    freqs = 1.0 / (1e4 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    args = (x, torch.empty_like(x), pos, freqs, freqs, pos, 3, 192)
    full = dict(SIGN=1.0, HALF=32, BM=4, BD=128, HAS_DEST=False, COPY=True, BARRIER=False, TABLE=False, num_warps=4)
    with pytest.raises(TypeError, match="constexprs must follow"):
        L.launch(tm.rope_kernel, (2, 1), *args, **{k: v for k, v in full.items() if k != "BARRIER"})
    with pytest.raises(TypeError, match="constexprs must follow"):
        L.launch(tm.rope_kernel, (2, 1), *args, **dict(reversed(list(full.items()))))
    L.launch(tm.rope_kernel, (2, 1), *args, **full)  # control: named in order, it runs
    assert torch.equal(args[1], tm.rope(x, pos, freqs, False))
