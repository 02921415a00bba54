"""Prefix reuse at and around block boundaries gives the logits of a cold run, bit for bit."""

import pytest
import torch

from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.ops.mode import mode
from v4stack.serve.cache import CacheManager
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.model_runner import ModelRunner
from v4stack.serve.sampling import SamplingParams

B = 16  # lcm(m, m') of the tiny preset


@pytest.fixture(scope="module")
def model():
    return V4Model(preset("tiny"), seed=3).eval()


def _run(model, cm, tokens, chunks):
    """Feed ``tokens`` through the cache manager in ``chunks`` (after any prefix hit)."""
    rc = cm.admit(tokens)
    runner = ModelRunner(model, cm)
    outs, pos = [], rc.pos
    for n in chunks:
        if pos >= len(tokens):
            break
        n = min(n, len(tokens) - pos)
        assert cm.reserve(rc, n)
        outs.append(runner.run([(rc, tokens[pos : pos + n])], all_rows=True))
        pos += n
    return rc, torch.cat(outs)


def _block_chunks(start, end):
    """Chunks that end on every block boundary (as the scheduler cuts prefills)."""
    out, p = [], start
    while p < end:
        nxt = min(end, (p // B + 1) * B)
        out.append(nxt - p)
        p = nxt
    return out


@torch.no_grad()
@pytest.mark.parametrize("shared", [B - 1, B, B + 1, 2 * B - 1, 2 * B, 2 * B + 1, 3 * B + 5])
def test_warm_prefix_equals_cold(model, shared):
    g = torch.Generator().manual_seed(shared)
    a = torch.randint(0, 256, (3 * B + 9,), generator=g).tolist()
    b = a[:shared] + torch.randint(0, 256, (11,), generator=g).tolist()
    with mode("invariant"):
        cm = CacheManager(model.cfg, model.dtype, n_blocks=32, n_slots=4)
        rc_a, _ = _run(model, cm, a, _block_chunks(0, len(a)))
        cm.free(rc_a)
        rc_b, warm = _run(model, cm, b, _block_chunks(0, len(b)))
        assert rc_b.hit_tokens == (min(shared, len(b) - 1) // B) * B  # hits land on block boundaries
        cold_cm = CacheManager(model.cfg, model.dtype, n_blocks=32, n_slots=4)
        _, cold = _run(model, cold_cm, b, [len(b)])
        assert torch.equal(warm, cold[rc_b.hit_tokens :])
        cm.free(rc_b)
    assert cm.blocks.n_used == 0 and cm.slots.n_free == 4


@torch.no_grad()
def test_prefix_without_boundary_snapshot_is_not_used(model):
    """The state group needs the boundary: blocks whose last snapshot is gone are not a hit."""
    a = torch.randint(0, 256, (3 * B + 2,), generator=torch.Generator().manual_seed(9)).tolist()
    cm = CacheManager(model.cfg, model.dtype, n_blocks=32, n_slots=2, n_snapshots=1)
    with mode("invariant"):
        rc, _ = _run(model, cm, a, [3 * B + 2])  # boundaries 16, 32, 48 captured inside one chunk
        cm.free(rc)  # with room for one snapshot only the last (48) is kept
        assert cm.match_prefix(a) == [cm.blocks.lookup(h) for h in rc.hashes[:3]]  # block 2 has one
        b = a[: 2 * B + 3] + [1, 2, 3]
        assert cm.match_prefix(b) == []  # blocks 0-1 are cached but block 1 has no boundary state


def test_engine_reuses_prefixes_and_matches_cold_tokens(model):
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 256, (2 * B + 3,), generator=g).tolist()
    prompts = [base[:n] + torch.randint(0, 256, (4,), generator=g).tolist() for n in (2 * B + 3, B, B + 1, 2 * B, 2 * B - 1)]
    sp = SamplingParams(max_tokens=6)
    warm = Engine(model, EngineConfig(n_blocks=64, n_slots=8, token_budget=64))
    first = warm.generate(prompts[:1], sp)
    rest = warm.generate(prompts[1:], sp)
    assert warm.cache.prefix_hit_tokens > 0
    cold = [Engine(model, EngineConfig(n_blocks=64, n_slots=8)).generate([p], sp)[0] for p in prompts]
    assert [r.output for r in first + rest] == [r.output for r in cold]
    assert warm.cache.blocks.n_used == 0
