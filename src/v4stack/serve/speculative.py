"""MTP speculative decoding: the MTP block drafts one token, the main model verifies it in the
same step it decodes the previous one.

Per request, between steps: ``n`` tokens are in the main state, the sampled token ``t_n`` is not
yet fed, and the MTP block (fed rows ``(h_p, t_{p+1})`` for every ``p < n``) has drafted ``d``
for position ``n + 1``. One step feeds ``[t_n, d]`` to the main model for every request at once
(positions ``n, n+1``); the logits at ``n`` give ``t_{n+1}``:

- ``t_{n+1} == d`` (greedy) or the draft passes the acceptance test (sampling): the draft is kept,
  and the logits at ``n + 1`` give a second token ``t_{n+2}`` for free;
- otherwise position ``n + 1`` is rolled back: the window ring and compressor tails return to the
  snapshot the step took at ``n + 1`` (the state's boundary capture), and closed entries past it
  are dropped, so the state equals one that never saw the draft.

Greedy is exact: in invariant mode a step's rows do not depend on what else is in the step, so
the tokens equal plain greedy decoding bit for bit. Sampling keeps the target distribution (the
standard accept / residual rule): accept ``d ~ q`` with probability ``min(1, p(d) / q(d))``, else
draw from ``max(p - q, 0)`` renormalised. Random draws are a function of (seed, output index, use)
only. Only accepted tokens are reported (``on_tokens``), so a token log records no draft.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from v4stack.model import V4Model
from v4stack.model.attention import Segment
from v4stack.model.state import LayerState, RequestState
from v4stack.ops.mode import mode as ops_mode
from v4stack.serve.sampling import SamplingParams


def _uniform(seed: int, index: int, use: str) -> float:
    h = hashlib.blake2b(f"{seed}:{index}:{use}".encode(), digest_size=8).digest()
    return (int.from_bytes(h, "little") >> 11) / float(1 << 53)


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The sampling distribution of ``logits [V]`` under ``p`` (temperature, top-k, top-p)."""
    lg = logits.detach().to(torch.float64).cpu() / p.temperature
    if p.top_k:
        kth = torch.topk(lg, min(p.top_k, lg.numel())).values[-1]
        lg = lg.masked_fill(lg < kth, float("-inf"))
    probs = torch.softmax(lg, -1)
    if p.top_p < 1:
        sp, si = torch.sort(probs, descending=True, stable=True)
        keep = sp.cumsum(0) - sp < p.top_p
        probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
    return probs / probs.sum()


def _draw(probs: torch.Tensor, u: float) -> int:
    cdf = probs.cumsum(0)
    return int(torch.searchsorted(cdf, torch.tensor(u * float(cdf[-1]), dtype=cdf.dtype), right=True)
               .clamp(max=probs.numel() - 1))


def verify(p: torch.Tensor, q: torch.Tensor, draft: int, u_accept: float, u_resample: float) -> tuple[int, bool]:
    """Speculative acceptance: (token, accepted). The token is distributed as ``p`` when the
    draft is distributed as ``q``."""
    if u_accept * float(q[draft]) < float(p[draft]):  # u < p/q, without dividing by a zero q
        return draft, True
    resid = (p - q).clamp(min=0)
    if float(resid.sum()) <= 0:  # p == q: rejection has probability zero; fall back to p
        resid = p
    return _draw(resid, u_resample), False


def mtp_state(model: V4Model) -> list:
    """A fresh MTP window (the block is SWA-only), placed where ``Block`` looks for its layer."""
    cfg = model.cfg
    st = LayerState(swa_kv=torch.zeros(cfg.sliding_window, cfg.head_dim, dtype=model.dtype,
                                       device=model.embed.weight.device))
    return [None] * cfg.num_hidden_layers + [st]


def mtp_forward(model: V4Model, rows: list[tuple[list, torch.Tensor, list[int], int]]) -> list[torch.Tensor]:
    """Feed MTP rows ``(h_p, t_{p+1})`` for positions ``p0, p0 + 1, ...`` of several requests,
    each ``(mtp state, streams [n, n_hc, d], next tokens [n], p0)``; every state advances. Returns
    each request's last row's logits (the draft distribution for position ``p0 + n + 1``)."""
    blk = model.mtp[0]
    segs, hs, nxt, pos, start = [], [], [], [], 0
    for state, h, toks, p0 in rows:
        n = len(toks)
        segs.append(Segment(start=start, length=n, pos0=p0, state=state))
        hs.append(h)
        nxt.append(torch.tensor(toks, device=h.device))
        pos.append(torch.arange(p0, p0 + n, device=h.device))
        start += n
    ids = torch.cat(nxt)
    y = blk.predict(torch.cat(hs), model.embed(ids), torch.cat(pos), segs, ids)
    last = torch.tensor([s.start + s.length - 1 for s in segs], device=y.device)
    return list(model.head(y[last]))


@dataclass
class SpecRequest:
    prompt: list[int]
    params: SamplingParams
    state: RequestState
    mtp_state: list
    output: list[int] = field(default_factory=list)
    pending: int | None = None  # sampled, not yet fed to the main model
    draft: int | None = None
    draft_q: torch.Tensor | None = None
    done: bool = False


@dataclass
class SpecStats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_step(self) -> float:
        return (self.drafted + self.accepted) / self.steps if self.steps else 0.0


