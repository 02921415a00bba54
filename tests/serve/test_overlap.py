"""Overlapped decode (``EngineConfig(overlap=True)``, ``serve/overlap.py``): each decode step is
launched with the previous step's sampled ids as device inputs before the host reads them. In
invariant mode every request's tokens, log-probabilities and finish reasons equal the plain
engine's, through admissions, stop ids (rows computed for finished requests), max_tokens, block
boundaries and penalties (which fall back to plain steps); ``drain`` leaves every cache holding
exactly its request's tokens, with no token left unread."""

import pytest
import torch

from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.serve.cache.manager import PLACEHOLDER
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.graphs import DecodeGraphs
from v4stack.serve.sampling import SamplingParams


@pytest.fixture(scope="module")
def model():
    return V4Model(preset("tiny"), seed=3).eval()


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (21, 9, 30, 17, 5)]


def _run(model, sps, overlap, prompts=None):
    eng = Engine(model, EngineConfig(n_blocks=64, n_slots=4, max_running=4, ops_mode="invariant", overlap=overlap))
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts or _prompts(), sps)]
    while eng.has_work():
        eng.step()
    return [(r.output, [d.logprob for d in r.draws], r.finish_reason) for r in reqs], eng


def _until(out, stop):
    """A plain run's request cut at its first ``stop`` id (invariant mode: the batch does not matter)."""
    toks, lps, _ = out
    k = toks.index(stop) + 1
    return toks[:k], lps[:k], "stop"


@torch.no_grad()
def test_overlapped_decode_gives_the_plain_engines_tokens(model, monkeypatch):
    sps = [SamplingParams(max_tokens=26, temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(4)]
    sps.append(SamplingParams(max_tokens=5, seed=4, presence_penalty=0.5))  # waits, then runs plain steps
    plain, _ = _run(model, sps, False)
    # stop on an id each of the first four produces mid-way (rows launched for finished requests)
    stops = [plain[i][0][13 + 2 * i] for i in range(4)]
    sps_stop = [SamplingParams(max_tokens=26, temperature=sp.temperature, seed=i, stop_token_ids=(s,))
                for i, (sp, s) in enumerate(zip(sps, stops))] + sps[4:]
    got, eng = _run(model, sps_stop, True)
    assert got == [_until(plain[i], s) for i, s in enumerate(stops)] + plain[4:]
    assert eng.stats.ahead >= 8 and eng.stats.wasted_rows >= 1
    # inverse control: launched-ahead steps fed a wrong id -> other tokens
    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, runner, chunks, ids=None, src=None, draw=False, captures=None:
                        run(self, runner, chunks, None if ids is None else torch.zeros_like(ids), src, draw, captures))
    bad, eng = _run(model, sps[:2], True, _prompts()[:2])
    assert eng.stats.ahead > 0 and [r[0] for r in bad] != [r[0] for r in plain[:2]]


@torch.no_grad()
def test_drain_leaves_caches_with_their_requests_tokens(model):
    eng = Engine(model, EngineConfig(n_blocks=64, n_slots=4, max_running=4, ops_mode="invariant", overlap=True))
    reqs = [eng.add_request(p, SamplingParams(max_tokens=14)) for p in _prompts()[:3]]
    for _ in range(6):
        eng.step()
    assert eng._inflight is not None and eng.stats.ahead > 0
    for r in reqs:  # every fed id is known: the cache holds exactly the request's tokens
        assert r.cache.pos == len(r.all_tokens) and r.cache.tokens == r.all_tokens
    n = [len(r.output) for r in reqs]
    eng.drain()  # the step in flight sampled one more token each
    assert eng._inflight is None and [len(r.output) for r in reqs] == [k + 1 for k in n]
    eng.detach(reqs[0])  # drains (nothing left in flight) and releases
    assert reqs[0].cache is None
    while eng.has_work():
        eng.step()
    assert all(len(r.output) == 14 for r in reqs[1:])


