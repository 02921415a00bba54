"""Programmatic dependent launch (Hopper): a kernel launched while the one before it finishes.

A kernel whose body opens with ``pdl_enter()`` waits there (``griddepcontrol.wait``) until every
kernel before it in the stream has finished and its writes are visible, then lets the kernel after
it be launched (``griddepcontrol.launch_dependents``). Nothing of such a kernel reads or writes
memory before the wait, so it may be launched with programmatic stream serialisation
(``kernels/launch.py`` does so for exactly the kernels that open with the call, ``opens_with_wait``):
its launch and its programs' placement overlap the previous kernel's last programs, instead of
starting after it has drained - inside a decode step's graph, where kernels of a few microseconds
follow each other, that launch gap is a large part of a small kernel's time.

Measured on an H100 (flash4 fast decode, ``bench/results/serve_pdl*_h100_*.json``): the early
release is what gains - without it (dependents placed as the programs exit) the steps took what
they take without programmatic launches (a924208) - and it gains at small batches: batch 1 / 16 /
64 1.57 -> 1.52, 1.84 -> 1.78, 1.94 -> 1.92 ms at 1k (fb967b7). At batch 256 the grouped expert
GEMM launched programmatically cost ~0.1 ms a step (50e39e9, by kernel set), so it is launched the
usual way (``triton_grouped_tma``); without it batch 256 still lost 0.02-0.03 ms, and
``serve/graphs.py`` opens the programmatic scope for graphs of up to 64 rows only.

A kernel after one that lets it launch early can only start its wait; the chain cannot run ahead,
since each kernel releases its successor only after its own wait returned. Without a programmatic
launch (any kernel launched the usual way, the CPU interpreter) the two instructions do nothing
(``ON`` is false under the interpreter, where inline PTX cannot run).
"""

import os

import triton
import triton.language as tl


def _on() -> bool:
    """Not under the interpreter, and not on a GPU older than Hopper (whose PTX has no
    ``griddepcontrol``); a machine without a GPU builds for Hopper (``kernels/builds.py``)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    import torch

    return not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] >= 9


ON = tl.constexpr(_on())


@triton.jit
def pdl_enter():
    if ON:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def opens_with_wait(src: str) -> bool:
    """Whether the kernel source ``src`` (a ``def``, as Triton keeps it) has ``pdl_enter()`` as the
    first statement of its body (after a docstring)."""
    import ast
    import textwrap

    fn = ast.parse(textwrap.dedent(src)).body[0]
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    first = body[0] if body else None
    return (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call) and not first.value.args
            and isinstance(first.value.func, ast.Name) and first.value.func.id == "pdl_enter")
