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


@pytest.fixture(scope="session")
def server():
    """A real `v4stack serve` process on localhost (tiny preset, random weights, seed 0)."""
    port = free_port()
    cmd = [sys.executable, "-m", "v4stack.cli", "serve", "--preset", "tiny", "--port", str(port),
           "--n-blocks", "160", "--n-slots", "48", "--token-budget", "512", "--seed", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError("server did not come up")
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


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
