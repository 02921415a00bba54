"""CUDA graphs for decode steps at bucketed shapes.

A decode step (one token per request) is laid out in static shapes by
``ModelRunner.decode_layout``: rows padded to a bucket (1, 2, 4, ... ``max_rows``), block tables
padded to a power-of-two width, per compression ratio a power-of-two number of closing slots for
the rows whose entry closes (none in most steps: a ratio-m entry closes once every m tokens), and a
power-of-two number of boundary captures for the rows whose token ends a block (the state
snapshot prefix reuse needs; at batch 256 and 128-token blocks about two rows a step when the
requests' positions are spread, so a step without any is the exception in real traffic). Every
input of a static step is a view of one int64 buffer, so one transfer refreshes them all.

A graph holds the whole step, so the device goes from one step's graph to the next with nothing
between them:

- the layout, read from pinned staging memory, and the token ids the previous step drew on the
  device: one kernel, the graph's first node (``ops.fused.layout_in``; on CUDA it reads the host
  memory through the device's mapping of it, so no copy-engine transfer precedes the step's first
  kernel). Row ``t``'s id is ``fed[src[t]]`` where the layout's ``src`` column is >= 0 (as
  ``ops.fused.feed_ids`` feeds it) - the previous step's draws stay on the device, and a
  launched-ahead step names the rows it continues instead of gathering them;
- the model step;
- for a step whose rows are all plain greedy (``draw``), the draw itself
  (``sampling.greedy_rows``), its ids written to ``fed`` for the next step and its rows to pinned
  memory (the graph's last node). The engine then only records an event after the replay.

With ``layout_ahead`` (the default; ``V4STACK_LAYOUT_AHEAD=0`` turns it off) the layout instead goes
to the graph's device buffer by a copy on a side stream when the step is launched, ordered after
that buffer's last reader (the graph's previous replay) and before the replay: it runs while the
device still works on the step before, and the graph starts with ``ops.fused.feed_ids`` alone. On
an H100 (flash4 fast batch 256, two interleaved rounds) that took the step's p50 2398.8 / 2394.9 ->
2382.8 / 2389.3 us at 1k and 2602.5 / 2596.9 -> 2597.1 / 2584.4 at 16k (the windows' means lower
in every round: by 4.0 / 0.2 us at 1k, 8.9 / 4.4 at 16k; ``bench/serve_env_ab.sh`` with
``VARIANTS="in:V4STACK_LAYOUT_AHEAD=0 ahead:V4STACK_LAYOUT_AHEAD=1"``,
``bench/results/serve_env_layout_*_h100_bafc2b2_*.json``).

A shape has two graphs used in turn, each with its own staging and read-back buffers: with one
step in flight, the graph being launched last ran two steps ago, so its buffers were consumed
(the step's layout read, its draws read back by ``Sampled.collect``). Where that is not so (a
caller that left a step unread) the launch first settles that step's read-back. Where the runtime
cannot capture the copies, they are made around the replay instead (``copies_error`` says why).

Graphs of up to ``pdl_rows`` rows are captured with programmatic launches (``kernels/gdc.py``):
each of the project's kernels may be placed while the one before it finishes, which hides most of
a launch's gap between the short kernels of a small step.

The first step of a graph is captured (after a warm-up run on a side stream; re-running a decode
step writes the same rows again, so the warm-up changes nothing, and ``fed`` is put back as it
was). Graphs are captured and replayed under the engine's ops mode, so both modes get them. If a
capture fails (an op that needs the host), the engine keeps running eagerly and records why.
``capture=False`` runs the same body eagerly (how the CPU tests check it).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from v4stack.kernels.launch import programmatic
from v4stack.model.paged import StepBatch
from v4stack.ops import fused
from v4stack.serve.sampling import Sampled, greedy_rows


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _width(n: int) -> int:
    """Block-table width bucket: a power of two up to 16 blocks, then multiples of 16."""
    return _next_pow2(n) if n <= 16 else -(-n // 16) * 16


@dataclass
class _Graph:
    """One captured graph of a static step and the buffers it reads and writes."""

    graph: torch.cuda.CUDAGraph
    buf: torch.Tensor  # the layout on the device (every input of the step is a view of it)
    staging: torch.Tensor  # pinned: the layout, copied in by the graph's first node
    logits: torch.Tensor | None  # without ``draw``
    tok: torch.Tensor | None  # with ``draw``: the drawn ids [rows] ...
    out: torch.Tensor | None  # ... and their rows [rows, 3] on the device ...
    host: torch.Tensor | None  # ... read back into pinned memory
    per_step: int  # cache bytes a replay writes
    inside: bool = True  # the layout copy and the read-back are nodes of the graph (else made around it)
    ahead: bool = False  # the layout is copied by the side stream before the replay (the read-back inside)
    done: torch.cuda.Event = field(default_factory=torch.cuda.Event)
    copied: torch.cuda.Event = field(default_factory=torch.cuda.Event)  # the side stream's copy of the layout
    fresh: bool = True  # not replayed yet (its buffer's last reader: the capture's warm-up)
    last: Sampled | None = None  # the draws of this graph's last replay


class DecodeGraphs:
    def __init__(self, model, cache, max_rows: int = 256, capture: bool = True):
        self.model, self.cache, self.max_rows = model, cache, _next_pow2(max_rows)
        self.capture = capture
        self.graphs: dict[tuple, list[_Graph]] = {}  # (rows, width, closing caps, draw) -> its graphs
        self._turn: dict[tuple, int] = {}  # which of a shape's two graphs the next step replays
        self.pool = None
        self.error: str | None = None
        self.replays = 0
        self.replay_s = 0.0  # host time inside ``CUDAGraph.replay`` (the launch; a wait, if it blocks)
        self.steps = 0  # decode steps run in the static layout (replayed or eager)
        self.draws = 0  # of them, steps that drew their tokens inside the step
        self.fed_steps = 0  # steps whose ids were (partly) the previous step's device draws
        self.settled = 0  # launches that had to wait for an unread step first (none in the engine's pattern)
        self.fed: torch.Tensor | None = None  # [max_rows] int64: the ids the last drawing step drew
        # capture the layout copy and the read-back as graph nodes (else around replays). On the H200 the engine's
        # batch-256 step ran at its graph's back-to-back replay time with them inside (2201 / 2369 us at 1k / 16k,
        # bench/results/step_gaps_h200.json, b171000) and 45-49 us slower with them around the replay (2246 / 2418,
        # step_gaps_h200_8ed3a6a.json), though profiled the device idled less before the graph's first kernel then
        self.copies_inside = True
        self.copies_error: str | None = None  # why they could not be captured, if so
        # with the copies inside, the layout comes in through ``fused.layout_in`` (on CUDA a kernel reading the
        # pinned staging: no copy-engine node before the step's first kernel); else a transfer, then ``feed_ids``
        self.layout_kernel = True
        # the layout copied into the graph's buffer on a side stream ahead of the replay (the module's docstring)
        self.layout_ahead = os.environ.get("V4STACK_LAYOUT_AHEAD", "1") != "0"
        self._copier: torch.cuda.Stream | None = None
        # graphs of up to this many rows launch the project's kernels programmatically (kernels/gdc.py: each may be
        # placed while the one before it finishes). On an H100 (flash4 fast, 1k) that took the step 1.57 -> 1.52 ms
        # at batch 1, 1.84 -> 1.78 at 16, 1.94 -> 1.92 at 64 (bench/results/serve_pdl*_h100_fb967b7_*.json), and made
        # batch 256's 2.48 -> 2.58 ms (a924208): the grouped GEMM was most of that and is launched the usual way since
        # (50e39e9, serve_pdlset_*); without it batch 256 still lost 0.02-0.03 ms, so larger graphs stay outside
        self.pdl_rows = 64
        self.draw_error: str | None = None  # why a step's draw could not be captured (then drawn outside)

    def _fed(self, device) -> torch.Tensor:
        if self.fed is None:
            self.fed = torch.zeros(self.max_rows, dtype=torch.long, device=device)
        return self.fed

    def _body(self, runner, buf, batch: StepBatch, rows: int, draw: bool, staging=None, host=None, feed=True):
        """What a graph holds (and what an eager static step runs)."""
        R = rows
        if staging is not None and feed and self.layout_kernel:  # read from the staging by one kernel, ids fed
            fused.layout_in(buf, staging, self._fed(buf.device), R)
        else:
            if staging is not None:
                buf.copy_(staging, non_blocking=True)  # the step's whole layout in one transfer
            if feed:
                fused.feed_ids(buf[:R], buf[4 * R : 5 * R], self._fed(buf.device))
        logits = self.model.step_paged(batch, self.cache.paged)
        if not draw:
            return logits, None, None
        tok, out = greedy_rows(logits)
        self._fed(tok.device)[:R].copy_(tok)
        if host is not None:
            host.copy_(out, non_blocking=True)
        return None, tok, out

    def _capture(self, runner, key, host_layout) -> _Graph:
        rows, width, caps, draw = key
        dev = runner.device
        buf = host_layout.to(dev)
        staging = torch.empty_like(host_layout).pin_memory()
        host = torch.empty(rows, 3, dtype=torch.float64).pin_memory() if draw else None
        batch = runner.decode_batch(buf, rows, width, caps)
        paged = self.cache.paged
        fed = self._fed(dev)
        saved = fed.clone()  # the warm-up draws into ``fed``; the replay must read the previous step's
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            before = paged.bytes_written
            try:
                self._body(runner, buf, batch, rows, draw)
            finally:
                fed.copy_(saved)
            per_step = paged.bytes_written - before
        torch.cuda.current_stream().wait_stream(side)
        while True:
            g = torch.cuda.CUDAGraph()
            inside = self.copies_inside
            ahead = inside and self.layout_ahead
            try:
                with torch.cuda.graph(g, pool=self.pool), programmatic(rows <= self.pdl_rows):
                    logits, tok, out = self._body(runner, buf, batch, rows, draw,
                                                  staging if inside and not ahead else None, host if inside else None)
                break
            except Exception:  # noqa: BLE001  (a runtime that cannot capture the copies: make them around the replay)
                if not inside:
                    raise
                import traceback

                self.copies_inside, self.copies_error = False, traceback.format_exc()[-1500:]
                paged.bytes_written -= per_step
        paged.bytes_written -= per_step  # the capture counted its writes without running them
        self.pool = g.pool()
        return _Graph(g, buf, staging, logits, tok, out, host, per_step, inside, ahead)

    def run(self, runner, chunks, ids: torch.Tensor | None = None, src: list[int] | None = None,
            draw: bool = False, captures: list[dict[int, int]] | None = None):
        """One static decode step. Its token ids: the chunks' (host) ids, or ``ids`` (a device
        tensor ``[len(chunks)]``), or for rows ``t`` with ``src[t] >= 0`` the previous step's
        device draw ``src[t]`` (that step drew inside its graph: ``Sampled.fed``). Returns the
        logits ``[len(chunks), V]``, or with ``draw`` the step's ``Sampled`` greedy draws where it
        could draw them (a CPU step, or a captured graph; elsewhere the logits, for the caller to
        sample)."""
        self.steps += 1
        n = len(chunks)
        rows = _next_pow2(n)
        dev = runner.device
        if ids is not None:  # device ids: fed rows 0..n-1 (the graph's feed reads them after its layout copy)
            self._fed(dev)[:n].copy_(ids)
            src = range(n)
        self.fed_steps += src is not None
        width, caps, host_layout = runner.decode_layout(chunks, rows, _width, src, captures)
        entry = None
        if self.capture and self.error is None:
            draw = draw and self.draw_error is None
            entry = self._entry(runner, (rows, width, caps, draw), host_layout)
            if entry is None and draw:  # the draw could not be captured: the step without it
                draw = False
                entry = self._entry(runner, (rows, width, caps, False), host_layout)
        if entry is None:  # eager: the CPU draws in the step, CUDA leaves the draw to the caller
            draw = draw and dev.type != "cuda"
            self.draws += draw
            return self._eager(runner, host_layout, (rows, width, caps, draw), n, src is not None)
        self.draws += draw
        if entry.last is not None and entry.last.unread:  # its last draws must be read before they are overwritten
            self.settled += 1
            entry.last.settle()
        if not entry.done.query():  # its last replay has not read its staging yet (not in the engine's pattern)
            self.settled += 1
            entry.done.synchronize()
        entry.staging.copy_(host_layout)
        if entry.ahead:
            self._copy_ahead(entry, dev)
        elif not entry.inside:
            entry.buf.copy_(entry.staging, non_blocking=True)
        entry.fresh = False
        t0 = time.perf_counter()
        entry.graph.replay()
        self.replay_s += time.perf_counter() - t0
        if draw and not entry.inside:
            entry.host.copy_(entry.out, non_blocking=True)
        entry.done.record()
        self.replays += 1
        self.cache.paged.bytes_written += entry.per_step
        if not draw:
            return entry.logits[:n]
        entry.last = Sampled(entry.tok[:n], entry.host[:n], entry.done, None, None, fed=True)
        return entry.last

    def _copy_ahead(self, entry: _Graph, dev) -> None:
        """The layout into the graph's buffer on the side stream, after the buffer's last reader (the
        graph's previous replay, or its capture's warm-up), and the replay ordered after the copy."""
        copier = self._copier = self._copier or torch.cuda.Stream(dev)
        if entry.fresh:
            copier.wait_stream(torch.cuda.current_stream(dev))
        copier.wait_event(entry.done)
        with torch.cuda.stream(copier):
            entry.buf.copy_(entry.staging, non_blocking=True)
        entry.copied.record(copier)
        torch.cuda.current_stream(dev).wait_event(entry.copied)

    def _entry(self, runner, key, host_layout) -> _Graph | None:
        """The graph of ``key`` this step replays (the shape's two in turn, both captured on its
        first use, so a shape's second use - a closing pattern's next occurrence, say - does not
        stop the device for a capture), or None where the capture failed (``draw_error`` for a
        drawing graph, else ``error``)."""
        pair = self.graphs.setdefault(key, [])
        turn = self._turn.get(key, 0)
        self._turn[key] = 1 - turn
        try:
            while len(pair) < 2:
                pair.append(self._capture(runner, key, host_layout))
        except Exception:  # an op that needs the host
            import traceback

            if key[3]:
                self.draw_error = traceback.format_exc()[-2500:]
            else:
                self.error = traceback.format_exc()[-2500:]
            if not pair:
                del self.graphs[key]
            return None
        return pair[turn]

    def _eager(self, runner, host_layout, key, n: int, feed: bool):
        rows, width, caps, draw = key
        buf = host_layout.to(runner.device)
        logits, tok, out = self._body(runner, buf, runner.decode_batch(buf, rows, width, caps), rows, draw, feed=feed)
        return Sampled(tok[:n], out[:n], None, None, None, fed=True) if draw else logits[:n]
