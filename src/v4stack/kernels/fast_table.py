"""Fast mode's measured picks between a project kernel and the framework's implementation.

``fast_picks.json`` is written by ``python -m bench.fast_picks`` from a committed ops measurement
(it names the result file and its commit, and keeps both device times per bucket). A call with R
rows takes the first bucket with rows >= R; an op without buckets, or R past its last bucket,
gets ``None``: the registered rule decides.
"""

from __future__ import annotations

import bisect
import functools
import json
from pathlib import Path

TABLE = Path(__file__).with_name("fast_picks.json")


@functools.lru_cache(maxsize=None)
def load(path: str = str(TABLE)) -> dict:
    return json.loads(Path(path).read_text())


@functools.lru_cache(maxsize=None)
def _buckets(op: str, path: str) -> tuple[list[int], list[bool]]:
    b = load(path)["ops"].get(op, {}).get("buckets", [])
    return [x["rows"] for x in b], [x["pick"] == "project" for x in b]


def prefers_project(op: str, rows: int, path: str = str(TABLE)) -> bool | None:
    """True when the measurement says the project kernel is faster for ``rows`` rows, False when
    the framework is, None when no bucket covers the call."""
    bounds, picks = _buckets(op, path)
    i = bisect.bisect_left(bounds, rows)
    return picks[i] if i < len(picks) else None
