"""The on-disk prefix store: closed blocks (compressed entries, indexer keys) and boundary states,
content-addressed by the token-hash chain, so an evicted or restarted cache can take a prefix back.

Files (one per block, one per kept boundary state), each ``MAGIC | digest | payload`` with the raw
tensor bytes as payload, in the order and shapes of the cache layout, written temp + fsync + rename.
The digest (blake2b-256) covers the file's key - its kind, its chain hash and the store's identity -
as well as the payload, so a file renamed to another key, copied from another store, truncated or
flipped fails it: it is removed and counts as absent (a miss, never a load). The store directory
also holds ``LAYOUT`` (the cache layout it was written with; opening it with another layout is
refused) and ``STORE_ID`` (made once, at the first open). Temp files a killed save left behind are
removed at open.

- ``b-<hash>``: the paged groups of the full block whose chain value is ``hash``;
- ``s-<hash>``: the fixed-size state (SWA window, compressor tails) at that block's end.

The SWA strategy says which boundary states are kept (``cache.md`` s3):

- ``full``: the state at every block end (with ``n_win <= B`` that is the SWA rows of every token);
- ``periodic:p``: the state every ``p`` tokens (``p`` a multiple of the block size);
- ``none``: no state. The boundary state is rebuilt by recomputing the last ``n_win * L`` tokens
  (the whole prefix if shorter) from a blank window, with every compressed entry and indexer key
  of the prefix restored first. That is exact: layer l's window at the boundary depends only on
  layer l-1's last ``n_win`` positions, so the exact region shrinks by ``n_win`` per layer and
  ``n_win * L`` tokens cover it; the entries inside the cone are the stored ones (the model
  appends the entries it recomputes after them, where they close past the boundary and no
  position sees them), so no inexact early-cone value leaks through the compressed attention.

``restore(tokens)`` puts the longest stored prefix that ends at a kept state back into the block
pool (registered under its hashes, unreferenced, like any cached prefix) and the state into a
boundary snapshot; the engine's ordinary admission then hits it and computes only the rest (the
tokens after that boundary - the incomplete tail and, under ``periodic``, the blocks after the
last checkpoint). What it loads is bit-for-bit what was computed, so the logits are those of a
cache that never evicted.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from v4stack.atomic import atomic_write
from v4stack.ops import fp8_keys
from v4stack.model.state import CompressorTail, LayerState
from v4stack.serve.cache.manager import ROOT, CacheFull, CacheManager, chain_hash

MAGIC = b"V4PFX002"
_DIGEST = 32


def _digest(key: bytes, payload: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST)
    h.update(len(key).to_bytes(4, "little") + key)
    h.update(payload)
    return h.digest()


def pack(tensors: list[torch.Tensor], key: bytes = b"") -> bytes:
    """Raw bytes of ``tensors`` in order, after the magic and a digest of ``key`` and the bytes."""
    payload = b"".join(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() for t in tensors)
    return MAGIC + _digest(key, payload) + payload


def unpack(data: bytes, layout: list[tuple[tuple[int, ...], torch.dtype]], key: bytes = b"") -> list[torch.Tensor] | None:
    """The tensors of ``layout`` from ``data``, or ``None`` if the magic, size or digest (of ``key``
    and the bytes: a file under another key fails it) is wrong."""
    head, digest, payload = data[: len(MAGIC)], data[len(MAGIC) : len(MAGIC) + _DIGEST], data[len(MAGIC) + _DIGEST :]
    if head != MAGIC or _digest(key, payload) != digest:
        return None
    sizes = [math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in layout]
    if sum(sizes) != len(payload):
        return None
    out, off = [], 0
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    for (shape, dt), n in zip(layout, sizes):
        out.append(raw[off : off + n].view(dt).reshape(shape))
        off += n
    return out


def clean_temp_files(root: Path) -> int:
    """Remove the temp files of whole-file writes (``.<name>.tmp-<pid>-<rand>``) whose writer is
    gone; returns how many. A live writer's temp file is left alone."""
    n = 0
    for p in root.glob(".*.tmp-*"):
        try:
            pid = int(p.name.rsplit(".tmp-", 1)[1].split("-")[0])
            os.kill(pid, 0)
            continue  # its writer still runs
        except ProcessLookupError:
            pass
        except (ValueError, IndexError, PermissionError):
            continue
        p.unlink(missing_ok=True)
        n += 1
    return n


