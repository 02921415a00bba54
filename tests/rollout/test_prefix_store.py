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
    """Logits of every position computed in the step that samples the first token, and the tokens
    of a short decode. Compare the last rows: a prefix hit computes fewer positions."""
    seen = []
    orig = eng.runner.run

    def spy(chunks, all_rows=False, draw=False):  # (returns logits: the engine samples them)
        out, rows, r = orig(chunks, all_rows=True), [], 0
        for _, toks in chunks:
            rows.append(out[r : r + len(toks)].clone())
            r += len(toks)
        seen.append(rows)
        return torch.stack([x[-1] for x in rows])

    eng.runner.run = spy
    try:
        req = eng.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.7, seed=5), rid)
        while eng.has_work():
            eng.step()
    finally:
        del eng.runner.run
    return seen[-3][0], req.output, req.cache


def prompt(n, salt=0):
    g = torch.Generator().manual_seed(1000 + salt)
    return torch.randint(1, 256, (n,), generator=g).tolist()


CONE = 16 * 6  # n_win * L for tiny


SLOW = pytest.mark.slow


def _cases():
    """Every strategy at each length; the default run keeps a boundary, +1, a checkpoint +1 and a
    block interior for periodic, and for none a prefix longer than the cone (the rest: -m slow)."""
    for strategy in ("full", "periodic:32", "none"):
        for plen in (15, 16, 17, 31, 32, 33, 47, 70, 112, 127):
            fast = (plen, strategy) in {(16, "full"), (17, "full"), (33, "periodic:32"), (47, "periodic:32"),
                                        (17, "none"), (127, "none")}
            yield pytest.param(strategy, plen, marks=() if fast else SLOW, id=f"{plen}-{strategy}")


@pytest.mark.parametrize("strategy,plen", list(_cases()))
def test_restore_equals_never_evicted(model, tmp_path, strategy, plen):
    base = prompt(130)
    full = base[:plen] + prompt(5, salt=plen)  # the shared prefix, then a new tail
    ref_logits, ref_out, _ = first_logits(engine(model), full)
    warm = engine(model)
    first_logits(warm, base[:plen] + [7, 7, 7])  # computes (and publishes) the prefix's blocks
    store = DiskPrefixStore(tmp_path, warm.cache, strategy, model=model)
    assert store.save(base[:plen]) > 0 or plen < B
    cold = engine(model)
    store = DiskPrefixStore(tmp_path, cold.cache, strategy, model=model)
    info = store.restore(full)
    period = 32 if strategy == "periodic:32" else B
    expect = (min(plen, len(full) - 1) // period) * period  # the last kept boundary inside the prefix
    assert info.hit_tokens == expect
    if strategy == "none":  # no state on disk: the window cone was recomputed, exactly n_win * L tokens
        assert not info.state_loaded and info.cone_tokens == min(expect, CONE)
    else:
        assert info.state_loaded == (expect > 0) and info.cone_tokens == 0
    logits, out, _ = first_logits(cold, full)
    assert logits.shape[0] == len(full) - expect
    assert torch.equal(logits, ref_logits[-logits.shape[0]:]) and out == ref_out
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
    assert torch.equal(logits, ref_logits[-logits.shape[0]:]) and out == ref_out


def test_strategy_errors_name_the_field():
    assert SWAStrategy.parse("periodic:48", 16).period == 48
    for bad in ("periodic:40", "periodic:0", "periodic:x", "sometimes"):
        with pytest.raises(ValueError, match="strategy"):
            SWAStrategy.parse(bad, 16)
    assert SWAStrategy.parse("none", 16).keeps(16) is False



def test_none_needs_a_model(tmp_path, model):
    with pytest.raises(ValueError, match="'model'"):
        DiskPrefixStore(tmp_path, engine(model).cache, "none")


def test_none_with_a_short_cone_is_not_exact(model, tmp_path):
    """Inverse control: recomputing one window fewer than n_win * L tokens changes the logits."""
    base, plen = prompt(130), 127
    full = base[:plen] + prompt(5, salt=plen)
    ref_logits, _, _ = first_logits(engine(model), full)
    warm = engine(model)
    first_logits(warm, base[:plen] + [7, 7, 7])
    DiskPrefixStore(tmp_path, warm.cache, "none", model=model).save(base[:plen])
    cold = engine(model)
    store = DiskPrefixStore(tmp_path, cold.cache, "none", model=model)
    store.cone = CONE - 16
    assert store.restore(full).cone_tokens == CONE - 16
    logits, _, _ = first_logits(cold, full)
    assert not torch.equal(logits, ref_logits[-logits.shape[0]:])


def test_store_refuses_another_layout(model, tmp_path):
    from v4stack.serve.cache.manager import CacheManager

    DiskPrefixStore(tmp_path, engine(model).cache, "full")
    other = CacheManager(model.cfg, model.dtype, 8, 2, block_multiple=2)
    with pytest.raises(ValueError, match="another cache layout"):
        DiskPrefixStore(tmp_path, other, "full")
