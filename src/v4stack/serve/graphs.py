"""CUDA graphs for decode steps at bucketed shapes.

A decode step (one token per request, no boundary capture) is laid out in static shapes by
``ModelRunner.build_decode``: rows padded to a bucket (1, 2, 4, ... ``max_rows``), block tables
padded to a power-of-two width, per compression ratio a power-of-two number of closing slots for
the rows whose entry closes (none in most steps: a ratio-m entry closes once every m tokens). The
first step of a shape is captured into a graph (after a
warm-up run on a side stream; re-running a decode step writes the same rows again, so the warm-up
changes nothing); later steps of that shape copy their layout into the graph's static inputs
and replay it. Every input of a static step is a view of one int64 buffer
(``ModelRunner.decode_layout`` / ``decode_batch``), so refreshing them is one transfer from pinned
memory. Graphs are captured and replayed under the engine's ops mode, so both modes get them.
If a capture fails (an op that needs the host), the engine keeps running eagerly and records why.
"""

from __future__ import annotations

import time

import torch

from v4stack.model.paged import StepBatch


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _width(n: int) -> int:
    """Block-table width bucket: a power of two up to 16 blocks, then multiples of 16."""
    return _next_pow2(n) if n <= 16 else -(-n // 16) * 16


class DecodeGraphs:
    """``capture=False`` runs the same static layout eagerly (how the CPU tests check it)."""

    def __init__(self, model, cache, max_rows: int = 256, capture: bool = True):
        self.model, self.cache, self.max_rows = model, cache, _next_pow2(max_rows)
        self.capture = capture
        self.graphs: dict[tuple, tuple] = {}  # (rows, width, closing caps) -> captured step
        self.pool = None
        self.error: str | None = None
        self.replays = 0
        self.replay_s = 0.0  # host time inside ``CUDAGraph.replay`` (the launch; a wait, if it blocks)
        self.steps = 0  # decode steps run in the static layout (replayed or eager)

    def _capture(self, batch: StepBatch):
        paged = self.cache.paged
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            before = paged.bytes_written
            self.model.step_paged(batch, paged)
            per_step = paged.bytes_written - before
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self.model.step_paged(batch, paged)
        paged.bytes_written -= per_step  # the capture counted its writes without running them
        self.pool = g.pool()
        return g, out, per_step

    def run(self, runner, chunks, ids: torch.Tensor | None = None) -> torch.Tensor:
        """One static decode step; ``ids`` (a device tensor ``[len(chunks)]``), when given, are the
        step's token ids, copied on the device over the layout's (the previous step's sampled
        tokens, which the host has not read yet)."""
        self.steps += 1
        n = len(chunks)
        rows = _next_pow2(n)
        # (steps where no entry closes skip the closing work: no closing slots)
        width, caps, host = runner.decode_layout(chunks, rows, _width)
        key = (rows, width, caps)
        entry = self.graphs.get(key)
        if entry is None:
            buf = host.to(runner.device)
            if ids is not None:
                buf[:n].copy_(ids)
            batch = runner.decode_batch(buf, rows, width, caps)
            if not (self.capture and self.error is None):
                return self.model.step_paged(batch, self.cache.paged)[:n]
            try:
                g, out, per_step = self._capture(batch)
            except Exception:  # an op that needs the host: stay eager
                import traceback

                self.error = traceback.format_exc()[-2500:]
                return self.model.step_paged(batch, self.cache.paged)[:n]
            staging = torch.empty_like(host).pin_memory()
            entry = self.graphs[key] = (g, buf, staging, torch.cuda.Event(), out, per_step)
        g, buf, staging, copied, out, per_step = entry
        copied.synchronize()  # the last step's copy out of ``staging`` is done before it is rewritten
        staging.copy_(host)
        buf.copy_(staging, non_blocking=True)  # the step's whole layout in one transfer
        copied.record()
        if ids is not None:
            buf[:n].copy_(ids)
        t0 = time.perf_counter()
        g.replay()
        self.replay_s += time.perf_counter() - t0
        self.replays += 1
        self.cache.paged.bytes_written += per_step
        return out[:n]
