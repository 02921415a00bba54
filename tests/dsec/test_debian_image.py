"""The Debian image recipe (debootstrap minbase + python3): needs the Debian archive, ~2-3 minutes."""

from __future__ import annotations

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("sub", ["process", "container"])
def test_debian_image_runs_python(runtime, sub):
    runtime.images.build("debian")
    s = runtime.create("debian", sub)
    try:
        r = s.exec("python3 -c 'import sys; print(sys.version_info[0])'; cat /etc/debian_version")
        assert r["exit_code"] == 0 and r["stdout"].startswith("3\n"), r
    finally:
        runtime.kill(s.id)
