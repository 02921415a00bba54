"""The cache manager: admission, prefix reuse, per-step book-keeping, and release.

Per request it keeps a state slot (window + compressor tails, in place) and a block table. The
model reads and writes both in place through ``paged`` (``model/paged.py``): nothing is gathered
per step. Full blocks are published under a token-hash chain; at each published block's end the
model writes the state as it stood there into a boundary snapshot slot the manager picked. A new request reuses the longest prefix of whole blocks whose
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
from v4stack.model.paged import PagedCache
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
PLACEHOLDER = -1  # a fed token whose id is still on the device (an overlapped step: serve/overlap.py)


@dataclass
class RequestCache:
    slot: int
    blocks: list[int] = field(default_factory=list)
    pos: int = 0
    tokens: list[int] = field(default_factory=list)  # every token fed so far
    hashes: list[bytes] = field(default_factory=list)  # chain value of each full block
    hit_tokens: int = 0
    # boundary snapshots written for blocks whose last token was still a placeholder when the step
    # was planned ({block end: snapshot slot}): published with their block by ``publish``
    unhashed: dict[int, int] = field(default_factory=dict)


class CacheManager:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, n_blocks: int, n_slots: int,
                 n_snapshots: int | None = None, device="cpu", block_multiple: int = 1, index_fp8: bool = False):
        self.cfg = cfg
        self.dtype = dtype
        self.spec = CacheSpec.from_config(cfg, dtype, block_multiple, index_fp8)
        self.B = self.spec.block_tokens
        n_layers = cfg.num_hidden_layers
        self.blocks = BlockPool(self.spec, n_blocks, device)
        self.slots = StatePool(self.spec, n_layers, n_slots, device)
        self.snap = StatePool(self.spec, n_layers, n_snapshots if n_snapshots is not None else n_blocks, device)
        self.snap_of: OrderedDict[int, int] = OrderedDict()  # block id -> snapshot slot, LRU order
        self.blocks.on_evict = self._drop_snapshot
        self.paged = PagedCache(state=self.slots.tensors, snap=self.snap.tensors, blocks=self.blocks.storage,
                                block_tokens=self.B)
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

    def admit(self, tokens: list[int], reuse: bool = True) -> RequestCache:
        """Take a state slot and the prefix blocks (none with ``reuse=False``: every prompt token
        is computed); raise ``CacheFull`` if there is no room for the prompt (plus one decode token)."""
        hit = self.match_prefix(tokens) if reuse else []
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

    def _block_hash(self, rc: RequestCache, hashes: list[bytes], j: int, new_tokens: list[int]) -> bytes:
        B, pos = self.B, rc.pos
        lo, hi = j * B, (j + 1) * B
        toks = rc.tokens[lo:min(hi, pos)] + new_tokens[max(0, lo - pos) : hi - pos]
        return chain_hash(hashes[j - 1] if j else ROOT, toks)

    def plan_captures(self, chunks: list[tuple[RequestCache, list[int]]]) -> list[dict[int, int]]:
        """For one step (each request's cache and the tokens it feeds): which block ends inside
        the step need a boundary snapshot, and the snapshot slot each is written to, as
        ``{position: slot}`` per request. A block whose published copy already has a snapshot
        needs none; when slots run out the least recently used snapshot goes, then the step's own
        earliest capture (so the latest boundaries win, as if taken one after another). A block
        closed by a ``PLACEHOLDER`` token cannot be looked up (its hash needs the id): it gets a
        slot, which ``publish`` gives back if an equal block turns out to hold one already."""
        out: list[dict[int, int]] = []
        pending: list[tuple[dict, int]] = []
        B = self.B
        for rc, new in chunks:
            caps: dict[int, int] = {}
            out.append(caps)
            first, end = rc.pos // B, (rc.pos + len(new)) // B
            if first == end:  # no block ends inside the step (a decode token, most steps)
                continue
            hashes = list(rc.hashes)
            while len(hashes) < first:  # a restored cache may not carry its chain
                hashes.append(self._block_hash(rc, hashes, len(hashes), []))
            for j in range(first, end):
                if PLACEHOLDER in new[max(0, j * B - rc.pos) : (j + 1) * B - rc.pos]:
                    blind = True  # (and every later block of the chain: none in a one-token step)
                else:
                    h = self._block_hash(rc, hashes, j, new)
                    hashes.append(h)
                    bid = self.blocks.lookup(h)
                    if bid is not None and bid in self.snap_of:
                        continue
                    blind = False
                slot = self.snap.acquire()
                if slot is None and self.snap_of:
                    _, slot = self.snap_of.popitem(last=False)
                if slot is None and pending:
                    owner, P = pending.pop(0)
                    slot = owner.pop(P)
                if slot is None:
                    continue
                P = (j + 1) * B
                caps[P] = slot
                pending.append((caps, P))
                if blind:
                    break
        return out

    def advance(self, rc: RequestCache, new_tokens: list[int], captures: dict[int, int]) -> None:
        """Book-keeping after a step fed ``new_tokens``: positions, fill counts, published full
        blocks, and the boundary snapshots the step wrote (the model wrote all data in place). A
        block whose tokens include a ``PLACEHOLDER`` is published by ``publish`` once the id is in
        ``rc.tokens``."""
        old = rc.pos
        rc.tokens.extend(new_tokens)
        rc.pos += len(new_tokens)
        B = self.B
        for j in range(old // B, rc.pos // B + 1):
            if j < len(rc.blocks):
                self.blocks.meta[rc.blocks[j]].filled = min(B, max(0, rc.pos - j * B))
        rc.unhashed.update(captures)
        self.publish(rc)

    def publish(self, rc: RequestCache) -> None:
        """Hash and publish ``rc``'s full blocks not published yet, up to the first that still
        holds a ``PLACEHOLDER``, each with the boundary snapshot its step wrote (if any)."""
        B, caps = self.B, rc.unhashed
        while len(rc.hashes) < rc.pos // B:
            j = len(rc.hashes)
            if PLACEHOLDER in rc.tokens[j * B : (j + 1) * B]:
                return
            h = self._block_hash(rc, rc.hashes, j, [])
            rc.hashes.append(h)
            self.blocks.register(rc.blocks[j], h)
            bid = self.blocks.lookup(h)  # ours, or an equal block published first
            slot = caps.pop((j + 1) * B, None)
            if bid is not None and bid in self.snap_of:
                self.snap_of.move_to_end(bid)
                if slot is not None:
                    self.snap.release(slot)
            elif slot is not None:
                if bid is None:
                    self.snap.release(slot)
                else:
                    self.snap_of[bid] = slot

    def advance_all(self, chunks: list[tuple[RequestCache, list[int]]], captures: list[dict[int, int]] | None) -> None:
        """``advance`` for every chunk of a step (``captures`` None: none). A decode token that
        closes no block and finds the request's hashes up to date only moves the position and its
        block's fill count (the common case, kept short: it runs for every request every step)."""
        B, meta = self.B, self.blocks.meta
        for i, (rc, toks) in enumerate(chunks):
            c = captures[i] if captures is not None else None
            pos = rc.pos + 1
            j = pos // B
            if len(toks) == 1 and not c and pos % B and len(rc.hashes) == j:
                rc.tokens.append(toks[0])
                rc.pos = pos
                if j < len(rc.blocks):
                    meta[rc.blocks[j]].filled = pos - j * B
            else:
                self.advance(rc, toks, c or {})

    def free(self, rc: RequestCache) -> None:
        for slot in rc.unhashed.values():  # snapshots of blocks that were never published
            self.snap.release(slot)
        rc.unhashed.clear()
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