@torch.no_grad()
def test_greedy_steps_draw_inside_the_static_step_and_feed_the_next(model, monkeypatch):
    """All-greedy rows: the static step draws its own tokens (``DecodeGraphs._body``, what a graph
    holds) and the step launched after it takes its ids from those device draws by row (``src``),
    with requests finishing in between (stop ids, ``max_tokens``) - the plain engine's tokens and
    log-probabilities."""
    sps = [SamplingParams(max_tokens=20 + 3 * i) for i in range(4)]
    plain, _ = _run(model, sps, False)
    stops = [plain[1][0][9]]
    sps[1] = SamplingParams(max_tokens=23, stop_token_ids=tuple(stops))
    got, eng = _run(model, sps, True)
    assert got[1] == _until(plain[1], stops[0])
    assert got[:1] + got[2:] == plain[:1] + plain[2:]
    g = eng.runner.graphs
    assert g.draws >= 10 and g.fed_steps >= 10 and eng.stats.ahead >= 10  # (settling: the GPU test's)
    # inverse control: the rows named in the wrong order -> other tokens
    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, runner, chunks, ids=None, src=None, draw=False, captures=None:
                        run(self, runner, chunks, ids, None if src is None else list(src)[::-1], draw, captures))
    bad, eng = _run(model, sps, True)
    assert eng.runner.graphs.fed_steps > 0 and [r[0] for r in bad] != [r[0] for r in plain]


@torch.no_grad()
def test_blocks_closed_by_launched_ahead_tokens_are_published(model):
    """A launched-ahead step may feed the token that closes a block (its id still on the device):
    the block's boundary snapshot is written in that step, and the block is hashed and published
    once the id is read back. Three requests close their blocks in the same steps (three captures
    in a static step of four capture slots, one padding). Later requests whose prompts are the
    first ones' prompts and outputs reuse every full block, and their tokens equal a cold engine's.
    Inverse control: no snapshot for a block a placeholder closes -> the later requests miss."""
    B = model.cfg.block_tokens
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (9,), generator=g).tolist() for _ in range(3)]  # blocks close at 16, 32, 48

    def run(blind_snapshots: bool):
        eng = Engine(model, EngineConfig(n_blocks=64, n_slots=4, max_running=4, ops_mode="invariant", overlap=True))
        cm, blind = eng.cache, []
        plan = cm.plan_captures

        def plan_(chunks):
            out = plan(chunks)
            for (_, new), caps in zip(chunks, out):
                if PLACEHOLDER in new:
                    blind.extend(caps)
                    if not blind_snapshots:
                        for slot in caps.values():
                            cm.snap.release(slot)
                        caps.clear()
            return out

        cm.plan_captures = plan_
        first = [eng.add_request(p, SamplingParams(max_tokens=48)) for p in prompts]
        while eng.has_work():
            eng.step()
        closed_blind = sorted(blind)
        follow = [p + r.output[:45] for p, r in zip(prompts, first)]  # 54 tokens: three full blocks each
        second = [eng.add_request(f, SamplingParams(max_tokens=6)) for f in follow]
        while eng.has_work():
            eng.step()
        return follow, second, closed_blind

    follow, second, closed_blind = run(True)
    assert closed_blind == sorted([B, 2 * B, 3 * B] * 3)  # each block end was fed by a launched-ahead step
    assert [r.cached_tokens for r in second] == [3 * B] * 3
    cold = Engine(model, EngineConfig(n_blocks=64, n_slots=4, max_running=4, ops_mode="invariant"))
    ref = [cold.add_request(f, SamplingParams(max_tokens=6)) for f in follow]
    while cold.has_work():
        cold.step()
    assert [r.cached_tokens for r in ref] == [0] * 3
    assert [(r.output, [d.logprob for d in r.draws]) for r in second] == \
        [(r.output, [d.logprob for d in r.draws]) for r in ref]
    _, missed, _ = run(False)
    assert all(r.cached_tokens < 3 * B for r in missed)
