"""MTP speculative decoding inside the engine (``EngineConfig(speculative="mtp")``): greedy and
seeded sampled tokens equal the plain engine's (invariant mode) whether drafts are rejected (the
untrained MTP), accepted, or mixed; a rejected draft leaves the cache pools bit-equal to a run that
never drafted (control: without the row restore they differ); sampled tokens follow the target
distribution (chi-square; control: accepting every draft fails it); the token WAL written through
a RolloutWorker holds exactly the plain tokens."""

import dataclasses
import math

import pytest
import torch

from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.ops.mode import mode
from v4stack.rollout import RolloutWorker, TokenWAL
from v4stack.serve.cache import rollback
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams
from v4stack.serve.spec_step import MTPStep

N = 12
CFG = dict(n_blocks=64, n_slots=8)


@pytest.fixture(scope="module")
def model():
    return V4Model(preset("tiny"), seed=2).cast(torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)  # 15 / 17 / 33 tokens: blocks (16) close at and around drafts
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (15, 17, 3)]


@pytest.fixture(scope="module")
def greedy_ref(model, prompts):
    return plain(model, prompts, SamplingParams(max_tokens=N))


class Oracle(MTPStep):
    """Drafts the plain engine's next token, except at output indices in ``wrong``."""

    def __init__(self, engine, expected, wrong=()):
        super().__init__(engine)
        self.expected, self.wrong = expected, set(wrong)

    def _draft(self, plan, starts, kept, cu, hidden, ready):
        super()._draft(plan, starts, kept, cu, hidden, ready)  # the MTP block still reads every row
        for req, _ in plan:
            d = getattr(req, "mtp_draft", None)
            i = len(req.output)
            exp = self.expected.get(tuple(req.prompt))
            if d is not None and d[0] == len(req.prompt) + i and exp is not None and i < len(exp):
                req.mtp_draft = (d[0], (exp[i] + 1) % 256 if i in self.wrong else exp[i])


class AcceptAll(MTPStep):
    """A broken verifier (control): every draft is taken as the sampled token."""

    @staticmethod
    def accepts(draw, draft):
        draw.token = draft
        return True


def spec_engine(model, step=MTPStep, **kw):
    eng = Engine(model, EngineConfig(**CFG, speculative="mtp"))
    eng.spec = step(eng, **kw)
    eng.scheduler.draft_tokens = eng.spec.draft_tokens
    return eng


def plain(model, prompts, sp):
    return [r.output for r in Engine(model, EngineConfig(**CFG)).generate(prompts, sp)]


@pytest.mark.slow  # the default run checks the mixed drafter's tokens through the WAL test below
@pytest.mark.parametrize("drafter", ["mtp", "mixed"])
def test_greedy_tokens_equal_the_plain_engine(model, prompts, greedy_ref, drafter):
    sp = SamplingParams(max_tokens=N)
    ref = greedy_ref
    kw = {} if drafter == "mtp" else dict(expected={tuple(p): o for p, o in zip(prompts, ref)},
                                          wrong=range(0, N, 3))
    eng = spec_engine(model, Oracle if kw else MTPStep, **kw)
    got = [r.output for r in eng.generate(prompts, sp)]
    assert got == ref
    s = eng.stats
    assert s.drafted > 0 and s.tokens_generated == len(prompts) * N
    if drafter == "mixed":  # both paths ran: accepted drafts gave two tokens in a step
        assert 0 < s.accepted < s.drafted and s.steps < N  # the plain engine takes N steps here


def _pools(eng, req):
    rc, c = req.cache, eng.cache
    slot = {k: [t[rc.slot].clone() for t in ts] for k, ts in c.slots.tensors.items()}
    blocks = {k: st[torch.tensor(rc.blocks)].clone() for k, st in c.blocks.storage.items()}
    return rc.pos, slot, blocks, len(c.snap_of), c.snap.n_free


@pytest.mark.parametrize("restore,other", [(True, False), (False, False), (True, True)])
def test_rejected_drafts_leave_the_cache_as_plain_decoding(model, prompts, greedy_ref, restore, other, monkeypatch):
    """``other``: a second request shares the steps, its (untrained MTP) drafts nearly all
    rejected while the first's alternate, so one step restores some rows and keeps others."""
    sp = SamplingParams(max_tokens=N)
    p, ref = prompts[1], greedy_ref[1]
    if not restore:  # control: skip the row restore; the pools must then differ
        monkeypatch.setattr(rollback.SavedRows, "restore", lambda self, rejected: 0)
    a = spec_engine(model, Oracle, expected={tuple(p): ref}, wrong=range(1, N, 2))
    b = Engine(model, EngineConfig(**CFG))
    ra, rb = a.add_request(p, sp), b.add_request(p, sp)
    ro = a.add_request(prompts[2], sp) if other else None
    same = []
    while a.has_work():
        a.step()
        if ra.cache is None:  # finished (the other request may still run)
            continue
        while rb.computed < ra.computed:
            b.step()
        pa, pb = _pools(a, ra), _pools(b, rb)
        same.append(pa[0] == pb[0] and (other or pa[3:] == pb[3:]) and all(
            torch.equal(x, y) for k in pa[1] for x, y in zip(pa[1][k], pb[1][k])) and all(
            torch.equal(pa[2][k], pb[2][k]) for k in pa[2]))
    assert ra.output == ref and (ro is None or ro.output == greedy_ref[2])
    assert len(same) > 5 and a.stats.accepted > 0 and a.stats.drafted > a.stats.accepted
    assert all(same) if restore else not all(same)


