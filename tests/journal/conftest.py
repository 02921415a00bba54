import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def shm_path(tmp_path):
    """A fresh directory in memory (/dev/shm) when there is one, else ``tmp_path``: the damage
    matrix opens hundreds of journals and each open fsyncs what it keeps; on a shared disk those
    fsyncs, not the checks, would be the cost. The bytes and the checks are the same."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(prefix="v4stack-journal-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def shm_module(tmp_path_factory):
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield tmp_path_factory.mktemp("templates")
        return
    d = Path(tempfile.mkdtemp(prefix="v4stack-journal-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
