"""Swapped, truncated and foreign files of the on-disk prefix store: each is a miss (removed, the
prefix recomputed), never a load, and the tokens equal those of an engine that computed everything.
Temp files of a killed save are removed at open. (The saved-KV cases are in tests/rollout/
test_preempt.py: delete, flip, wrong file, truncated, foreign.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.rollout.test_prefix_store import engine, first_logits, prompt
from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.serve.cache.disk import DiskPrefixStore

BASE = prompt(64)
FULL = BASE + [1, 2]


@pytest.fixture(scope="module")
def model():
    return V4Model(preset("tiny"), seed=0).cast(torch.float32).eval()


@pytest.fixture(scope="module")
def reference(model):
    logits, out, _ = first_logits(engine(model), FULL)
    return logits, out


def _saved_store(model, root):
    warm = engine(model)
    first_logits(warm, BASE)
    DiskPrefixStore(root, warm.cache, "full").save(BASE)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """This model's store for BASE, saved once; each test damages its own copy."""
    root = tmp_path_factory.mktemp("saved")
    _saved_store(model, root)
    return root


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """A store written by another model (other weights) for the same tokens: same file names."""
    root = tmp_path_factory.mktemp("foreign")
    _saved_store(V4Model(preset("tiny"), seed=1).cast(torch.float32).eval(), root)
    return root


def _damaged(model, saved, root, foreign, fault):
    shutil.copytree(saved, root, dirs_exist_ok=True)
    cold = engine(model)
    store = DiskPrefixStore(root, cold.cache, "full")
    h = [x.hex() for x in store._hashes(BASE, 4)]
    p = lambda kind, j: root / f"{kind}-{h[j]}"  # noqa: E731
    if fault == "swap_states":
        a, b = p("s", 3).read_bytes(), p("s", 2).read_bytes()
        p("s", 3).write_bytes(b)
        p("s", 2).write_bytes(a)
    elif fault == "swap_blocks":
        a, b = p("b", 0).read_bytes(), p("b", 1).read_bytes()
        p("b", 0).write_bytes(b)
        p("b", 1).write_bytes(a)
    elif fault == "truncate_state":
        p("s", 3).write_bytes(p("s", 3).read_bytes()[:-100])
    elif fault == "foreign_state":
        p("s", 3).write_bytes((foreign / p("s", 3).name).read_bytes())
    bad = {"swap_states": [p("s", 3), p("s", 2)], "swap_blocks": [p("b", 0)], "truncate_state": [p("s", 3)],
           "foreign_state": [p("s", 3)]}[fault]
    return cold, store, bad


@pytest.mark.parametrize("fault,expect_hit", [("swap_blocks", 0), ("truncate_state", 48), ("foreign_state", 48)])
def test_bad_files_are_misses(model, saved, foreign, tmp_path, fault, expect_hit):
    _, store, bad = _damaged(model, saved, tmp_path, foreign, fault)
    assert store.restore(FULL).hit_tokens == expect_hit
    assert not any(p.exists() for p in bad)  # refused and removed


def test_swapped_states_are_misses_and_tokens_equal(model, saved, reference, foreign, tmp_path):
    cold, store, bad = _damaged(model, saved, tmp_path, foreign, "swap_states")
    assert store.restore(FULL).hit_tokens == 32 and not any(p.exists() for p in bad)
    logits, out, _ = first_logits(cold, FULL)
    assert torch.equal(logits, reference[0][-logits.shape[0]:]) and out == reference[1]


def test_foreign_content_would_change_the_tokens(model, reference, foreign):
    """Inverse control: the other model's store, loaded by this model, changes the logits - what a
    foreign file accepted under our key would do."""
    cold = engine(model)
    assert DiskPrefixStore(foreign, cold.cache, "full").restore(FULL).hit_tokens == 64
    logits, _, _ = first_logits(cold, FULL)
    assert not torch.equal(logits, reference[0][-logits.shape[0]:])


def test_temp_files_of_dead_writers_are_removed_at_open(model, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = tmp_path / f".b-{'ab' * 16}.tmp-{dead}-deadbeef"
    live = tmp_path / f".s-{'cd' * 16}.tmp-{os.getpid()}-feedface"
    stale.write_bytes(b"half a block")
    live.write_bytes(b"being written")
    DiskPrefixStore(tmp_path, engine(model).cache, "full")
    assert not stale.exists() and live.exists()