@pytest.mark.slow
def test_seeded_sampling_is_identical_draw_for_draw(model, prompts):
    sps = [SamplingParams(max_tokens=N, temperature=0.9, top_p=0.95, seed=s, presence_penalty=0.5)
           for s in range(len(prompts))]
    ref = [r.output for r in Engine(model, EngineConfig(**CFG)).generate(prompts, sps)]
    exp = {tuple(p): o for p, o in zip(prompts, ref)}
    eng = spec_engine(model, Oracle, expected=exp, wrong=range(0, N, 4))
    assert [r.output for r in eng.generate(prompts, sps)] == ref
    assert eng.stats.accepted > 0


def _exact_joint(model, prompt, T, k):
    """Exact law of the first three sampled tokens (temperature T, top-k k), and greedy drafts."""
    def dist(prefix):
        with torch.no_grad(), mode("invariant"):
            lg = model(torch.tensor([prefix]))[0, -1].float() / T
        v, i = torch.topk(lg, k)
        return dict(zip(i.tolist(), torch.softmax(v.double(), -1).tolist()))

    joint, greedy = {}, {}
    d0 = dist(prompt)
    for t0, p0 in d0.items():
        d1 = dist(prompt + [t0])
        greedy[(t0,)] = max(d1, key=d1.get)
        for t1, p1 in d1.items():
            d2 = dist(prompt + [t0, t1])
            greedy[(t0, t1)] = max(d2, key=d2.get)
            for t2, p2 in d2.items():
                joint[(t0, t1, t2)] = p0 * p1 * p2
    return joint, greedy


class Greedy(MTPStep):
    """Drafts the target's most likely token (so drafts are often right under sampling)."""

    def __init__(self, engine, greedy):
        super().__init__(engine)
        self.greedy = greedy

    def _draft(self, plan, starts, kept, cu, hidden, ready):
        super()._draft(plan, starts, kept, cu, hidden, ready)
        for req, _ in plan:
            d = getattr(req, "mtp_draft", None)
            if d is not None and tuple(req.output) in self.greedy:
                req.mtp_draft = (d[0], self.greedy[tuple(req.output)])


@pytest.mark.slow
@pytest.mark.parametrize("step", [Greedy, AcceptAll])
def test_sampled_tokens_follow_the_target_distribution(model, step):
    """Chi-square of the first three tokens over 400 seeds against the exact joint law, cells with
    expected count < 5 pooled; tolerance: df + 5 sqrt(2 df) (about 4 sigma for the df here). The
    control (every draft accepted) must exceed it."""
    prompt, T, k, n = [7, 99, 150, 3, 42], 1.0, 3, 400
    joint, greedy = _exact_joint(model, prompt, T, k)
    eng = Engine(model, EngineConfig(n_blocks=256, n_slots=128, max_running=128, token_budget=512,
                                     speculative="mtp"))
    eng.spec = step(eng, greedy) if step is Greedy else step(eng)
    eng.scheduler.draft_tokens = eng.spec.draft_tokens
    reqs = eng.generate([prompt] * n, [SamplingParams(max_tokens=3, temperature=T, top_k=k, seed=s)
                                       for s in range(n)])
    counts: dict = {}
    for r in reqs:
        counts[tuple(r.output)] = counts.get(tuple(r.output), 0) + 1
    assert eng.stats.accepted > n // 4
    big = [c for c, p in joint.items() if p * n >= 5]
    rest_p = 1 - sum(joint[c] for c in big)
    cells = [(counts.get(c, 0), joint[c] * n) for c in big]
    cells.append((n - sum(o for o, _ in cells), rest_p * n))
    chi2 = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    df = len(cells) - 1
    tol = df + 5 * math.sqrt(2 * df)
    assert (chi2 < tol) == (step is Greedy), (chi2, tol, df)


