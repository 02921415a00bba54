"""Programmatic dependent launch (``kernels/gdc.py``, ``kernels/launch.py``).

- the launcher starts a kernel programmatically only where its body opens with ``pdl_enter()``
  (the inverse: the call anywhere else, or missing, is refused), and only inside
  ``programmatic(True)``; every Triton kernel of the project opens so;
- the Hopper builds wait before their first memory access;
- on the GPU (``gpu``): a kernel that waits, launched programmatically after a slow writer, reads
  what the writer wrote; the inverse control - the same launch of a reader without the wait, by the
  C path and by Triton's launcher - reads the buffer before the writer wrote it, so the launch does
  overlap and the wait is what makes it safe.
"""

import ast
import glob
import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from v4stack.kernels import launch as L  # noqa: E402
from v4stack.kernels.gdc import opens_with_wait, pdl_enter  # noqa: E402

KERNELS = os.path.join(os.path.dirname(L.__file__), "triton_*.py")


def test_only_a_body_that_opens_with_the_wait_counts():
    assert opens_with_wait("def k(X):\n    pdl_enter()\n    tl.store(X, 1)\n")
    assert opens_with_wait('def k(X):\n    """doc"""\n    pdl_enter()\n    tl.store(X, 1)\n')
    # inverse controls: a load first, no call, a call with arguments, another function
    assert not opens_with_wait("def k(X):\n    x = tl.load(X)\n    pdl_enter()\n")
    assert not opens_with_wait("def k(X):\n    tl.store(X, 1)\n")
    assert not opens_with_wait("def k(X):\n    pdl_enter(X)\n")
    assert not opens_with_wait("def k(X):\n    gdc_wait()\n    tl.store(X, 1)\n")


def test_every_project_kernel_opens_with_the_wait():
    """Each ``@triton.jit`` function named ``*_kernel`` (what the wrappers launch) is launched
    programmatically on Hopper, so none may touch memory before the wait."""
    seen = 0
    for path in sorted(glob.glob(KERNELS)):
        src = open(path).read()
        for node in ast.parse(src).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                seen += 1
                assert opens_with_wait(ast.get_source_segment(src, node)), f"{path}: {node.name}"
    assert seen >= 40


def test_the_c_path_takes_the_flag():
    c = L.build_c()
    e = c.Entry(0, 128, 0, "pl", True)
    assert isinstance(e, c.Entry) and isinstance(c.Entry(0, 128, 0, "pl"), c.Entry)
    assert c.set_pdl(True) is False and c.set_pdl(False) is True and c.set_pdl(False) is False


def test_programmatic_scopes_nest_and_restore():
    assert L._now is False
    with L.programmatic(True):
        assert L._now is True
        with L.programmatic(False):
            assert L._now is False
        assert L._now is True
    assert L._now is False


def test_hopper_builds_wait_before_their_first_memory_access():
    from tests.ops.hopper import ptx

    got = ptx(("layout_in", "feed_ids", "rms_norm", "grouped_gemm_bf16_tma", "wide_partials", "finish_read_norm",
               "moe_route_e8", "sparse_attention_online"))
    for name, src in got.items():
        body = src[src.index(".entry"):]
        w = body.index("griddepcontrol.wait")
        assert "griddepcontrol.launch_dependents" in body, name
        for op in ("ld.global", "st.global", "cp.async", "atom.global", "red.global"):
            assert op not in body[:w], (name, op)


@triton.jit
def _slow_writer_kernel(Y, SPIN, BLOCK: tl.constexpr):
    pdl_enter()
    i = tl.arange(0, BLOCK)
    acc = i.to(tl.float32)
    for _ in range(SPIN):
        acc = acc * 0.5 + 1.0
    tl.store(Y + i, acc + 1.0)


@triton.jit
def _reader_kernel(Y, Z, BLOCK: tl.constexpr):
    pdl_enter()
    i = tl.arange(0, BLOCK)
    tl.store(Z + i, tl.load(Y + i))


@triton.jit
def _racing_reader(Y, Z, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(Z + i, tl.load(Y + i))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper GPU")
def test_a_programmatic_launch_overlaps_and_the_wait_orders_it():
    assert L.PATH == "c", L.SETUP_ERROR
    assert L.pdl_of(_reader_kernel) and L.pdl_of(_slow_writer_kernel) and not L.pdl_of(_racing_reader)
    B, spin = 128, 400_000  # the writer's one program runs for ~1 ms
    y, z = torch.zeros(B, device="cuda"), torch.zeros(B, device="cuda")
    want = torch.zeros(B, device="cuda")
    L.launch(_slow_writer_kernel, (1,), want, spin, BLOCK=B)  # built (the first call goes through Triton)
    L.launch(_reader_kernel, (1,), want, z, BLOCK=B)
    L.launch(_racing_reader, (1,), want, z, BLOCK=B)
    k = _racing_reader[(1,)](want, z, BLOCK=B, launch_pdl=True)
    torch.cuda.synchronize()
    assert bool((want > 0).all())
    # the racing reader through the C path, launched programmatically all the same
    key = L._C.key(_racing_reader, torch.cuda.current_device(), (want, z), {"BLOCK": B})
    num_warps, _, shared = k.packed_metadata
    racing = L._C.Entry(k.function, 32 * num_warps, shared, L.kinds(key, 1), True)

    def trial(read) -> bool:
        y.zero_()
        z.fill_(-1.0)
        with L.programmatic(True):
            L.launch(_slow_writer_kernel, (1,), y, spin, BLOCK=B)
            read()
        torch.cuda.synchronize()
        return torch.equal(z, y) and torch.equal(y, want)

    assert all(trial(lambda: L.launch(_reader_kernel, (1,), y, z, BLOCK=B)) for _ in range(5))
    # inverse controls: without the wait, a programmatic launch reads y before the writer wrote it
    assert not any(trial(lambda: _racing_reader[(1,)](y, z, BLOCK=B, launch_pdl=True)) for _ in range(3))
    assert bool((z == 0).all())  # it read the zeros
    L._cache[key] = racing
    try:
        assert not any(trial(lambda: L.launch(_racing_reader, (1,), y, z, BLOCK=B)) for _ in range(3))
    finally:
        del L._cache[key]
    # launched the usual way, the same reader is ordered after the writer; and outside
    # programmatic(True) the C path launches even the racing entry the usual way
    assert all(trial(lambda: L.launch(_racing_reader, (1,), y, z, BLOCK=B)) for _ in range(3))
    L._cache[key] = racing
    try:
        y.zero_()
        L.launch(_slow_writer_kernel, (1,), y, spin, BLOCK=B)
        L.launch(_racing_reader, (1,), y, z, BLOCK=B)
        torch.cuda.synchronize()
        assert torch.equal(z, want)
    finally:
        del L._cache[key]
