"""The serving process's heap and Python's cyclic collector.

A decode step at batch 256 leaves the host the device's step time less its own work (2.52 against
0.76 ms a step for flash4 on an H100, ``bench/results/serve_engine_h100.json``), and a full
collection stops the host for as long as it takes to walk every tracked object: one took 130 ms at
batch 256 with 3000-token contexts on the tiny preset (``bench/results/serve_host_gc_cpu.json``;
``bench/serve_host.py`` records each full collection and, with ``settle``, how many objects were
frozen: 227k there). One such pause costs the device dozens of steps' slack at once. Two things
keep the collector off the hot path:

- ``settle()`` once the process has loaded its model and warmed its engine: one collection, then
  ``gc.freeze()`` moves every surviving object to the permanent generation, which no later
  collection walks (a frozen object is still freed the moment its last reference goes; only a
  reference cycle among frozen objects would outlive its use, and a loaded model is not garbage);
- a request's per-token records are columns of typed arrays (``sampling.DrawLog``), not one
  tracked object per token.

``settle`` is for a process's entry point (the server, a rollout worker, a bench), not for the
engine's constructor: freezing is process-wide, and a library that froze whatever its caller had
allocated would keep that caller's cycles alive.
"""

from __future__ import annotations

import gc


def settle() -> int:
    """Collect once, then freeze what survived; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Put the frozen objects back under the collector (a process that reloads its model)."""
    gc.unfreeze()