def test_a_rejected_drafts_boundary_snapshot_is_returned_once(model, prompts, greedy_ref):
    """A draft that ends a block gets that block's boundary snapshot planned; when the draft is
    rejected the slot goes back to the pool and must not be recorded as the request's (the
    snapshot it names was never of the request's real token): with every draft rejected, the
    tokens are the plain engine's, and afterwards each snapshot slot is free or held by one
    published block, once (before, a finished request released its recorded slot a second time:
    "state slot ... released twice")."""
    eng = spec_engine(model, Oracle, expected={tuple(p): o for p, o in zip(prompts, greedy_ref)}, wrong=range(N))
    # 20 / 36 tokens: the last draft (output 11, at position 31 / 47) ends a block of 16, and the request
    # finishes in that step; the others put such drafts mid-request
    long = prompts + [list(range(40, 60)), list(range(100, 136)), list(range(150, 175))]
    ref = plain(model, long, SamplingParams(max_tokens=N))
    eng.spec.expected.update({tuple(p): o for p, o in zip(long, ref)})
    assert [r.output for r in eng.generate(long, SamplingParams(max_tokens=N))] == ref
    assert eng.stats.drafted > 0 and eng.stats.accepted == 0
    cm = eng.cache
    slots = cm.snap.free + list(cm.snap_of.values())  # free, or the snapshot of one published block
    assert sorted(slots) == list(range(cm.snap.n_slots))


def test_the_wal_holds_only_accepted_tokens(model, prompts, greedy_ref, tmp_path):
    sp = SamplingParams(max_tokens=N)
    ref = greedy_ref[:2]
    eng = spec_engine(model, Oracle, expected={tuple(p): o for p, o in zip(prompts, ref)}, wrong=range(0, N, 3))
    w = RolloutWorker(eng, TokenWAL(tmp_path / "wal"))
    for j, p in enumerate(prompts[:2]):
        w.submit(f"t{j}", p, sp)
    w.run()
    w.close()
    assert eng.stats.accepted > 0 and eng.stats.drafted > eng.stats.accepted
    assert eng.stats.steps < N  # accepted drafts: fewer steps than the plain engine's N
    wal = TokenWAL(tmp_path / "wal")  # reopened: replays and checks every record
    assert [wal.trajectories[f"t{j}"].tokens for j in range(2)] == ref
    assert all(wal.trajectories[f"t{j}"].finished for j in range(2))
    wal.close()


def test_settings_are_checked(model):
    with pytest.raises(ValueError, match="speculative"):
        Engine(model, EngineConfig(speculative="eagle"))
    with pytest.raises(ValueError, match="num_draft"):
        Engine(model, EngineConfig(speculative="mtp", num_draft=2))
    cfg = preset("tiny")
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0, compress_ratios=cfg.compress_ratios[:-1])
    with pytest.raises(ValueError, match="MTP block"):
        Engine(V4Model(cfg, seed=0), EngineConfig(speculative="mtp"))


def test_engine_drafts_equal_the_reference_mtp(model, prompts):
    """The engine's paged MTP step drafts what the MTP block drafts over an explicit state fed the
    same rows (prefill, then decode steps with rejections)."""
    from v4stack.serve.speculative import mtp_forward, mtp_state

    p = prompts[0]
    eng = Engine(model, EngineConfig(**CFG, speculative="mtp"))
    req = eng.add_request(p, SamplingParams(max_tokens=8))
    seen = 0
    for _ in range(4):
        eng.step()
        toks = req.prompt + req.output
        with torch.no_grad(), mode("invariant"):
            _, h = model.step([(torch.tensor(toks[:-1]), model.new_state())], hidden=True)
            ref = mtp_forward(model, [(mtp_state(model), h[0], toks[1:], 0)])[0]
        assert req.mtp_draft == (len(toks), int(torch.argmax(ref)))
        seen += 1
    assert seen == 4 and eng.stats.drafted >= 3


@pytest.mark.slow
def test_greedy_tokens_on_the_serving_tests_prompts():
    """The prompts of tests/serve/test_api_invariance.py (byte tokens), all in one engine, on the
    server's weights (tiny, seed 0): identical with and without speculative decoding."""
    prompts = ["invariant HTTP"] + [f"another request {i} " * (i + 1) for i in range(7)] + ["hi"]
    ids = [list(p.encode()) for p in prompts]
    server_model = V4Model(preset("tiny"), seed=0).cast(torch.float32).eval()
    sp = SamplingParams(max_tokens=N)
    ref = plain(server_model, ids, sp)
    eng = spec_engine(server_model, Oracle, expected={tuple(p): o for p, o in zip(ids, ref)}, wrong=range(0, N, 3))
    assert [r.output for r in eng.generate(ids, sp)] == ref
    assert 0 < eng.stats.accepted < eng.stats.drafted
    eng = spec_engine(server_model)  # the model's own (untrained) MTP drafts
    assert [r.output for r in eng.generate(ids, sp)] == ref
