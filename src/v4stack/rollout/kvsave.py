"""A preempted request's cache on disk: its state slot and its compressed blocks, in one file.

The file is ``MAGIC | blake2b-256(file name, payload) | payload`` where the payload is a ``torch.save`` of
the slot tensors (window and compressor tails of every layer), the closed entries of every paged
group (compressed KV, indexer keys) gathered along the request's block table, the tokens the
cache covers and the cache layout it was taken with. It is written temp + fsync + rename (+ fsync
of the directory), so a reader sees the whole file or none. The digest binds the content to the
file's name (its key: trajectory and offset), and the handle that goes into the WAL's PREEMPT
record carries it, so a file that was swapped, truncated, flipped or copied from another worker
is refused - it is a miss, never a load.

``load`` raises ``KVUnavailable`` with the reason for any file that cannot be used; the caller
then re-prefills the durable tokens instead.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from v4stack.atomic import atomic_write
from v4stack.serve.cache.manager import CacheFull, CacheManager, RequestCache

MAGIC = b"V4KVSAV2"
_DIGEST = 32


def _digest(name: str, payload: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST)
    h.update(name.encode() + b"\0")
    h.update(payload)
    return h.digest()


class KVUnavailable(RuntimeError):
    """The saved cache cannot be used (missing, corrupt, or not this request's)."""


@dataclass
class SavedCache:
    pos: int
    tokens: list[int]
    slot: dict[str, list[torch.Tensor]]  # "kind/layer" -> the slot's tensors (kv[, score])
    paged: dict[str, torch.Tensor]  # "kind/layer" -> closed entries [pos // ratio, width]


def _layout(cache: CacheManager) -> list:
    return [cache.spec.block_tokens] + [[g.kind, g.layer, g.ratio, g.rows, g.width, str(g.dtype), g.paged]
                                        for g in cache.spec.groups]


def save(cache: CacheManager, rc: RequestCache, path: str | os.PathLike) -> dict:
    """Write ``rc``'s slot and closed entries to ``path``; returns the WAL handle."""
    path = Path(path)
    slot = {f"{k}/{layer}": [t[rc.slot].clone() for t in ts] for (k, layer), ts in cache.slots.tensors.items()}
    paged = {f"{g.kind}/{g.layer}": cache.blocks.gather(g, rc.blocks, rc.pos // g.ratio).clone()
             for g in cache.spec.paged}
    buf = io.BytesIO()
    torch.save({"pos": rc.pos, "tokens": list(rc.tokens[: rc.pos]), "layout": _layout(cache),
                "slot": slot, "paged": paged}, buf)
    payload = buf.getvalue()
    digest = _digest(path.name, payload)
    atomic_write(path, MAGIC + digest + payload)
    return {"file": path.name, "digest": digest.hex(), "pos": rc.pos, "bytes": len(payload) + len(MAGIC) + _DIGEST}


def load(cache: CacheManager, path: str | os.PathLike, handle: dict, tokens: list[int]) -> SavedCache:
    """Read a saved cache and check it against its WAL ``handle`` and the durable ``tokens``."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise KVUnavailable(f"saved cache {path.name}: {e.strerror or e}") from None
    if data[: len(MAGIC)] != MAGIC:
        raise KVUnavailable(f"saved cache {path.name}: bad magic")
    digest, payload = data[len(MAGIC) : len(MAGIC) + _DIGEST], data[len(MAGIC) + _DIGEST :]
    if _digest(path.name, payload) != digest or digest.hex() != handle["digest"] or path.name != handle["file"]:
        raise KVUnavailable(f"saved cache {path.name}: digest mismatch (corrupt or not the file the WAL names)")
    try:
        obj = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:  # a payload that passed its digest but does not load: refuse it
        raise KVUnavailable(f"saved cache {path.name}: unreadable ({e})") from None
    if obj["layout"] != _layout(cache):
        raise KVUnavailable(f"saved cache {path.name}: taken with a different cache layout")
    pos = obj["pos"]
    if pos != handle["pos"] or obj["tokens"] != tokens[:pos] or len(obj["tokens"]) != pos:
        raise KVUnavailable(f"saved cache {path.name}: covers other tokens than the WAL's")
    if pos >= len(tokens):
        raise KVUnavailable(f"saved cache {path.name}: covers all {pos} tokens, none left to feed")
    return SavedCache(pos, obj["tokens"], obj["slot"], obj["paged"])


def restore(cache: CacheManager, saved: SavedCache) -> RequestCache:
    """Take a state slot and blocks and fill them from ``saved``; raises ``CacheFull`` if there
    is no room now (nothing is taken then)."""
    need = cache.blocks_needed(saved.pos + 1)
    if cache.slots.n_free == 0 or cache.blocks.n_free < need:
        raise CacheFull(f"restore needs {need} blocks and a state slot; {cache.blocks.n_free} blocks and "
                        f"{cache.slots.n_free} slots free")
    rc = RequestCache(slot=cache.slots.acquire())
    for (k, layer), ts in cache.slots.tensors.items():
        for dst, src in zip(ts, saved.slot[f"{k}/{layer}"]):
            dst[rc.slot].copy_(src)
    B = cache.B
    for j in range(cache.blocks_needed(saved.pos)):
        bid = cache.blocks.allocate(start=j * B)
        cache.blocks.meta[bid].filled = min(B, saved.pos - j * B)
        rc.blocks.append(bid)
    for g in cache.spec.paged:
        cache.blocks.scatter(g, rc.blocks, 0, saved.paged[f"{g.kind}/{g.layer}"])
    rc.pos = saved.pos
    rc.tokens = list(saved.tokens)
    # rc.hashes stays empty: the next commit publishes the full blocks under their hash chain
    return rc
