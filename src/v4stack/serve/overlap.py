"""Overlapped decode: the next step is launched before the host reads this step's tokens.

With ``EngineConfig(overlap=True)`` a decode step that replays a static graph is not waited for:
its sampling is launched, its read-back queued (``sampling.sample_async``; all-greedy rows are
drawn inside the graph itself), and ``Engine.step`` returns. The next call launches the step after
it at once - its token ids are the sampled ids on the device: the graph reads them from the draws
of the graph before (by row, ``DecodeGraphs``), or they are copied into its inputs - and only then
waits for the earlier step's tokens and does the host work for them (stop checks, events, cache
book-keeping) while the device runs the later step. The device is never left waiting for the
host's step work, and the host never waits for the step it has just launched.

A step is launched ahead only when it is the step the scheduler would run anyway, up to rows
that may turn out finished: every running request is a decoding request of the step in flight,
none waits to be admitted (unless the batch is full), none reaches ``max_tokens`` with the token
in flight (those are left out), its sampling needs no host-side token list (no penalties, bias or
``min_tokens`` masking) and every cache can reserve its next row without preemption. A fed token
that closes a block is fine: the block's boundary snapshot is written in the step as planned
without its hash (``CacheManager.plan_captures``), and the block is hashed and published when the
id is read back (``CacheManager.publish``). Otherwise the in-flight step is read
first and the engine schedules as it always does. A row whose request finished on the token in
flight (a stop id) was computed for nothing; its output is dropped and its cache was freed with
the request (``EngineStats.wasted_rows``). The fed token's id is recorded in the request's cache
token list when it is read back, before anything hashes that list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v4stack.ops.mode import mode as ops_mode
from v4stack.serve.cache.manager import PLACEHOLDER, RequestCache
from v4stack.serve.request import Request, Status
from v4stack.serve.sampling import Row, Sampled, sample_async, sample_greedy_async



@dataclass
class InFlight:
    """A launched decode step whose sampled tokens the host has not read."""

    reqs: list[Request]
    caches: list[RequestCache]  # each request's cache when it was launched
    sampled: Sampled


def _needs_host_tokens(req: Request, index: int) -> bool:
    """Sampling draw ``index`` of ``req`` reads its token list on the host (penalties, bias, the
    ``min_tokens`` mask of stop ids)."""
    p = req.params
    return bool(p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                or (index < p.min_tokens and req.stop_ids))


def launch_ahead(eng, inf: InFlight) -> InFlight | None:
    """Launch the decode step after ``inf`` (``eng``'s step in flight), or None when it cannot be."""
    sch = eng.scheduler
    if sch.waiting and len(sch.running) < sch.max_running:
        return None  # an admission may be due: schedule normally
    B = eng.cache.B
    live, keep, reqs, plain = 0, [], [], True
    # one pass over the step's rows (this runs every decode step, for every request)
    for i, (req, rc) in enumerate(zip(inf.reqs, inf.caches)):
        if req.status is not Status.RUNNING or req.cache is not rc:
            continue
        live += 1
        index = len(req.output) + 1  # the draw after the one in flight
        if index >= req.params.max_tokens:
            continue  # finishes when the in-flight token is read
        if not req.plain:
            if _needs_host_tokens(req, index):
                return None
            plain = False
        keep.append(i)
        reqs.append(req)
    if live != len(sch.running):
        return None  # a request outside the in-flight step runs (prefill, attached)
    g = eng.runner.graphs
    if not keep or len(keep) > sch.budget or g is None or len(keep) > g.max_rows:
        return None
    cm = eng.cache
    for r in reqs:
        rc = r.cache
        if len(rc.blocks) * B <= rc.pos and not cm.reserve(rc, 1):
            return None  # (blocks taken so far serve these requests' next row anyway)
    tok, src = inf.sampled.tokens, None
    if inf.sampled.fed:  # drawn inside the last step's graph: this step's graph reads them there
        tok, src = None, keep
    elif len(keep) != len(inf.reqs):
        tok = tok[torch.tensor(keep, dtype=torch.long).to(tok.device, non_blocking=True)]
    fed = [PLACEHOLDER]
    chunks = [(r.cache, fed) for r in reqs]
    with ops_mode(eng.config.ops_mode):
        logits = eng.runner.run(chunks, ids=tok, src=src, draw=plain)
        if isinstance(logits, Sampled):
            sampled = logits
        elif plain:
            sampled = sample_greedy_async(logits)
        else:
            rows = [Row(r.params, r.params.seed, len(r.output) + 1, r.output, r.prompt, tuple(r.stop_ids))
                    for r in reqs]
            sampled = sample_async(logits, rows)
    st = eng.stats
    st.steps += 1
    st.ahead += 1
    st.tokens_computed += len(reqs)
    st.last_step_cache_bytes = eng.runner.last_bytes
    st.cache_bytes_written += eng.runner.last_bytes
    return InFlight(reqs, [r.cache for r in reqs], sampled)
