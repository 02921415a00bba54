"""The paged block cache: storage per (kind, layer), reference counts, a free list, LRU eviction.

A block with references belongs to running requests. When its last reference goes, a block that
was registered under a token-hash (a full, immutable block) stays cached, in LRU order, until
the space is needed; an unregistered block goes straight back to the free list.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from v4stack.serve.cache.spec import CacheSpec, GroupSpec


@dataclass
class BlockMeta:
    """What the kernels and the manager share about a block."""

    id: int
    ref: int = 0
    hash: bytes | None = None  # token-hash chain value of the prefix ending with this block
    start: int = 0  # first token position it covers
    filled: int = 0  # tokens of the block written so far

    def closed(self, group: GroupSpec) -> int:
        """Entries of ``group`` closed in this block."""
        return self.filled // group.ratio if group.ratio else self.filled


class BlockPool:
    def __init__(self, spec: CacheSpec, n_blocks: int, device="cpu"):
        self.spec, self.n_blocks = spec, n_blocks
        self.scratch = n_blocks  # one extra block never handed out: writes a static step discards
        self.storage: dict[tuple[str, int], torch.Tensor] = {
            (g.kind, g.layer): torch.zeros(n_blocks + 1, g.rows, g.width, dtype=g.dtype, device=device)
            for g in spec.paged
        }
        self.meta = [BlockMeta(i) for i in range(n_blocks)]
        self.free: list[int] = list(range(n_blocks - 1, -1, -1))
        self.cached: OrderedDict[int, None] = OrderedDict()  # ref == 0, hashed; oldest first
        self.by_hash: dict[bytes, int] = {}
        self.on_evict = None  # callback(block_id) for dependants (boundary snapshots)
        self._clock = itertools.count()
        self.evictions = 0

    # ---- counts -----------------------------------------------------------------------

    @property
    def n_free(self) -> int:
        """Blocks that can be handed out now (free + evictable cached)."""
        return len(self.free) + len(self.cached)

    @property
    def n_used(self) -> int:
        return self.n_blocks - len(self.free) - len(self.cached)

    # ---- lifecycle ---------------------------------------------------------------------

    def allocate(self, start: int) -> int | None:
        if self.free:
            bid = self.free.pop()
        elif self.cached:
            bid, _ = self.cached.popitem(last=False)
            self._forget(bid)
            self.evictions += 1
        else:
            return None
        m = self.meta[bid]
        m.ref, m.hash, m.start, m.filled = 1, None, start, 0
        return bid

    def _forget(self, bid: int) -> None:
        m = self.meta[bid]
        if m.hash is not None and self.by_hash.get(m.hash) == bid:
            del self.by_hash[m.hash]
        m.hash = None
        if self.on_evict is not None:
            self.on_evict(bid)

    def incref(self, bid: int) -> None:
        m = self.meta[bid]
        if m.ref == 0:
            self.cached.pop(bid, None)
        m.ref += 1

    def decref(self, bid: int) -> None:
        m = self.meta[bid]
        if m.ref <= 0:
            raise RuntimeError(f"block {bid} released more often than taken")
        m.ref -= 1
        if m.ref == 0:
            if m.hash is not None:
                self.cached[bid] = None  # most recently used at the end
            else:
                self.free.append(bid)

    def register(self, bid: int, h: bytes) -> bool:
        """Publish a full block under its hash; False if an equal block is already published."""
        if h in self.by_hash:
            return False
        self.meta[bid].hash = h
        self.by_hash[h] = bid
        return True

    def lookup(self, h: bytes) -> int | None:
        return self.by_hash.get(h)

    # ---- data --------------------------------------------------------------------------

    def gather(self, group: GroupSpec, blocks: list[int], count: int) -> torch.Tensor:
        """The first ``count`` entries of ``group`` along the block table ``blocks``."""
        st = self.storage[(group.kind, group.layer)]
        if count == 0:
            return st.new_zeros(0, group.width)
        need = -(-count // group.rows)
        idx = torch.tensor(blocks[:need], device=st.device)
        return st.index_select(0, idx).reshape(-1, group.width)[:count]

    def scatter(self, group: GroupSpec, blocks: list[int], first: int, rows: torch.Tensor) -> None:
        """Write entries ``[first, first + len(rows))`` of ``group`` along ``blocks``."""
        if rows.shape[0] == 0:
            return
        st = self.storage[(group.kind, group.layer)]
        e = torch.arange(first, first + rows.shape[0])
        table = torch.tensor(blocks)
        flat = table[e // group.rows] * group.rows + e % group.rows
        st.view(-1, group.width)[flat.to(st.device)] = rows.to(st.dtype)
