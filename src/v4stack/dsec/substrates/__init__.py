"""Sandbox substrates behind one interface; see ``base.Substrate``."""

from __future__ import annotations


def get(name: str, home):
    from v4stack.dsec.errors import BadRequest

    if name == "process":
        from v4stack.dsec.substrates.process import ProcessSubstrate

        return ProcessSubstrate(home)
    if name == "container":
        from v4stack.dsec.substrates.container import ContainerSubstrate

        return ContainerSubstrate(home)
    raise BadRequest(f"substrate={name!r}: allowed process, container", "substrate")
