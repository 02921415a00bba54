"""The cache manager: admission, prefix reuse, per-step gather / scatter, and release.

Per request it keeps a state slot (window + compressor tails, in place) and a block table. Full
blocks are published under a token-hash chain; at each published block's end the state slot is
copied into a boundary snapshot. A new request reuses the longest prefix of whole blocks whose
compressed entries are all cached AND whose last block has a boundary snapshot (the minimum over
cache groups); the rest of its prompt is computed. At least one prompt token is always computed,
so the request has logits to sample from.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from v4stack.config import ModelConfig
from v4stack.model.state import RequestState
from v4stack.serve.cache.block_pool import BlockPool
from v4stack.serve.cache.spec import CacheSpec
from v4stack.serve.cache.state_pool import StatePool


class CacheFull(RuntimeError):
    """Not enough free blocks or state slots right now."""


def chain_hash(prev: bytes, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    return h.digest()


ROOT = b"v4stack-prefix-v1"


@dataclass
class RequestCache:
    slot: int
    blocks: list[int] = field(default_factory=list)
    pos: int = 0
    tokens: list[int] = field(default_factory=list)  # every token fed so far
    hashes: list[bytes] = field(default_factory=list)  # chain value of each full block
    hit_tokens: int = 0


class CacheManager:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, n_blocks: int, n_slots: int,
                 n_snapshots: int | None = None, device="cpu", block_multiple: int = 1):
        self.cfg = cfg
        self.spec = CacheSpec.from_config(cfg, dtype, block_multiple)
        self.B = self.spec.block_tokens
        n_layers = cfg.num_hidden_layers
        self.blocks = BlockPool(self.spec, n_blocks, device)
        self.slots = StatePool(self.spec, n_layers, n_slots, device)
        self.snap = StatePool(self.spec, n_layers, n_snapshots if n_snapshots is not None else n_blocks, device)
        self.snap_of: OrderedDict[int, int] = OrderedDict()  # block id -> snapshot slot, LRU order
        self.blocks.on_evict = self._drop_snapshot
        self.prefix_queries = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # ---- snapshots ---------------------------------------------------------------------

    def _drop_snapshot(self, bid: int) -> None:
        s = self.snap_of.pop(bid, None)
        if s is not None:
            self.snap.release(s)

    def _take_snapshot(self, bid: int, layers) -> None:
        """Keep ``layers`` (the fixed-size state at block ``bid``'s end) for prefix reuse."""
        if bid in self.snap_of:
            self.snap_of.move_to_end(bid)
            return
        s = self.snap.acquire()
        if s is None:
            if not self.snap_of:
                return
            _, s = self.snap_of.popitem(last=False)  # evict the least recently used snapshot
        self.snap.store(s, layers)
        self.snap_of[bid] = s

    # ---- admission and prefix reuse ----------------------------------------------------

    def match_prefix(self, tokens: list[int]) -> list[int]:
        """Blocks of the longest reusable prefix (never the whole prompt)."""
        B = self.B
        limit = (len(tokens) - 1) // B
        chain, prev = [], ROOT
        for j in range(limit):
            prev = chain_hash(prev, tokens[j * B : (j + 1) * B])
            bid = self.blocks.lookup(prev)
            if bid is None:
                break
            chain.append(bid)
        while chain and chain[-1] not in self.snap_of:  # the state group needs the boundary
            chain.pop()
        return chain

    def blocks_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.B)

    def admit(self, tokens: list[int]) -> RequestCache:
        """Take a state slot and the prefix blocks; raise ``CacheFull`` if there is no room for
        the prompt (plus one decode token)."""
        hit = self.match_prefix(tokens)
        need = self.blocks_needed(len(tokens) + 1) - len(hit)
        evictable_hits = sum(1 for b in hit if self.blocks.meta[b].ref == 0)
        if self.slots.n_free == 0 or self.blocks.n_free - evictable_hits < need:
            raise CacheFull(f"need {need} blocks and a state slot; {self.blocks.n_free} blocks and "
                            f"{self.slots.n_free} slots free")
        slot = self.slots.acquire()
        rc = RequestCache(slot=slot)
        for b in hit:
            self.blocks.incref(b)
        rc.blocks = list(hit)
        if hit:
            s = self.snap_of[hit[-1]]
            self.snap_of.move_to_end(hit[-1])
            self.slots.copy(self.snap, s, slot)
            rc.pos = len(hit) * self.B
            rc.tokens = list(tokens[: rc.pos])
            prev = ROOT
            for j in range(len(hit)):
                prev = chain_hash(prev, tokens[j * self.B : (j + 1) * self.B])
                rc.hashes.append(prev)
        rc.hit_tokens = rc.pos
        self.prefix_queries += 1
        self.prefix_hit_tokens += rc.pos
        self.prefix_query_tokens += len(tokens)
        return rc

    def reserve(self, rc: RequestCache, n_new: int) -> bool:
        """Make sure blocks exist for ``n_new`` more tokens; False (nothing taken) if not."""
        need = self.blocks_needed(rc.pos + n_new) - len(rc.blocks)
        if need <= 0:
            return True
        if self.blocks.n_free < need:
            return False
        for _ in range(need):
            rc.blocks.append(self.blocks.allocate(start=len(rc.blocks) * self.B))
        return True

    # ---- per step ----------------------------------------------------------------------

    def state(self, rc: RequestCache, n_new: int = 0) -> RequestState:
        """The model's view: state slot in place, compressed entries gathered from the blocks, and
        a request to record the fixed-size state at every block boundary of the next ``n_new``
        tokens (for the boundary snapshots)."""
        st = self.slots.view(rc.slot, rc.pos)
        first = rc.pos // self.B + 1
        capture = tuple(range(first * self.B, rc.pos + n_new + 1, self.B))
        for ls in st.layers:
            ls.capture_at = capture
        by_layer = {}
        for g in self.spec.paged:
            by_layer.setdefault(g.layer, {})[g.kind] = g
        for layer, groups in by_layer.items():
            ls = st.layers[layer]
            ls.compressed_kv = self.blocks.gather(groups["compressed_kv"], rc.blocks, rc.pos // groups["compressed_kv"].ratio)
            if "index_keys" in groups:
                g = groups["index_keys"]
                ls.index_keys = self.blocks.gather(g, rc.blocks, rc.pos // g.ratio)
        return st

    def commit(self, rc: RequestCache, st: RequestState, new_tokens: list[int]) -> None:
        """Store what a step produced: new closed entries into blocks; publish full blocks."""
        old = rc.pos
        for g in self.spec.paged:
            ls = st.layers[g.layer]
            rows = ls.compressed_kv if g.kind == "compressed_kv" else ls.index_keys
            a, b = old // g.ratio, st.pos // g.ratio
            self.blocks.scatter(g, rc.blocks, a, rows[a:b])
        rc.tokens.extend(new_tokens)
        rc.pos = st.pos
        B = self.B
        for j in range(old // B, rc.pos // B + 1):
            if j < len(rc.blocks):
                self.blocks.meta[rc.blocks[j]].filled = min(B, max(0, rc.pos - j * B))
        while len(rc.hashes) < rc.pos // B:
            j = len(rc.hashes)
            prev = rc.hashes[-1] if rc.hashes else ROOT
            h = chain_hash(prev, rc.tokens[j * B : (j + 1) * B])
            rc.hashes.append(h)
            self.blocks.register(rc.blocks[j], h)
            # the published block for this prefix (ours, or an equal one published first)
            bid = self.blocks.lookup(h)
            P = (j + 1) * B
            if bid is not None and P in st.layers[0].captured:
                self._take_snapshot(bid, [ls.captured[P] for ls in st.layers])

    def free(self, rc: RequestCache) -> None:
        for b in rc.blocks:
            self.blocks.decref(b)
        rc.blocks = []
        self.slots.release(rc.slot)
        rc.slot = -1

    # ---- numbers -----------------------------------------------------------------------

    def stats(self) -> dict:
        return {
            "block_tokens": self.B,
            "blocks_total": self.blocks.n_blocks,
            "blocks_used": self.blocks.n_used,
            "blocks_cached": len(self.blocks.cached),
            "blocks_free": len(self.blocks.free),
            "slots_free": self.slots.n_free,
            "snapshots": len(self.snap_of),
            "evictions": self.blocks.evictions,
            "prefix_hit_rate": self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0,
            "bytes_per_token": self.spec.bytes_per_token(),
            "state_bytes_per_request": self.spec.slot_bytes(),
        }
