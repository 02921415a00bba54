"""One API request's engine requests ("jobs": prompts x choices) and what each has produced.

A job turns engine events into text at the edge: an incremental UTF-8 decoder, then the stop
strings (the engine stops on token ids only; a stop string found here aborts the engine
request). With ``n``/``best_of`` > 1 a prompt's first job runs alone until its prefill is done,
so its siblings are admitted onto the prompt's cached blocks.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace as _replace
import itertools
import time
from dataclasses import dataclass, field

from v4stack.serve.metrics import ApiMetrics
from v4stack.serve.runner import EngineRunner, Event
from v4stack.serve.sampling import SEED_MAX, DrawLog, SamplingParams
from v4stack.serve.stops import StopMatcher
from v4stack.tokenizer import ByteTokenizer

_ids = itertools.count()


@dataclass
class Job:
    index: int  # the choice index before best_of selection
    prompt_index: int
    prompt: list[int]
    params: SamplingParams
    rid: str
    primary: bool
    ids: list[int] = field(default_factory=list)
    draws: DrawLog = field(default_factory=DrawLog)
    text: str = ""
    finish: str | None = None
    error: str | None = None
    req: object = None  # the engine's Request (timings, cached tokens, prompt logprobs)
    submitted: bool = False
    arrival: float = 0.0
    first_at: float | None = None
    last_at: float | None = None
    gaps: list[float] = field(default_factory=list)

    def __post_init__(self):
        self._detok = ByteTokenizer().stream()
        self._stops = StopMatcher(self.params.stop)

    @property
    def cumulative_logprob(self) -> float:
        return sum(self.draws.logprobs)

    def feed(self, ev: Event, now: float) -> tuple[str, list]:
        """Apply one engine event; returns (text released, draws of the new tokens)."""
        if self.finish is not None:
            return "", []
        if ev.request is not None and self.req is None:
            self.req = ev.request
        if ev.error:
            self.finish, self.error = "error", ev.error
            return "", []
        if ev.tokens:
            if self.first_at is None:
                self.first_at = now
            else:
                self.gaps.append(now - self.last_at)
            self.last_at = now
        self.ids += ev.tokens
        self.draws += ev.draws
        text = self._detok.push(ev.tokens)
        if ev.finished:
            text += self._detok.flush()
        out = self._stops.push(text)
        if self._stops.stopped is not None:
            self.finish = "stop"
        elif ev.finished:
            out += self._stops.flush()
            self.finish = ev.finish_reason
        self.text += out
        return out, list(ev.draws)


def choice_seed(seed: int | None, j: int) -> int | None:
    if seed is None:
        return None
    return seed + j if seed + j <= SEED_MAX else seed - j


class Generation:
    """Submits the jobs, merges their events, aborts whatever is left when it closes."""

    def __init__(self, runner: EngineRunner, metrics: ApiMetrics, state, rid: str,
                 prompts: list[list[int]], params: SamplingParams, per_prompt: int):
        self.runner, self.metrics, self.state, self.rid = runner, metrics, state, rid
        self.jobs: list[Job] = []
        for p, prompt in enumerate(prompts):
            for j in range(per_prompt):
                sp = params if j == 0 else _replace_seed(params, choice_seed(params.seed, j))
                self.jobs.append(Job(p * per_prompt + j, p, prompt, sp, f"{rid}-{p}-{j}-{next(_ids)}", j == 0))
        self._events: asyncio.Queue = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self.closed = False

    def _submit(self, job: Job) -> None:
        q = self.runner.submit(job.prompt, _replace(job.params, stop=()), job.rid)  # stop strings: here
        job.submitted, job.arrival = True, time.perf_counter()
        self._pumps.append(asyncio.ensure_future(self._pump(job, q)))

    async def _pump(self, job: Job, q: asyncio.Queue) -> None:
        while True:
            ev = await q.get()
            self._events.put_nowait((job, ev))
            if ev.finished:
                return

    def start(self) -> None:
        self.state.inflight += len(self.jobs)
        for job in self.jobs:
            if job.primary:
                self._submit(job)

    @property
    def done(self) -> bool:
        return all(j.finish is not None for j in self.jobs)

    async def next(self) -> tuple[Job, str, list]:
        """The next event's effect: (job, text released, new draws)."""
        job, ev = await self._events.get()
        text, draws = job.feed(ev, time.perf_counter())
        if job.primary and (ev.tokens or ev.finished):  # prefill done: siblings reuse its blocks
            for s in self.jobs:
                if s.prompt_index == job.prompt_index and not s.submitted:
                    if job.finish == "error":
                        s.finish, s.error = "error", job.error
                        self._finished(s)
                    else:
                        self._submit(s)
        if job.finish is not None:
            self._finished(job)
        return job, text, draws

    def _finished(self, job: Job) -> None:
        self.runner.abort(job.rid)  # a stop string ends it here; no-op when the engine finished it
        self.state.inflight -= 1
        req = job.req
        queue_s = None
        if req is not None and getattr(req, "scheduled_at", None) is not None:
            queue_s = req.scheduled_at - req.arrival
        self.metrics.record(arrival=job.arrival or time.perf_counter(), first=job.first_at,
                            last=job.last_at or time.perf_counter(), token_gaps=job.gaps, queue_s=queue_s,
                            reason=job.finish, prompt_tokens=len(job.prompt) if job.primary else 0,
                            cached_tokens=self.cached(job))

    @staticmethod
    def cached(job: Job) -> int:
        return (getattr(job.req, "cached_tokens", None) or 0) if job.req is not None else 0

    def close(self) -> None:
        """Abort every unfinished job (client gone, error, shutdown)."""
        if self.closed:
            return
        self.closed = True
        for job in self.jobs:
            if job.finish is None:
                job.finish = "abort"
                self.runner.abort(job.rid)
                self.state.inflight -= 1
                self.metrics.finished["abort"] += 1
        for t in self._pumps:
            t.cancel()

    def usage(self) -> dict:
        prompt = sum(len(j.prompt) for j in self.jobs if j.primary)
        completion = sum(len(j.ids) for j in self.jobs)
        cached = sum(self.cached(j) for j in self.jobs if j.primary)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def _replace_seed(p: SamplingParams, seed: int | None) -> SamplingParams:
    return _replace(p, seed=seed)
