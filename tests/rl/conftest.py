"""A local DSec (apiserver + watcher in this process, one edge process) shared by the rl tests."""

from __future__ import annotations

import os
import shutil

import pytest


def dsec_missing() -> str | None:
    if os.geteuid() != 0:
        return "DSec sandboxes need root (namespaces, cgroups)"
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    return None


@pytest.fixture(scope="session")
def dsec(tmp_path_factory):
    why = dsec_missing()
    if why:
        pytest.skip(why)
    from v4stack.rl.sandboxes import LocalDsec

    d = LocalDsec(tmp_path_factory.mktemp("rl-dsec"), edges=1, pool=2)
    yield d
    d.close()
