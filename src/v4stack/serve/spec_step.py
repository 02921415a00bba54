"""The engine's step with MTP speculative decoding (``EngineConfig(speculative="mtp")``).

Between steps a decoding request has ``n`` tokens in its cache, its last sampled token pending
(position ``n``), and a draft for position ``n + 1`` made by the MTP block. The scheduler gives it
two tokens of the step's budget; the step feeds ``[pending, draft]`` through the paged cache like
any two-token chunk, next to other requests' decode and prefill chunks, and samples both rows in
one call:

- row ``n`` is sampled exactly as a plain step would sample it (same sampler, same counter-based
  uniform: output index ``i``). The draft is accepted iff that token equals it;
- then row ``n + 1`` - computed with the draft, i.e. with the token just sampled - is sampled as
  output ``i + 1``: a second token from the same step.

So every token is the one plain decoding would produce from the same logits and the same seed:
greedy outputs are identical, seeded sampling is identical draw for draw, and the distribution is
the target's by construction. (The classical accept-with-probability ``min(1, p/q)`` rule accepts
more often under sampling, but its tokens depend on the draft; this rule keeps replay and
recovery, which rebuild a request from its seed and token index, exact.)

A rejected draft is taken out of the cache: the request advances by its accepted tokens only (no
block, hash or boundary snapshot sees the draft; a snapshot the step took at the draft's block end
goes back to the pool) and the ring rows and closed entries it wrote are restored
(``serve/cache/rollback.py``). The MTP block then reads every fed position that was kept - its
main-stack streams and the token after it - in one flat paged step of its own: its window is a
ring per state slot (the request's slot in the main cache), read and written in place like the
main layers' windows; and it drafts the next token greedily. After a prefix hit or a preemption
the MTP window starts empty (zeros) at the request's position: drafts may be worse, tokens are not.

Reported tokens (``on_event``) are accepted tokens only, so a token WAL never sees a draft.
"""

from __future__ import annotations

import itertools
import time

import torch

from v4stack.model.paged import PagedCache, PagedStep, StepBatch
from v4stack.ops.mode import mode as ops_mode
from v4stack.serve.cache import rollback
from v4stack.serve.request import Request, Status
from v4stack.serve.sampling import Row, sample


