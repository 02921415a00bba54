"""Drives an ``Engine`` from one background thread for asyncio callers.

Callers submit and abort through a command queue; the thread drains it between steps, so the
engine is only ever touched by its own thread. Tokens come back on per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from v4stack.serve.engine import Engine
from v4stack.serve.request import Request
from v4stack.serve.sampling import SamplingParams


@dataclass
class Event:
    tokens: list[int]
    finished: bool
    finish_reason: str | None
    text: str = ""  # unused: detokenisation and stop strings live at the API edge
    error: str | None = None
    n_tokens: int = 0
    ids: tuple[int, ...] = ()
    draws: list = field(default_factory=list)  # sampling.Draw of each new token
    request: Request | None = None  # for the finished event: timings, cached tokens, prompt logprobs


class EngineRunner:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._cmds: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="v4stack-engine", daemon=True)
        self.step_times: list[float] = []
        self.last_error: str | None = None

    def start(self) -> "EngineRunner":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- called from the event loop ------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, request_id: str) -> asyncio.Queue:
        """Queue a request; validation errors are raised here, before anything is queued."""
        self.engine.validate(prompt, params)
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()

        def on_event(req: Request, toks: list[int], finished: bool) -> None:
            n = len(req.output)
            ev = Event(toks, finished, req.finish_reason, n_tokens=n, draws=req.draws[n - len(toks):n],
                       request=req if finished or n == len(toks) else None)
            loop.call_soon_threadsafe(out.put_nowait, ev)

        self._cmds.put(("add", prompt, params, request_id, on_event, loop, out, time.perf_counter()))
        self._wake.set()
        return out

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))
        self._wake.set()

    # ---- the engine thread -------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, prompt, params, rid, on_event, loop, out, submitted = cmd
                try:
                    req = self.engine.add_request(prompt, params, rid, on_event)
                    req.arrival = submitted  # TTFT counts the wait for the engine thread too
                except ValueError as err:
                    loop.call_soon_threadsafe(out.put_nowait, Event([], True, "error", error=str(err)))
            else:
                self.engine.abort(cmd[1])

    def _loop(self) -> None:
        while not self._stop:
            self._drain()
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            try:
                self.engine.step()
            except Exception as err:  # keep serving; fail the requests of the broken step
                self.last_error = repr(err)
                for rid in list(self.engine.requests):
                    self.engine.abort(rid)
            self.step_times.append(time.perf_counter() - t0)
            if len(self.step_times) > 4096:
                del self.step_times[:2048]
