"""One dispatch table for every op: ``(op, mode, format, device) -> implementation``.

An implementation is registered under a key whose parts may be ``"*"`` (any). A call resolves
its key to an ordered list of candidates - the exact key first, then keys with wildcards, most
specific first - and runs the first one that ``accepts`` the call (a kernel's contract: shapes,
strides, alignment; ``None`` accepts everything). The resolved list is cached per key, so a call
costs one dict lookup plus the accepting check.

Formats are dtype names (``"bfloat16"``, ``"float32"``) or weight formats (``"float8_e4m3fn"``
for V4's block-scaled FP8 weights); for GEMM-like ops the format is the weight's.

Every call is counted: ``counters()`` returns ``{site: {implementation: calls}}``, where the
site is the innermost ``call_site(name)`` block joined to the op (``"attn.wq:linear"``), or the
op alone outside any block. Benchmark results carry these counts, so a number always says which
implementation produced it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

ANY = "*"


@dataclass(frozen=True)
class Impl:
    name: str
    fn: Callable[..., Any]
    accepts: Callable[..., bool] | None = None


class NoImplementation(LookupError):
    """No registered implementation accepts a call."""


_lock = threading.Lock()
_table: dict[tuple[str, str, str, str], list[Impl]] = {}
_resolved: dict[tuple[str, str, str, str], tuple[Impl, ...]] = {}
_counts: dict[str, dict[str, int]] = {}
_site: contextvars.ContextVar[str | None] = contextvars.ContextVar("v4stack_ops_site", default=None)


def register(op: str, name: str, fn: Callable[..., Any], *, mode: str = ANY, fmt: str = ANY, device: str = ANY,
             accepts: Callable[..., bool] | None = None, first: bool = False) -> Impl:
    """Add ``fn`` (called ``name``) for ``(op, mode, fmt, device)``; ``first`` puts it ahead of the
    key's earlier entries. Registering a name again under the same key replaces it."""
    impl = Impl(name, fn, accepts)
    key = (op, mode, fmt, device)
    with _lock:
        lst = [i for i in _table.get(key, []) if i.name != name]
        lst.insert(0, impl) if first else lst.append(impl)
        _table[key] = lst
        _resolved.clear()
    return impl


def _candidates(key: tuple[str, str, str, str]) -> tuple[Impl, ...]:
    got = _resolved.get(key)
    if got is not None:
        return got
    op, mode, fmt, dev = key
    out: list[Impl] = []
    with _lock:
        # most specific first: device beats format beats mode (a CUDA kernel for any dtype wins
        # over a CPU-or-GPU reference for this dtype)
        order = [(m, f, d) for d in (dev, ANY) for f in (fmt, ANY) for m in (mode, ANY)]
        seen = set()
        for m, f, d in order:
            for impl in _table.get((op, m, f, d), ()):
                if impl.name not in seen:
                    seen.add(impl.name)
                    out.append(impl)
        got = tuple(out)
        _resolved[key] = got
    return got


def resolve(op: str, mode: str, fmt: str, device: str, *args, **kw) -> Impl:
    """The implementation a call with these arguments would run."""
    key = (op, mode, fmt, device)
    for impl in _resolved.get(key) or _candidates(key):
        if impl.accepts is None or impl.accepts(*args, **kw):
            return impl
    raise NoImplementation(f"ops.{op}: no implementation for mode={mode} format={fmt} device={device}")


def call(op: str, mode: str, fmt: str, device: str, *args, **kw):
    """Run the first accepting implementation of ``op`` for the key, counting it. (``resolve``
    inlined: this is every op's host path.)"""
    key = (op, mode, fmt, device)
    for impl in _resolved.get(key) or _candidates(key):
        acc = impl.accepts
        if acc is None or acc(*args, **kw):
            break
    else:
        raise NoImplementation(f"ops.{op}: no implementation for mode={mode} format={fmt} device={device}")
    site = _site.get()
    per = _counts.get(op if site is None else f"{site}:{op}")
    if per is None:
        per = _counts.setdefault(op if site is None else f"{site}:{op}", {})
    name = impl.name
    per[name] = per.get(name, 0) + 1
    return impl.fn(*args, **kw)


def table() -> dict[str, list[str]]:
    """Every registered key (``op/mode/format/device``) and its implementations, in order."""
    with _lock:
        return {"/".join(k): [i.name for i in v] for k, v in sorted(_table.items())}


@contextlib.contextmanager
def call_site(name: str) -> Iterator[str]:
    """Count the ops called inside the block under ``name`` (nested blocks join with ``.``)."""
    outer = _site.get()
    token = _site.set(name if outer is None else f"{outer}.{name}")
    try:
        yield name
    finally:
        _site.reset(token)


def counters() -> dict[str, dict[str, int]]:
    """``{site_or_op: {implementation: calls}}`` since the last ``reset_counters()``."""
    return {k: dict(v) for k, v in _counts.items()}


def reset_counters() -> None:
    _counts.clear()
