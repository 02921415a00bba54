"""Sandbox substrates behind one interface; see ``base.Substrate``.

``NAMES`` lists every substrate this build knows; the escape suite attacks each of them. A new
substrate (a microVM, a full VM) registers here with the class that implements ``base.Substrate``.
"""

from __future__ import annotations

import importlib

_REGISTRY = {
    "process": "v4stack.dsec.substrates.process:ProcessSubstrate",
    "container": "v4stack.dsec.substrates.container:ContainerSubstrate",
}
NAMES = tuple(_REGISTRY)


def cls(name: str):
    from v4stack.dsec.errors import BadRequest

    if name not in _REGISTRY:
        raise BadRequest(f"substrate={name!r}: allowed {', '.join(NAMES)}", "substrate")
    mod, _, attr = _REGISTRY[name].partition(":")
    return getattr(importlib.import_module(mod), attr)


def supports_allow(name: str) -> bool:
    """Whether the substrate takes an egress allow-list (``network.allow``)."""
    return bool(getattr(cls(name), "supports_allow", False))


def get(name: str, home, **kw):
    return cls(name)(home, **kw)
