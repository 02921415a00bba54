"""The serving process's heap and Python's cyclic collector.

A decode step at batch 256 leaves the host ~0.5 ms of slack (it prepares step n+1 while the
device runs step n), and a full collection stops the host for as long as it takes to walk every
tracked object: with torch imported and a model loaded that is ~200k objects, ~75 ms, and at 256
requests of 16k-token contexts the token lists add ~50 ms more (``bench/serve_host.py`` records
each full collection). One such pause costs the device a hundred steps' slack at once. Two things
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