class SpeculativeDecoder:
    """Decode several requests together with one MTP draft per request per step."""

    def __init__(self, model: V4Model, ops_mode: str = "invariant", on_tokens=None):
        if not len(model.mtp):
            raise ValueError("speculative decoding needs a model with an MTP block")
        self.model, self.mode, self.on_tokens = model.eval(), ops_mode, on_tokens
        self.stats = SpecStats()

    # ---- model calls ---------------------------------------------------------------------

    def _mtp_state(self) -> list:
        return mtp_state(self.model)

    def _mtp(self, rows: list[tuple[SpecRequest, torch.Tensor, list[int], int]]) -> list[torch.Tensor]:
        return mtp_forward(self.model, [(r.mtp_state, h, toks, p0) for r, h, toks, p0 in rows])

    def _draft(self, req: SpecRequest, logits: torch.Tensor) -> None:
        i = len(req.output)  # the draft is a candidate for output index i
        if req.params.temperature == 0:
            req.draft, req.draft_q = int(torch.argmax(logits)), None
        else:
            q = target_probs(logits, req.params)
            req.draft, req.draft_q = _draw(q, _uniform(self._seed(req), i, "draft")), q

    @staticmethod
    def _seed(req: SpecRequest) -> int:
        return req.params.seed if req.params.seed is not None else 0

    def _sample(self, req: SpecRequest, logits: torch.Tensor, index: int) -> int:
        if req.params.temperature == 0:
            return int(torch.argmax(logits))
        return _draw(target_probs(logits, req.params), _uniform(self._seed(req), index, "token"))

    # ---- the loop ------------------------------------------------------------------------

    def start(self, prompt: list[int], params: SamplingParams) -> SpecRequest:
        req = SpecRequest(list(prompt), params.validate(), self.model.new_state(), self._mtp_state())
        with torch.no_grad(), ops_mode(self.mode):
            logits, hidden = self.model.step([(torch.tensor(prompt), req.state)], hidden=True)
            tok = self._sample(req, logits[0][-1], 0)
            req.pending = tok
            self._emit(req, [tok])
            if not req.done:
                self._draft(req, self._mtp([(req, hidden[0], prompt[1:] + [tok], 0)])[0])
        return req

    def _emit(self, req: SpecRequest, toks: list[int]) -> None:
        room = req.params.max_tokens - len(req.output)
        toks = toks[:room]
        req.output.extend(toks)
        if len(req.output) >= req.params.max_tokens:
            req.done = True
        if self.on_tokens is not None and toks:
            self.on_tokens(req, toks)

    @torch.no_grad()
    def step(self, reqs: list[SpecRequest]) -> None:
        """One verify step for every live request in ``reqs``."""
        live = [r for r in reqs if not r.done]
        if not live:
            return
        with ops_mode(self.mode):
            batch = []
            for r in live:
                P = r.state.pos + 1  # the draft's position: the state as of P is the rollback point
                for ls in r.state.layers:
                    ls.capture_at = (P,)
                batch.append((torch.tensor([r.pending, r.draft]), r.state))
            logits, hidden = self.model.step(batch, hidden=True)
            mtp_rows = []
            for r, lg, h in zip(live, logits, hidden):
                n = r.state.pos - 2  # position of the pending token
                snaps = [ls.captured.pop(n + 1) for ls in r.state.layers]
                for ls in r.state.layers:
                    ls.capture_at = ()
                i = len(r.output)
                if r.params.temperature == 0:
                    tok = int(torch.argmax(lg[0]))
                    ok = tok == r.draft
                else:
                    p = target_probs(lg[0], r.params)
                    tok, ok = verify(p, r.draft_q, r.draft, _uniform(self._seed(r), i, "accept"),
                                     _uniform(self._seed(r), i, "resample"))
                self.stats.steps += 1
                self.stats.drafted += 1
                if ok:
                    self.stats.accepted += 1
                    bonus = self._sample(r, lg[1], i + 1)
                    self._emit(r, [tok, bonus])
                    r.pending = bonus
                    mtp_rows.append((r, h, [tok, bonus], n))
                else:
                    self._rollback(r.state, n + 1, snaps)
                    self._emit(r, [tok])
                    r.pending = tok
                    mtp_rows.append((r, h[:1], [tok], n))
            rows = [row for row in mtp_rows if not row[0].done]
            if rows:
                for (r, *_), lg in zip(rows, self._mtp(rows)):
                    self._draft(r, lg)

    @staticmethod
    def _rollback(st: RequestState, P: int, snaps: list[LayerState]) -> None:
        """Return ``st`` to position ``P`` from the snapshots the step took there."""
        for ls, snap in zip(st.layers, snaps):  # in place: the state may be a view of a cache slot
            ls.swa_kv.copy_(snap.swa_kv)
            if ls.tail is not None:
                ls.tail.kv.copy_(snap.tail.kv)
                ls.tail.score.copy_(snap.tail.score)
                ratio = ls.tail.rows // (2 if ls.index_tail is not None else 1)
                ls.compressed_kv = ls.compressed_kv[: P // ratio]
                if ls.index_tail is not None:
                    ls.index_tail.kv.copy_(snap.index_tail.kv)
                    ls.index_tail.score.copy_(snap.index_tail.score)
                    ls.index_keys = ls.index_keys[: P // ratio]
        st.pos = P

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        reqs = [self.start(p, params) for p in prompts]
        while any(not r.done for r in reqs):
            self.step(reqs)
        return [r.output for r in reqs]
