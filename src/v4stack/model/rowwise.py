"""Row steps: the calls where parameters meet rows, marked so a trainer can see them.

A row step is a call whose every output row depends only on the same row of its row arguments
(dim 0 of its tensor arguments) and on parameters: a linear layer, a norm, mHC's coefficients, the
attention sink's softmax, the experts, the embedding. ``step(fn, *args, params=(i, ...))`` runs
``fn(*args)`` (``args[i]`` are the parameters); ``module_step(module, forward, *args)`` runs
``forward(*args)`` for a module whose forward is a row step over all of its own parameters.

Without a hook both are plain calls. A trainer may install a hook (``installed(hook)``): the call
then goes to ``hook.call(fn, args, params)`` / ``hook.call_module(module, args)``, which may run
the rows in pieces with stand-ins for the parameters (the chunk-ordered weight gradients of
``train/chunk_grads.py``). Inside a hook's own calls no hook is installed.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_HOOK: contextvars.ContextVar = contextvars.ContextVar("v4stack_row_hook", default=None)


def step(fn, *args, params: tuple[int, ...] = ()):
    hook = _HOOK.get()
    return fn(*args) if hook is None else hook.call(fn, args, params)


def hooked() -> bool:
    """Whether a hook is installed (a caller may then keep its row steps apart)."""
    return _HOOK.get() is not None


def module_step(module, forward, *args):
    hook = _HOOK.get()
    return forward(*args) if hook is None else hook.call_module(module, args)


@contextlib.contextmanager
def installed(hook) -> Iterator[None]:
    """Route row steps to ``hook`` inside the block (``None``: plain calls)."""
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)
