"""MTP speculative decoding: greedy tokens equal plain greedy decoding (invariant mode) whether
drafts are all rejected (the rollback path), all accepted, or mixed; the acceptance rule keeps the
target distribution; only accepted tokens are reported (and so reach the token WAL)."""

import pytest
import torch

from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.ops.mode import mode
from v4stack.rollout import records as R
from v4stack.rollout.wal import TokenWAL
from v4stack.serve.sampling import SamplingParams
from v4stack.serve.speculative import SpeculativeDecoder, verify

N = 10


@pytest.fixture(scope="module")
def setup():
    model = V4Model(preset("tiny"), seed=2).eval()
    prompts = [list(range(30, 47)), list(range(100, 108))]  # 17 and 8 tokens: blocks close mid-decode
    plain = []
    with torch.no_grad(), mode("invariant"):
        for p in prompts:
            st = model.new_state()
            lg, out = model.step([(torch.tensor(p), st)])[0][-1], []
            while len(out) < N:
                out.append(int(torch.argmax(lg)))
                lg = model.step([(torch.tensor(out[-1:]), st)])[0][-1]
            plain.append(out)
    return model, prompts, plain


class Oracle(SpeculativeDecoder):
    """Drafts the true greedy token, except at output indices in ``wrong`` (a wrong token)."""

    def __init__(self, model, expected, wrong=(), **kw):
        super().__init__(model, **kw)
        self.expected, self.wrong = expected, set(wrong)

    def _draft(self, req, logits):
        i = len(req.output)
        exp = self.expected[req.prompt[0]]
        req.draft = (exp[i] + 1) % 256 if i in self.wrong or i >= len(exp) else exp[i]
        req.draft_q = None


@pytest.mark.parametrize("kind", [pytest.param("mtp", marks=pytest.mark.slow),
                                  pytest.param("all_accepted", marks=pytest.mark.slow), "mixed"])
def test_greedy_tokens_equal_plain_decoding(setup, kind, tmp_path):
    model, prompts, plain = setup
    sp = SamplingParams(max_tokens=N)
    seen = []
    wal = TokenWAL(tmp_path / "wal")  # the real token WAL: it checks offsets and max_tokens itself
    wal.append([R.begin(f"t{p[0]}", p, sp) for p in prompts])

    def on_tokens(req, toks):
        seen.append((req.prompt[0], list(toks)))
        wal.append([R.tokens(f"t{req.prompt[0]}", len(req.output) - len(toks), toks)])

    if kind == "mtp":  # an untrained MTP block: every draft is rejected, every step rolls back
        dec = SpeculativeDecoder(model, on_tokens=on_tokens)
    else:
        expected = {p[0]: e for p, e in zip(prompts, plain)}
        dec = Oracle(model, expected, wrong=() if kind == "all_accepted" else (2, 3, 7), on_tokens=on_tokens)
    out = dec.generate(prompts, sp)
    wal.close()
    assert out == plain
    reopened = TokenWAL(tmp_path / "wal")
    assert [reopened.trajectories[f"t{p[0]}"].tokens for p in prompts] == plain  # no draft was logged
    reopened.close()
    s = dec.stats
    assert s.drafted == s.steps
    if kind == "all_accepted":
        assert s.accepted == s.steps and s.tokens_per_step > 1.8
    elif kind == "mixed":
        assert 0 < s.accepted < s.steps
    # only accepted tokens are reported, in order, nothing twice
    for p, e in zip(prompts, plain):
        assert [t for q, toks in seen if q == p[0] for t in toks] == e


def test_control_a_broken_rollback_changes_tokens(setup):
    """The rejected path's rollback is what keeps the tokens exact: skip it and they change."""
    model, prompts, plain = setup

    class NoRollback(SpeculativeDecoder):
        @staticmethod
        def _rollback(st, P, snaps):
            st.pos = P  # forget to restore the window ring / tails

    out = NoRollback(model).generate(prompts[:1], SamplingParams(max_tokens=N))
    assert out[0] != plain[0]


def test_acceptance_rule_keeps_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    V, n = 6, 40000
    p = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1)
    u = torch.rand(n, 3, generator=g, dtype=torch.float64)
    drafts = torch.searchsorted(q.cumsum(0), u[:, 0] * q.sum()).clamp(max=V - 1)
    counts = torch.zeros(V, dtype=torch.float64)
    for d, ua, ur in zip(drafts.tolist(), u[:, 1].tolist(), u[:, 2].tolist()):
        counts[verify(p, q, d, ua, ur)[0]] += 1
    sigma = (p * (1 - p) / n).sqrt()
    assert ((counts / n - p).abs() < 5 * sigma).all(), (counts / n, p)
    # control: accepting every draft gives q, which this check rejects
    assert not ((torch.bincount(drafts, minlength=V) / n - p).abs() < 5 * sigma).all()


def test_sampling_is_seeded_and_batch_independent(setup):
    model, prompts, _ = setup
    sp = SamplingParams(temperature=0.8, top_k=50, max_tokens=4, seed=7)
    alone = SpeculativeDecoder(model).generate(prompts[:1], sp)[0]
    together = SpeculativeDecoder(model).generate(prompts, sp)[0]
    assert alone == together and len(alone) == 4
