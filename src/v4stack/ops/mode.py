"""Which implementation the ops run (``fast`` or ``invariant``), and explicit float semantics.

- ``fast``: framework defaults (MKL / cuBLAS GEMMs, torch reductions and pointwise kernels). A
  row's result may change with the batch it shares a call with.
- ``invariant``: every output row is reduced in an order fixed by the reduced width alone, so a
  request gets bit-identical results alone or inside any batch, at any position.

``set_mode`` changes the process default; ``mode(...)`` overrides it for a ``with`` block (per
thread / task, through a context variable).

Float semantics are explicit: every op runs IEEE round-to-nearest with no reassociation beyond
its documented order, unless its call site passes a ``FloatSemantics`` obtained from
``opt_in(site, tf32=..., fast_math=...)``. Opt-ins are recorded (``recorded()``) and refused in
``invariant`` mode.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass
from typing import Iterator

MODES = ("fast", "invariant")

_default = "fast"
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("v4stack_ops_mode", default=None)


class FloatSemanticsError(RuntimeError):
    """A relaxed float semantics (TF32, fast math) was asked for where it is refused."""


def _check_mode(name: str) -> str:
    if name not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {name!r}")
    return name


def get_mode() -> str:
    """The active mode: the innermost ``mode(...)`` block, else the process default."""
    m = _override.get()
    return m if m is not None else _default


def set_mode(name: str) -> str:
    """Set the process-wide default mode; returns the previous default."""
    global _default
    prev, _default = _default, _check_mode(name)
    return prev


@contextlib.contextmanager
def mode(name: str) -> Iterator[str]:
    """``with ops.mode("invariant"): ...`` runs the block in ``name`` mode."""
    token = _override.set(_check_mode(name))
    try:
        yield name
    finally:
        _override.reset(token)


# ---- explicit floating-point semantics -------------------------------------------------------


@dataclass(frozen=True)
class FloatSemantics:
    """How one call site may compute.

    ``tf32``: fp32 GEMM inputs may be rounded to TF32 (10-bit mantissa) on tensor cores.
    ``fast_math``: reassociation and approximate intrinsics are allowed (reduced-precision
    reductions on CUDA; the kernels' fast-math pass config). ``site`` names the call site.
    Rounding is always IEEE round-to-nearest-even; no other mode is offered.
    """

    site: str = ""
    tf32: bool = False
    fast_math: bool = False

    @property
    def relaxed(self) -> bool:
        return self.tf32 or self.fast_math


IEEE = FloatSemantics()

_lock = threading.Lock()
_sites: dict[str, FloatSemantics] = {}
_uses: dict[str, int] = {}


def opt_in(site: str, *, tf32: bool = False, fast_math: bool = False) -> FloatSemantics:
    """Declare that call site ``site`` may use TF32 and/or fast math; returns its semantics.

    A site is declared once; declaring it again with other flags is an error, so one name
    cannot silently mean two things.
    """
    if not site or not isinstance(site, str):
        raise ValueError(f"site must be a non-empty string naming the call site, got {site!r}")
    fp = FloatSemantics(site=site, tf32=bool(tf32), fast_math=bool(fast_math))
    with _lock:
        old = _sites.get(site)
        if old is not None and old != fp:
            raise ValueError(f"site {site!r} already opted in as tf32={old.tf32} fast_math={old.fast_math}")
        _sites[site] = fp
        _uses.setdefault(site, 0)
    return fp


def admit(op: str, fp: FloatSemantics | None) -> FloatSemantics:
    """Check ``fp`` for ``op`` under the active mode, count the use, return it (IEEE if None).

    Invariant mode refuses relaxed semantics: TF32 rounds GEMM inputs and fast math reorders
    sums, and either makes results depend on kernel choice.
    """
    fp = IEEE if fp is None else fp
    if not fp.relaxed:
        return fp
    if get_mode() == "invariant":
        flags = [n for n, on in (("tf32", fp.tf32), ("fast_math", fp.fast_math)) if on]
        raise FloatSemanticsError(
            f"ops.{op}: call site {fp.site!r} asks for {'+'.join(flags)}, refused in invariant mode"
        )
    with _lock:
        if _sites.get(fp.site) != fp:
            raise FloatSemanticsError(f"ops.{op}: site {fp.site!r} was not declared with ops.opt_in")
        _uses[fp.site] = _uses.get(fp.site, 0) + 1
    return fp


def recorded() -> dict[str, dict]:
    """Every declared relaxed site: its flags and how many calls used them."""
    with _lock:
        return {s: {"tf32": fp.tf32, "fast_math": fp.fast_math, "calls": _uses.get(s, 0)} for s, fp in _sites.items()}


_ieee_set = False


def ieee_cuda_flags() -> bool:
    """True when torch's CUDA matmul flags are IEEE (no TF32, no reduced-precision reductions).
    The first call sets them so for the process (torch's defaults allow reduced-precision bf16 /
    fp16 reductions); later calls only read them, so a GEMM under IEEE semantics pays no
    set-and-restore."""
    global _ieee_set
    import torch

    m = torch.backends.cuda.matmul
    if not _ieee_set:
        m.allow_tf32 = False
        m.allow_bf16_reduced_precision_reduction = False
        m.allow_fp16_reduced_precision_reduction = False
        _ieee_set = True
    return not (m.allow_tf32 or m.allow_bf16_reduced_precision_reduction or m.allow_fp16_reduced_precision_reduction)


@contextlib.contextmanager
def cuda_float_flags(fp: FloatSemantics) -> Iterator[None]:
    """Set torch's CUDA TF32 / reduced-precision flags to exactly ``fp`` for one call."""
    import torch

    m = torch.backends.cuda.matmul
    saved = (m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    m.allow_tf32 = fp.tf32
    m.allow_bf16_reduced_precision_reduction = fp.fast_math
    m.allow_fp16_reduced_precision_reduction = fp.fast_math
    try:
        yield
    finally:
        (m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction) = saved
