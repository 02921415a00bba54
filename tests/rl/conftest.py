"""Shared by the rl tests: a local DSec (apiserver + watcher in this process, one edge process)
and one directory of supervised policies per test session (each policy is trained once, by the
first test that asks for it, and reused by the rest)."""

from __future__ import annotations

import os
import shutil

import pytest

from v4stack.rl.policy import SFTConfig

# the default run's starting policy: 2 supervised steps (the loop's machinery, not its learning)
QUICK_SFT = SFTConfig(steps=2, batch_size=2, seq_len=32, corpus_bytes=20_000, threads=1)
# a policy that writes commands: after 60 steps, ~29 of 32 first turns at T=0.5 end with a newline
# within 24 tokens (measured), so every round of a few groups makes tool calls
TOOL_SFT = SFTConfig(steps=60, batch_size=8, seq_len=48, corpus_bytes=20_000, threads=1)


def dsec_missing() -> str | None:
    if os.geteuid() != 0:
        return "DSec sandboxes need root (namespaces, cgroups)"
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    return None


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The rl tests' models are tiny: one intra-op thread (on a shared, loaded machine more threads
    spin against each other: a tiny linear took 9 ms instead of microseconds)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def own_dsec(monkeypatch):
    """The loop starts its own DSec unless DSEC_API_URL names one; a value left in the environment
    by another suite (or the user's shell) must not send these tests to a foreign apiserver."""
    monkeypatch.delenv("DSEC_API_URL", raising=False)
    monkeypatch.delenv("DSEC_TOKEN", raising=False)


@pytest.fixture(scope="session")
def dsec(tmp_path_factory):
    why = dsec_missing()
    if why:
        pytest.skip(why)
    from v4stack.rl.sandboxes import LocalDsec

    d = LocalDsec(tmp_path_factory.mktemp("rl-dsec"), edges=1, pool=2)
    yield d
    d.close()


@pytest.fixture(scope="session")
def policy_root(tmp_path_factory):
    """Where the session's supervised policies live (``LoopConfig.policy``)."""
    return tmp_path_factory.mktemp("rl-policies")