class MTPStep:
    def __init__(self, engine):
        if not len(engine.model.mtp):
            raise ValueError("engine setting 'speculative'='mtp' needs a model with an MTP block "
                             "(num_nextn_predict_layers >= 1)")
        self.e = engine
        m, cfg = engine.model, engine.model.cfg
        if cfg.mtp_ratios[0] != 0:
            raise ValueError("speculative decoding expects an SWA-only MTP block (compress ratio 0)")
        self.layer = m.mtp[0].layer_id
        ring = torch.zeros(engine.cache.slots.n_slots + 1, cfg.sliding_window, cfg.head_dim, dtype=m.dtype,
                           device=m.embed.weight.device)
        key = ("swa_kv", self.layer)
        self.paged = PagedCache(state={key: (ring,)}, snap={key: (ring,)}, blocks={}, block_tokens=engine.cache.B)

    @staticmethod
    def draft_tokens(req: Request) -> int:
        """Draft tokens the scheduler may add to ``req``'s next chunk (0 or 1)."""
        d = getattr(req, "mtp_draft", None)
        return int(d is not None and req.cache is not None and req.pending == 1 and d[0] == req.computed + 1)

    @staticmethod
    def accepts(draw, draft: int) -> bool:
        """The verification rule: the token sampled at the draft's position is the draft."""
        return draw.token == draft

    @staticmethod
    def _row(req: Request, extra: list[int]) -> Row:
        out = req.output + extra if extra else req.output
        return Row(req.params, req.params.seed, len(out), out, req.prompt, tuple(req.stop_ids))

    @torch.no_grad()
    def step(self) -> list[Request]:
        e = self.e
        plan = e.scheduler.schedule()
        if not plan:
            return []
        now = time.perf_counter()
        starts, chunks, drafts, ready = [], [], [], []
        for req, n in plan:
            if req.scheduled_at is None:
                req.scheduled_at, req.cached_tokens = now, req.cache.hit_tokens
            s, known = req.computed, min(n, req.pending)
            toks = e._tokens(req, s, s + known)
            d = req.mtp_draft[1] if n > known else None
            starts.append(s)
            chunks.append((req.cache, toks + ([d] if d is not None else [])))
            drafts.append(d)
            ready.append(known == req.pending)
        ver = [i for i, d in enumerate(drafts) if d is not None]
        saved = rollback.save(e.cache, [(chunks[i][0], starts[i] + len(chunks[i][1]) - 1) for i in ver])
        caps = e.cache.plan_captures(chunks)
        batch = e.runner.build(chunks, caps)
        cu = [0, *itertools.accumulate(len(t) for _, t in chunks)]
        out_rows, first = [], []
        for i, (req, _) in enumerate(plan):
            scoring = req.prompt_draws is not None and starts[i] < len(req.prompt) - 1
            lo = cu[i] if scoring else cu[i + 1] - (2 if drafts[i] is not None else 1)
            first.append(len(out_rows))
            out_rows.extend(range(lo, cu[i + 1]))
        batch.out_rows = torch.tensor(out_rows, dtype=torch.long, device=e.runner.device)
        paged = e.cache.paged
        before = paged.bytes_written
        with ops_mode(e.config.ops_mode):
            logits, hidden = e.model.step_paged(batch, paged, hidden=True)
        for i, (req, _) in enumerate(plan):
            if req.prompt_draws is not None and starts[i] < len(req.prompt) - 1:
                n = cu[i + 1] - cu[i]
                e._prompt_logprobs(req, starts[i], n, logits[first[i] : first[i] + n])

        # sample every ready request's row (and the row after its draft) in one call
        rows, picks = [], []
        for i, (req, _) in enumerate(plan):
            if not ready[i]:
                continue
            last = first[i + 1] - 1 if i + 1 < len(plan) else len(out_rows) - 1
            if drafts[i] is not None:
                rows += [self._row(req, []), self._row(req, [drafts[i]])]
                picks += [last - 1, last]
            else:
                rows.append(self._row(req, []))
                picks.append(last)
        with ops_mode(e.config.ops_mode):  # as the plain engine samples
            draws = iter(sample(logits[picks], rows) if rows else [])

        # accept, advance the caches by what was kept, undo what rejected drafts wrote
        kept, got, rejected = [], [], []
        for i, ((rc, toks), c) in enumerate(zip(chunks, caps)):
            ds = [next(draws)] if ready[i] else []
            if drafts[i] is not None:
                bonus = next(draws)
                if self.accepts(ds[0], drafts[i]):
                    ds.append(bonus)
                else:
                    rejected.append(ver.index(i))
                    toks = toks[:-1]
                    kept_to = rc.pos + len(toks)
                    for P, slot in c.items():  # a boundary snapshot taken after the draft
                        if P > kept_to:
                            e.cache.snap.release(slot)
                    # (the released ones are not the request's: advance must not record them)
                    c = {P: slot for P, slot in c.items() if P <= kept_to}
                e.stats.drafted += 1
                e.stats.accepted += len(ds) - 1
            e.cache.advance(rc, toks, c)
            kept.append(len(toks))
            got.append(ds)
        restored = saved.restore(rejected)
        e.runner.last_bytes = paged.bytes_written - before + restored
        e.stats.steps += 1
        e.stats.last_step_cache_bytes = e.runner.last_bytes
        e.stats.cache_bytes_written += e.runner.last_bytes

        done = []
        now = time.perf_counter()
        for (req, _), (_, toks), ds in zip(plan, chunks, got):
            e.stats.tokens_computed += len(toks)
            new, reason = [], None
            for d in ds:
                req.output.append(d.token)
                req.draws.append(d)
                req.token_times.append(now)
                e.stats.tokens_generated += 1
                new.append(d.token)
                if req.first_token_at is None:
                    req.first_token_at = now
                    e.stats.ttft.append(now - req.arrival)
                    if len(e.stats.ttft) > 100_000:
                        del e.stats.ttft[:50_000]
                if req.hit_stop():
                    req.stop_reason, reason = d.token, "stop"
                elif len(req.output) >= req.params.max_tokens:
                    reason = "length"
                if reason:
                    break
            if new and req.on_event is not None:
                req.on_event(req, new, False)
            if reason:
                e._finish(req, reason)
                done.append(req)
        self._draft(plan, starts, kept, cu, hidden, ready)
        return done

    def _draft(self, plan, starts, kept, cu, hidden, ready) -> None:
        """Feed the MTP block every kept position of every live request; draft for the ready ones."""
        e = self.e
        feed = []
        ring = self.paged.state[("swa_kv", self.layer)][0]
        for i, (req, _) in enumerate(plan):
            if req.status is Status.FINISHED or req.cache is None:
                continue
            s, m = starts[i], kept[i]
            if getattr(req, "mtp_pos", None) != s:  # first step, prefix hit, preemption, restore
                ring[req.cache.slot].zero_()
            req.mtp_pos = s + m
            feed.append((i, req, s, m))
        if not feed:
            return
        dev = hidden.device
        rows = torch.cat([torch.arange(cu[i], cu[i] + m) for i, _, _, m in feed]).to(dev)
        nxt = [t for _, req, s, m in feed for t in e._tokens(req, s + 1, s + m + 1)]
        lens = torch.tensor([m for *_, m in feed])
        seq = torch.repeat_interleave(torch.arange(len(feed)), lens)
        row0 = torch.cumsum(lens, 0) - lens
        pos0 = torch.tensor([s for _, _, s, _ in feed])
        positions = torch.arange(int(lens.sum())) - row0[seq] + pos0[seq]
        ids = torch.tensor(nxt, dtype=torch.long)
        b = StepBatch(ids=ids.to(dev), positions=positions.to(dev), seq=seq.to(dev), row0=row0.to(dev),
                      pos0=pos0.to(dev), end=(pos0 + lens).to(dev),
                      slots=torch.tensor([req.cache.slot for _, req, _, _ in feed], device=dev),
                      block_table=torch.full((len(feed), 1), -1, dtype=torch.long, device=dev),
                      max_end=int((pos0 + lens).max()), decode=bool((lens == 1).all()))
        m = e.model
        with ops_mode(e.config.ops_mode):
            ids = b.ids
            y = m.mtp[0].predict(hidden[rows], m.embed(ids), b.positions, PagedStep(b, self.paged), ids)
            logits = m.head(y[(row0 + lens - 1).to(dev)])
        best = torch.argmax(logits, -1).tolist()
        for (i, req, _, _), tok in zip(feed, best):
            if ready[i]:
                req.mtp_draft = (len(req.prompt) + len(req.output), tok)
