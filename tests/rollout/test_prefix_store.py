"""The on-disk prefix store (serve/cache/disk.py): a cold engine restoring a prefix from disk gives
the logits of an engine that computed everything, under each SWA strategy, for prefixes at
lcm(m, m') boundaries, one token either side, and ending inside a block."""

from __future__ import annotations

import pytest
import torch

from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.serve.cache.disk import DiskPrefixStore, SWAStrategy
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams

B = 16  # tiny: lcm(m=4, m'=16)


@pytest.fixture(scope="module")
def model():
    return V4Model(preset("tiny"), seed=0).cast(torch.float32).eval()


def engine(model):
    return Engine(model, EngineConfig(n_blocks=64, n_slots=4))


def first_logits(eng, prompt, rid="r"):
    """Logits of the step that samples the first token, and the tokens of a short decode."""
    seen = []
    orig = eng.model.step

    def spy(inputs):
        out = orig(inputs)
        seen.append([o[-1].clone() for o in out])
        return out

    eng.model.step = spy
    try:
        req = eng.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.7, seed=5), rid)
        while eng.has_work():
            eng.step()
    finally:
        del eng.model.step
    return seen[-3][0], req.output, req.cache


def prompt(n, salt=0):
    g = torch.Generator().manual_seed(1000 + salt)
    return torch.randint(1, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("strategy", ["full", "periodic:32"])
@pytest.mark.parametrize("plen", [15, 16, 17, 31, 32, 33, 47, 70])
def test_restore_equals_never_evicted(model, tmp_path, strategy, plen):
    base = prompt(80)
    full = base[:plen] + prompt(5, salt=plen)  # the shared prefix, then a new tail
    ref_logits, ref_out, _ = first_logits(engine(model), full)
    warm = engine(model)
    first_logits(warm, base[:plen] + [7, 7, 7])  # computes (and publishes) the prefix's blocks
    store = DiskPrefixStore(tmp_path, warm.cache, strategy)
    assert store.save(base[:plen]) > 0 or plen < B
    cold = engine(model)
    store = DiskPrefixStore(tmp_path, cold.cache, strategy)
    info = store.restore(full)
    period = B if strategy == "full" else 32
    expect = (min(plen, len(full) - 1) // period) * period  # the last kept boundary inside the prefix
    assert info.hit_tokens == expect and info.state_loaded == (expect > 0)
    logits, out, _ = first_logits(cold, full)
    assert torch.equal(logits, ref_logits) and out == ref_out
    hit = cold.cache.prefix_hit_tokens
    assert hit == expect  # the engine computed exactly len(full) - expect tokens


def test_corrupt_files_are_absent(model, tmp_path):
    base = prompt(64)
    warm = engine(model)
    first_logits(warm, base)
    DiskPrefixStore(tmp_path, warm.cache, "full").save(base)
    # flip a byte in the state file of the last boundary (64): restore falls back to 48
    cold = engine(model)
    store = DiskPrefixStore(tmp_path, cold.cache, "full")
    hashes = store._hashes(base, 4)
    p = tmp_path / f"s-{hashes[3].hex()}"
    b = bytearray(p.read_bytes())
    b[-3] ^= 1
    p.write_bytes(bytes(b))
    info = store.restore(base + [1, 2])
    assert info.hit_tokens == 48 and not p.exists()
    ref_logits, ref_out, _ = first_logits(engine(model), base + [1, 2])
    logits, out, _ = first_logits(cold, base + [1, 2])
    assert torch.equal(logits, ref_logits) and out == ref_out


def test_strategy_errors_name_the_field():
    assert SWAStrategy.parse("periodic:48", 16).period == 48
    for bad in ("periodic:40", "periodic:0", "periodic:x", "sometimes"):
        with pytest.raises(ValueError, match="strategy"):
            SWAStrategy.parse(bad, 16)
    with pytest.raises(ValueError, match="'none' is not available"):
        SWAStrategy.parse("none", 16)
