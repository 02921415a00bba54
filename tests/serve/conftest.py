import os
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A `v4stack serve` process on localhost; ``base`` is its URL."""

    def __init__(self, *args: str):
        self.port = free_port()
        cmd = [sys.executable, "-m", "v4stack.cli", "serve", "--preset", "tiny", "--port", str(self.port),
               "--n-blocks", "160", "--n-slots", "48", "--token-budget", "512", "--seed", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError("server did not come up")

    def close(self, timeout: float = 20) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


@pytest.fixture(scope="session")
def server():
    """A real `v4stack serve` process on localhost (tiny preset, random weights, seed 0)."""
    s = Served()
    yield s.base
    s.close()


@pytest.fixture(scope="session")
def reference_model():
    """The same weights as the server, for single-request reference decodes."""
    import torch

    from v4stack.config import preset
    from v4stack.model import V4Model

    return V4Model(preset("tiny"), seed=0).cast(torch.float32).eval()


def greedy_ref(model, prompt_ids, max_tokens):
    from v4stack.generate import generate_ids
    from v4stack.ops.mode import mode
    from v4stack.serve.sampling import SamplingParams

    with mode("invariant"):
        return generate_ids(model, prompt_ids, SamplingParams(max_tokens=max_tokens))