@dataclass(frozen=True)
class SWAStrategy:
    kind: str  # full | periodic | none
    period: int = 0

    @classmethod
    def parse(cls, text: str, block_tokens: int) -> "SWAStrategy":
        if text == "full":
            return cls("full", block_tokens)
        if text.startswith("periodic:"):
            try:
                p = int(text.split(":", 1)[1])
            except ValueError:
                p = -1
            if p < block_tokens or p % block_tokens:
                raise ValueError(f"strategy {text!r}: the period must be a positive multiple of the "
                                 f"block size {block_tokens}")
            return cls("periodic", p)
        if text == "none":
            return cls("none", 0)
        raise ValueError(f"strategy {text!r}: expected 'full', 'periodic:<tokens>' or 'none'")

    def keeps(self, boundary: int) -> bool:
        return self.period > 0 and boundary > 0 and boundary % self.period == 0


@dataclass
class RestoreInfo:
    hit_tokens: int = 0  # prefix tokens the engine will not compute
    blocks_loaded: int = 0  # read from disk (the rest were still in memory)
    state_loaded: bool = False
    cone_tokens: int = 0  # tokens recomputed to rebuild the boundary state (strategy none)
    bytes_read: int = 0
    seconds: float = 0.0


class DiskPrefixStore:
    def __init__(self, root: str | os.PathLike, cache: CacheManager, strategy: str = "full", model=None,
                 ops_mode: str = "invariant"):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.cache = cache
        self.strategy = SWAStrategy.parse(strategy, cache.B)
        if self.strategy.kind == "none" and model is None:
            raise ValueError("strategy 'none': a 'model' is needed to recompute the window cone")
        self.model, self.ops_mode = model, ops_mode
        self._bkeys = sorted(cache.blocks.storage)
        self._blayout = [(tuple(cache.blocks.storage[k].shape[1:]), cache.blocks.storage[k].dtype) for k in self._bkeys]
        self._skeys = sorted(cache.snap.tensors)
        self._slayout = [(tuple(t.shape[1:]), t.dtype) for k in self._skeys for t in cache.snap.tensors[k]]
        desc = repr((cache.B, self._bkeys, self._blayout, self._skeys, self._slayout)).encode()
        lp = self.root / "LAYOUT"
        if lp.exists():
            if lp.read_bytes() != desc:
                raise ValueError(f"prefix store {self.root}: written with another cache layout (field 'root')")
        else:
            atomic_write(lp, desc)
        ip = self.root / "STORE_ID"
        if not ip.exists():
            atomic_write(ip, os.urandom(16).hex().encode())
        self.store_id = ip.read_bytes()
        clean_temp_files(self.root)
        self.cone = cache.cfg.sliding_window * cache.cfg.num_hidden_layers if self.strategy.kind == "none" else 0
        self.bytes_written = 0

    def _path(self, kind: str, h: bytes) -> Path:
        return self.root / f"{kind}-{h.hex()}"

    def _key(self, path: Path) -> bytes:
        return self.store_id + b"/" + path.name.encode()

    def _hashes(self, tokens: list[int], limit: int) -> list[bytes]:
        out, prev, B = [], ROOT, self.cache.B
        for j in range(limit):
            prev = chain_hash(prev, tokens[j * B : (j + 1) * B])
            out.append(prev)
        return out

    # ---- saving --------------------------------------------------------------------------

    def save(self, tokens: list[int]) -> int:
        """Store the full blocks of ``tokens`` still in memory (and the states the strategy keeps);
        returns the bytes written. Blocks already on disk are not rewritten."""
        c, B, written = self.cache, self.cache.B, 0
        for j, h in enumerate(self._hashes(tokens, len(tokens) // B)):
            bid = c.blocks.lookup(h)
            if bid is None:
                break
            bp = self._path("b", h)
            if not bp.exists():
                data = pack([c.blocks.storage[k][bid] for k in self._bkeys], self._key(bp))
                atomic_write(bp, data)
                written += len(data)
            sp = self._path("s", h)
            if self.strategy.keeps((j + 1) * B) and not sp.exists() and bid in c.snap_of:
                s = c.snap_of[bid]
                data = pack([t[s] for k in self._skeys for t in c.snap.tensors[k]], self._key(sp))
                atomic_write(sp, data)
                written += len(data)
        self.bytes_written += written
        return written

    # ---- restoring -----------------------------------------------------------------------

    def _read(self, path: Path, info: RestoreInfo, layout) -> list[torch.Tensor] | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        obj = unpack(data, layout, self._key(path))
        if obj is None:
            path.unlink(missing_ok=True)  # corrupt, or not this key's: as good as absent
            return None
        info.bytes_read += len(data)
        return obj

    def restore(self, tokens: list[int]) -> RestoreInfo:
        """Make the longest restorable prefix of ``tokens`` (never all of it) a cached prefix."""
        t0 = time.perf_counter()
        c, B, info = self.cache, self.cache.B, RestoreInfo()
        hashes = self._hashes(tokens, (len(tokens) - 1) // B)
        run = 0
        for h in hashes:  # blocks present in memory or on disk
            if c.blocks.lookup(h) is None and not self._path("b", h).exists():
                break
            run += 1
        end = run if self.strategy.kind == "none" else 0  # none: any boundary, by recompute
        for j in range(run, 0, -1):
            if end:
                break
            bid = c.blocks.lookup(hashes[j - 1])
            if (bid is not None and bid in c.snap_of) or self._path("s", hashes[j - 1]).exists():
                end = j
        if end == 0:
            info.seconds = time.perf_counter() - t0
            return info
        missing = [j for j in range(end) if c.blocks.lookup(hashes[j]) is None]
        if c.blocks.n_free - sum(1 for j in range(end) if j not in missing and c.blocks.meta[c.blocks.lookup(hashes[j])].ref == 0) < len(missing):
            raise CacheFull(f"restore needs {len(missing)} free blocks; {c.blocks.n_free} free")
        held = []
        try:
            for j in range(end):
                bid = c.blocks.lookup(hashes[j])
                if bid is not None:
                    c.blocks.incref(bid)  # keep it while the rest loads
                    held.append(bid)
                    continue
                obj = self._read(self._path("b", hashes[j]), info, self._blayout)
                if obj is None:
                    end = j
                    break
                bid = c.blocks.allocate(start=j * B)
                for k, t in zip(self._bkeys, obj):
                    c.blocks.storage[k][bid].copy_(t)
                c.blocks.meta[bid].filled = B
                c.blocks.register(bid, hashes[j])
                held.append(bid)
                info.blocks_loaded += 1
            while end > 0:  # the state at the last boundary, from memory or disk
                bid = c.blocks.lookup(hashes[end - 1])
                if bid in c.snap_of:
                    break
                if self.strategy.kind == "none":
                    info.cone_tokens = self._recompute_state(tokens, held[:end], bid, end * B)
                    break
                obj = self._read(self._path("s", hashes[end - 1]), info, self._slayout)
                if obj is not None:
                    c._take_snapshot(bid, self._layers(obj))
                    info.state_loaded = True
                    break
                end -= 1
        finally:
            for bid in held:
                c.blocks.decref(bid)
        info.hit_tokens = end * B if end and c.blocks.lookup(hashes[end - 1]) in c.snap_of else 0
        info.seconds = time.perf_counter() - t0
        return info

    @torch.no_grad()
    def _recompute_state(self, tokens: list[int], blocks: list[int], last: int, P: int) -> int:
        """Rebuild the state at boundary ``P`` (strategy none) into a snapshot of block ``last``;
        returns the tokens recomputed."""
        from v4stack.ops.mode import mode

        c = self.cache
        S = max(0, P - self.cone)
        slot = c.slots.acquire()
        if slot is None:
            raise CacheFull("restore (strategy none) needs a free state slot")
        try:
            st = c.slots.view(slot, S)  # blank window and tails
            for g in c.spec.paged:  # every entry of the prefix, the cone's included
                ents = c.blocks.gather(g, blocks, P // g.ratio)
                if g.kind == "compressed_kv":
                    st.layers[g.layer].compressed_kv = ents
                else:  # the step's own state holds keys in the model dtype
                    st.layers[g.layer].index_keys = (fp8_keys.unpack(ents, c.dtype, c.cfg.index_head_dim)
                                                      if fp8_keys.is_packed(ents) else ents)
            ids = torch.tensor(tokens[S:P], device=c.blocks.storage[next(iter(c.blocks.storage))].device)
            with mode(self.ops_mode):
                self.model.step([(ids, st)])
            c._take_snapshot(last, st.layers)
        finally:
            c.slots.release(slot)
        return P - S

    def _layers(self, tensors: list[torch.Tensor]) -> list[LayerState]:
        it, obj = iter(tensors), {}
        for k in self._skeys:
            obj[f"{k[0]}/{k[1]}"] = [next(it) for _ in self.cache.snap.tensors[k]]
        layers = []
        for i in range(self.cache.cfg.num_hidden_layers):
            ls = LayerState(swa_kv=obj[f"swa_kv/{i}"][0])
            if f"compressor_tail/{i}" in obj:
                ls.tail = CompressorTail(*obj[f"compressor_tail/{i}"])
            if f"index_tail/{i}" in obj:
                ls.index_tail = CompressorTail(*obj[f"index_tail/{i}"])
            layers.append(ls)
        return layers

    def disk_bytes(self) -> dict[str, int]:
        out = {"blocks": 0, "states": 0}
        for p in self.root.iterdir():
            if p.name.startswith("b-"):
                out["blocks"] += p.stat().st_size
            elif p.name.startswith("s-"):
                out["states"] += p.stat().st_size
        return out
