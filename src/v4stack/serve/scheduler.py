"""Continuous batching: which requests run in the next step, and how many tokens each feeds.

Each step has a token budget. Running requests that are decoding feed one token each; requests
still prefilling feed as much of their prompt as the budget leaves (the model records the state at
every block boundary inside a chunk, so chunks need no alignment); waiting requests are admitted,
oldest first, while the budget, the free blocks and the state slots allow. When a running request cannot get a block
for its next token, the most recently admitted request is preempted: its cache is released and it
goes back to the front of the queue, to be recomputed from its prompt and the tokens it already
produced (which are kept, never re-sampled). With speculative decoding a decoding request whose
draft is ready feeds it too (two tokens), when the budget and its blocks allow.
"""

from __future__ import annotations

import itertools
from collections import deque

from v4stack.serve.cache.manager import CacheFull, CacheManager
from v4stack.serve.request import Request, Status


class Scheduler:
    def __init__(self, cache: CacheManager, token_budget: int = 256, max_running: int = 64, draft_tokens=None):
        if token_budget < 1 or max_running < 1:
            raise ValueError("token_budget and max_running must be >= 1")
        self.cache, self.budget, self.max_running = cache, token_budget, max_running
        self.draft_tokens = draft_tokens  # speculative: req -> draft tokens its decode chunk may carry
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._order = itertools.count()
        self.preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @staticmethod
    def _chunk(req: Request, budget: int) -> int:
        return min(req.pending, budget)

    def preempt(self, req: Request) -> None:
        self.cache.free(req.cache)
        req.cache = None
        req.status = Status.WAITING
        req.preemptions += 1
        self.preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def attach(self, req: Request, cache) -> None:
        """Move a waiting request whose cache is already restored straight to running."""
        self.waiting.remove(req)
        req.cache, req.status = cache, Status.RUNNING
        req.admitted_order = next(self._order)
        self.running.append(req)

    def release(self, req: Request) -> None:
        if req.cache is not None:
            self.cache.free(req.cache)
            req.cache = None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def schedule(self) -> list[tuple[Request, int]]:
        budget = self.budget
        plan: list[tuple[Request, int]] = []
        preempted: set[int] = set()  # ids; a list membership test here was O(batch) per request
        for req in sorted(self.running, key=lambda r: r.admitted_order):
            if budget == 0:
                break
            if id(req) in preempted:  # preempted by an earlier one in this loop
                continue
            n = self._chunk(req, budget)
            if self.draft_tokens is not None and n == req.pending:
                n += min(self.draft_tokens(req), budget - n)
            while not self.cache.reserve(req.cache, n):
                if n > req.pending:  # no room for the draft: plain decode
                    n = req.pending
                    continue
                victim = max(self.running, key=lambda r: r.admitted_order)
                self.preempt(victim)
                preempted.add(id(victim))
                plan = [(r, k) for r, k in plan if r is not victim]
                if victim is req:
                    n = 0
                    break
            if n:
                plan.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            try:
                # prompt logprobs need the logits of every prompt position: no prefix reuse
                req.cache = self.cache.admit(req.all_tokens, reuse=req.params.prompt_logprobs is None)
            except CacheFull:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.admitted_order = next(self._order)
            self.running.append(req)
            n = self._chunk(req, budget)
            if not self.cache.reserve(req.cache, n):  # admission counted these blocks
                raise RuntimeError("admitted request could not reserve its first chunk")
            plan.append((req, n))
            budget -= n
        return plan
