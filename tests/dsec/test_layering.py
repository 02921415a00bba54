"""House rule: dsec never imports the model or torch."""

from __future__ import annotations

import subprocess
import sys


def test_dsec_imports_neither_torch_nor_the_model():
    code = ("import sys\n"
            "import v4stack.dsec.apiserver, v4stack.dsec.edge, v4stack.dsec.watcher, v4stack.dsec.cli, "
            "v4stack.dsec.client, v4stack.dsec.substrates.process, "
            "v4stack.dsec.substrates.container, v4stack.journal\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'v4stack.model'))]\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"dsec pulled in: {out}"
