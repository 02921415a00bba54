"""Kernel contracts proved with Z3.

A ``Spec`` describes a kernel's index arithmetic over symbolic sizes: the contract it declares
(``requires``: sizes, divisibility as integer constraints), its grid, its per-program lanes
(loop counters and vector lanes), and every memory access as coordinates into the tensor's
logical shape, with the mask guarding it. A tensor's strides map coordinates to memory without
overlap (each stride at least the extent below it times its stride); the launcher checks that
part of the contract on the call's tensors, so the proofs stay linear in the kernel's
variables. ``prove(spec)`` asks Z3 for a shape that meets the
contract and breaks a property:

- ``bounds``: every unmasked-or-masked-in access lands inside its tensor;
- ``disjoint``: two different (program, lane) points never store to the same element;
- ``divides``: each claimed divisibility (a tile dividing a size) follows from the contract.

Each failure comes back with Z3's counterexample (the sizes, program ids and lanes). Sizes are
bounded (``DIM_MAX``) so the nonlinear index products stay decidable; every shape a V4 model
uses lies inside the bounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

DIM_MAX = 1 << 24
TIMEOUT_MS = 20000


class ContractError(RuntimeError):
    """A kernel's contract does not imply its safety properties; carries the counterexamples."""

    def __init__(self, spec: str, failures: list[dict]):
        self.spec, self.failures = spec, failures
        lines = [f"{f['property']} {f.get('access', '')}: {f['counterexample']}" for f in failures]
        super().__init__(f"kernel {spec}: contract does not prove\n  " + "\n  ".join(lines))


@dataclass(frozen=True)
class Access:
    tensor: str
    kind: str  # "load" or "store"
    coords: Callable  # ns -> tuple of z3 Int expressions (one per dimension)
    shape: Callable  # ns -> tuple of extents
    mask: Callable | None = None  # ns -> z3 Bool (the access happens only where True)
    lanes: tuple[str, ...] | None = None  # lanes that vary this access (stores: for disjointness)


@dataclass(frozen=True)
class Spec:
    name: str
    dims: tuple[str, ...]  # symbolic sizes (>= 1 unless ``requires`` says otherwise)
    grid: Callable  # ns -> {program axis name: extent expression}
    lanes: Callable  # ns -> {lane name: extent expression}
    accesses: tuple[Access, ...]
    requires: Callable = lambda ns: []  # ns -> [z3 Bool]: the contract
    data: Callable = lambda ns: {}  # ns -> {name: (lo, hi_exclusive)}: values loaded and used as indices
    divides: tuple[tuple[str, Callable], ...] = field(default_factory=tuple)  # (claim, ns -> z3 Bool)
    zero_ok: tuple[str, ...] = ()  # dims that may be 0
    relate: Callable = lambda a, b: []  # (copy, copy) -> [z3 Bool]: what data values of two programs share
    program_data: tuple[str, ...] = ()  # data that names the work item (part of "a different program")
    requires_data: Callable = lambda ns: []  # ns -> [z3 Bool]: facts about one program's data values


class _NS:
    """Names for one copy of the kernel's variables (dims shared, program ids / lanes per copy)."""

    def __init__(self, vals: dict):
        self.__dict__.update(vals)


def cdiv(a, b):
    return (a + b - 1) / b  # z3 integer division (b > 0) is floor division


def _model_dict(m, names) -> dict:
    out = {}
    for n, v in names.items():
        val = m.eval(v, model_completion=True)
        out[n] = val.as_long() if hasattr(val, "as_long") else str(val)
    return out


def prove(spec: Spec) -> list[dict]:
    """Every failure (property, access, counterexample); empty when the contract proves."""
    import z3

    dims = {d: z3.Int(d) for d in spec.dims}
    base = _NS(dict(dims))
    pre = [dims[d] >= (0 if d in spec.zero_ok else 1) for d in spec.dims] + [dims[d] <= DIM_MAX for d in spec.dims]
    pre += list(spec.requires(base))

    def copy(tag: str):
        vals = dict(dims)
        axes = {a: z3.Int(f"{a}{tag}") for a in spec.grid(base)}
        lanes = {a: z3.Int(f"{a}{tag}") for a in spec.lanes(base)}
        data = {a: z3.Int(f"{a}{tag}") for a in spec.data(base)}
        vals.update(axes, **lanes, **data)
        ns = _NS(vals)
        cons = []
        for a, ext in spec.grid(ns).items():
            cons += [axes[a] >= 0, axes[a] < ext]
        for a, ext in spec.lanes(ns).items():
            cons += [lanes[a] >= 0, lanes[a] < ext]
        for a, (lo, hi) in spec.data(ns).items():
            cons += [data[a] >= lo, data[a] < hi]
        cons += list(spec.requires_data(ns))
        return ns, cons, {**axes, **lanes, **data}

    failures = []

    def check(prop: str, access: str, extra, names):
        s = z3.Solver()
        s.set("timeout", TIMEOUT_MS)
        s.add(*pre, *extra)
        r = s.check()
        if r == z3.sat:
            failures.append({"property": prop, "access": access,
                             "counterexample": _model_dict(s.model(), {**dims, **names})})
        elif r == z3.unknown:
            failures.append({"property": prop, "access": access, "counterexample": "unknown (solver gave up)"})

    for claim, f in spec.divides:
        check("divides", claim, [z3.Not(f(base))], {})
    ns, cons, names = copy("")
    for acc in spec.accesses:
        m = [acc.mask(ns)] if acc.mask else []
        out = [z3.Or(c < 0, c >= e) for c, e in zip(acc.coords(ns), acc.shape(ns))]
        check("bounds", f"{acc.kind} {acc.tensor}", cons + m + [z3.Or(*out)], names)
    ns2, cons2, names2 = copy("_b")
    for acc in spec.accesses:
        if acc.kind != "store":
            continue
        lanes = acc.lanes if acc.lanes is not None else tuple(spec.lanes(base))
        point = list(spec.grid(base)) + list(lanes) + list(spec.program_data)
        differ = z3.Or(*[names[p] != names2[p] for p in point])
        m = ([acc.mask(ns), acc.mask(ns2)] if acc.mask else [])
        same = [a == b for a, b in zip(acc.coords(ns), acc.coords(ns2))]
        rel = list(spec.relate(ns, ns2))
        both = {**names, **{f"{k}_b": v for k, v in names2.items()}}  # the second program's values as x_b
        check("disjoint", f"store {acc.tensor}", cons + cons2 + rel + m + [differ, *same], both)
    return failures


_proved: dict[str, bool] = {}


def require(spec: Spec) -> None:
    """Prove ``spec`` once per process (when its kernel is first built); raise with the
    counterexamples if it does not prove."""
    if _proved.get(spec.name):
        return
    failures = prove(spec)
    if failures:
        raise ContractError(spec.name, failures)
    _proved[spec.name] = True
