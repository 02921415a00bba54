"""One generation request as the engine sees it."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from v4stack.serve.cache.manager import RequestCache
from v4stack.serve.sampling import Draw, DrawLog, SamplingParams, fresh_seed
from v4stack.serve.stops import StopMatcher
from v4stack.tokenizer import ByteTokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a live request is itself: membership tests (scheduler) compare identity, not every field
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    on_event: Callable[["Request", list[int], bool], None] | None = None  # (req, new tokens, finished)
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # stop | length | abort
    cache: RequestCache | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    admitted_order: int = 0
    scheduled_at: float | None = None  # first admission (queue time = scheduled_at - arrival)
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache at first admission
    stop_ids: frozenset[int] = frozenset()  # the engine finishes on these (stop_token_ids, EOS)
    stop_reason: int | None = None  # the id that finished it
    draws: DrawLog = field(default_factory=DrawLog)  # per output token: its logprob (+ top-n)
    prompt_draws: list[Draw | None] | None = None  # per prompt token when prompt_logprobs is set
    plain: bool = field(default=False, init=False)  # params.plain, read once per step per request

    def __post_init__(self):
        if self.params.seed is None:  # a fresh seed, recorded so the request can be replayed
            self.params = dataclasses.replace(self.params, seed=fresh_seed())
        self.plain = self.params.plain
        if self.params.prompt_logprobs is not None and self.prompt_draws is None:
            self.prompt_draws = [None] * len(self.prompt)
        if not self.stop_ids:
            self.stop_ids = frozenset(self.params.stop_token_ids)
        self._tok = ByteTokenizer()
        self._stops = StopMatcher(self.params.stop) if self.params.stop else None
        self._stop_dec, self._stop_seen = self._tok.stream(), 0

    @property
    def all_tokens(self) -> list[int]:
        """What the model must have consumed before sampling the next token."""
        return self.prompt + self.output

    @property
    def computed(self) -> int:
        return self.cache.pos if self.cache is not None else 0

    @property
    def pending(self) -> int:
        """Known tokens not yet fed to the model (prompt, or output to recompute after preemption)."""
        return len(self.prompt) + len(self.output) - self.computed

    def text(self) -> str:
        return self._tok.decode(self.output)

    def hit_stop(self) -> bool:
        """The last token is one the request stops on (after ``min_tokens``), or the output text
        (decoded as a whole would show it) holds a stop string. Strings are matched incrementally:
        each call looks at the new tokens only. (The API edge matches its stop strings itself and
        sends the engine none.)"""
        if self.output and len(self.output) >= self.params.min_tokens and self.output[-1] in self.stop_ids:
            return True
        if self._stops is None:
            return False
        if self._stop_seen < len(self.output):
            new, self._stop_seen = self.output[self._stop_seen:], len(self.output)
            self._stops.push(self._stop_dec.push(new))
        return self._stops.would_stop(self._stop_dec.pending())
