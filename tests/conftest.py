import os

import pytest
import torch

# Without CUDA the Triton kernels run in Triton's interpreter. Set here, before any test module
# (of any directory) imports a kernel: a kernel defined without it cannot run on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _interpreter_numpy2_shim():
    """Triton 3.6's interpreter turns a scalar into an int with ``int(array)`` on a 1-element
    array, which NumPy >= 2.3 refuses; use ``.item()`` (the value is the same)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_v4stack_shim", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._v4stack_shim = True
    interpreter._patch_lang_tensor = patched

    # its dot multiplies bfloat16 operands as their raw uint16 storage: widen them to fp32 first
    # (exact), as the GPU's MMA does
    import numpy as np
    import triton.language as tl

    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(h):
            if h.dtype.scalar == tl.bfloat16:
                data = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interpreter.TensorHandle(data, tl.float32)
            return h
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


_interpreter_numpy2_shim()
