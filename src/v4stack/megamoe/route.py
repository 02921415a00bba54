"""One layer call's routing as both sides of an expert-parallel exchange hold it.

The source side keeps its pairs in (expert, pair id) order; the expert side keeps, in canonical
order (local expert, then source rank), which of a source's pairs each of its rows is. Both
transports (symmetric-memory pull and ``all_to_all_single``) fill one of these in ``dispatch``;
``combine`` and the two backward moves reuse it, so the reverse protocol walks the same rows in
the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Route:
    n: int                               # tokens this rank sent
    k: int                               # top-k
    idx: torch.Tensor                    # [n, k] expert ids (source side)
    order: torch.Tensor                  # [n * k] pair ids sorted by (expert, pair id)
    counts: list[int]                    # rows per local expert (expert side)
    grid: list[list[int]] = field(default_factory=list)  # rows per (source rank, local expert)
    segs: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (expert, source, pair ids)
    # all-to-all only: rows per peer out / in, and expert-major position of each received row
    send_rows: list[int] = field(default_factory=list)
    recv_rows: list[int] = field(default_factory=list)
    perm: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return sum(self.counts)

    def remote_rows(self, rank: int) -> int:
        """Rows this rank's experts took from other ranks (for link accounting)."""
        if self.perm is not None:
            return sum(c for r, c in enumerate(self.recv_rows) if r != rank)
        return sum(p.numel() for _, s, p in self.segs if s != rank)
