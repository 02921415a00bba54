"""One generation request as the engine sees it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from v4stack.serve.cache.manager import RequestCache
from v4stack.serve.sampling import Sampler, SamplingParams
from v4stack.tokenizer import ByteTokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
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

    def __post_init__(self):
        self.sampler = Sampler(self.params)
        self._tok = ByteTokenizer()

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
        """Output text, cut before the first stop string."""
        t = self._tok.decode(self.output)
        for s in self.params.stop:
            i = t.find(s)
            if i >= 0:
                t = t[:i]
        return t

    def hit_stop(self) -> bool:
        if not self.params.stop:
            return False
        t = self._tok.decode(self.output)
        return any(s in t for s in self.params.stop)
