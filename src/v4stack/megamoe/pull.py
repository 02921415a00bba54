"""MegaMoE: expert parallelism as overlapped waves with pull-based dispatch.

One layer call, on every rank at once (each rank is both a source of tokens and the owner of a
contiguous block of experts):

1. **Metadata push.** The source copies its token rows and routing weights into its own
   symmetric buffers, then writes only metadata into each destination: the per-(source, expert)
   row counts and the pair ids (``token * k + slot``) into the region the destination reserved
   for that source (row ``source`` of its ``counts`` and ``pairs`` buffers). Barrier.
2. **Pull.** Each rank walks its experts wave by wave (``plan_waves``); a puller thread copies the
   rows each tile needs straight out of the sources' buffers into a local ring of tiles, waiting
   on the ring's free counter first (back-pressure sits with the rank that owns the compute).
3. **Compute.** The compute side takes a wave once its tiles are in the ring, runs Linear-1 ->
   SwiGLU (V4 clamps) -> Linear-2 on every tile, frees the slots, and pushes each output row into
   the source's combine buffer at the row's pair id. Wave j+1 is pulled while wave j computes; on
   CUDA wave j-1's combine push runs on a third stream meanwhile.
4. **Reduce.** Barrier; each source sums its tokens' k rows in fp32 in the fixed order of
   ``experts.reduce_topk`` (ascending expert id).

Every buffer a rank writes into is a region nobody else writes, and the row order is fixed by
the metadata, so arrival order never enters a floating-point sum (see ``experts.py``).
On CUDA the puller runs on its own stream and tiles are handed over with events.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from v4stack.megamoe.experts import ExpertShard, pairs_by_expert, reduce_topk
from v4stack.megamoe.fp8 import FP8, dequantize_rows, n_scales, quantize_rows
from v4stack.megamoe.plan import Hardware, WavePlan, plan_waves
from v4stack.megamoe.symm import symmetric_buffer

CPU_HW = Hardware(peak_flops=50e9, link_bytes_per_s=5e9, compute_units=2, block_m=8)


@dataclass
class Tile:
    expert: int                   # local expert id
    segments: list[tuple[int, torch.Tensor]]  # (source rank, pair ids) in row order
    rows: int


@dataclass
class CallStats:
    """What one call moved and how it was cut (for the benchmark)."""

    pulled_rows: int = 0
    remote_rows: int = 0
    tiles: int = 0
    ring_peak: int = 0
    waves: list[list[int]] = field(default_factory=list)


class _Ring:
    """A ring of ``slots`` tiles with monotonic produced / freed counters."""

    def __init__(self, slots: int):
        self.slots = slots
        self.produced = 0
        self.freed = 0
        self.peak = 0  # most tiles ever in the ring at once
        self.error: BaseException | None = None
        self.cv = threading.Condition()

    def wait_free(self) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.produced - self.freed < self.slots or self.error)

    def publish(self) -> None:
        with self.cv:
            self.produced += 1
            self.peak = max(self.peak, self.produced - self.freed)
            self.cv.notify_all()

    def wait_produced(self, n: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.produced >= n or self.error)
            if self.error:
                raise RuntimeError("megamoe puller failed") from self.error

    def free(self, n: int) -> None:
        with self.cv:
            self.freed += n
            self.cv.notify_all()

    def fail(self, err: BaseException) -> None:
        with self.cv:
            self.error = err
            self.cv.notify_all()


class MegaMoE:
    """The pull-based expert-parallel path for one MoE layer on one rank of ``group``.

    ``max_tokens`` bounds the tokens any rank sends in one call (the buffers are sized once).
    ``ring_tiles`` is the local ring's capacity in tiles of ``shard.tile`` rows.
    """

    def __init__(self, shard: ExpertShard, *, max_tokens: int, group=None, device="cpu",
                 dispatch_dtype: torch.dtype = torch.bfloat16, combine_dtype: torch.dtype = torch.float32,
                 ring_tiles: int = 8, hw: Hardware | None = None):
        if not (isinstance(max_tokens, int) and max_tokens > 0):
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if not (isinstance(ring_tiles, int) and ring_tiles >= 2):
            raise ValueError(f"ring_tiles must be an integer >= 2, got {ring_tiles!r}")
        self.shard, self.group = shard, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if shard.n_local * self.world != shard.n_experts:
            raise ValueError(f"shard holds {shard.n_local} experts; world {self.world} x that must equal "
                             f"n_experts {shard.n_experts}")
        self.device = torch.device(device)
        self.max_tokens, self.ring_tiles = max_tokens, ring_tiles
        self.dispatch_dtype, self.combine_dtype = dispatch_dtype, combine_dtype
        self.hw = hw or CPU_HW
        h, k, nl = shard.hidden, shard.topk, shard.n_local
        self.fp8 = dispatch_dtype == FP8
        ns = n_scales(h) if self.fp8 else 0
        self.buf = symmetric_buffer({
            "x": ((max_tokens, h), dispatch_dtype),
            "xs": ((max_tokens, ns), torch.float32),  # per-128 scales (FP8 dispatch only)
            "w": ((max_tokens * k,), torch.float32),
            "counts": ((self.world, nl), torch.int32),
            "pairs": ((self.world, max_tokens * k), torch.int32),
            "comb": ((max_tokens * k, h), combine_dtype),
        }, group, self.device)
        self.ring_x = torch.zeros(ring_tiles, shard.tile, h, dtype=dispatch_dtype, device=self.device)
        self.ring_w = torch.zeros(ring_tiles, shard.tile, dtype=torch.float32, device=self.device)
        self.ring_s = torch.ones(ring_tiles, shard.tile, ns, dtype=torch.float32, device=self.device)
        self.last = CallStats()
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._pull_stream = torch.cuda.Stream(self.device)
            self._combine_stream = torch.cuda.Stream(self.device)
            self._ready = [torch.cuda.Event() for _ in range(ring_tiles)]
            self._done = [None] * ring_tiles

    # ---- 1. metadata push ------------------------------------------------------------------

    def _push_metadata(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
        n, k = idx.shape
        buf, nl = self.buf, self.shard.n_local
        if self.fp8:
            q, scales = quantize_rows(x)
            buf.local("x")[:n].copy_(q)
            buf.local("xs")[:n].copy_(scales)
        else:
            buf.local("x")[:n].copy_(x.to(self.dispatch_dtype))
        buf.local("w")[: n * k].copy_(w.reshape(-1).float())
        order, counts = pairs_by_expert(idx, self.shard.n_experts)
        order, counts = order.to(torch.int32).to(self.device), counts.to(torch.int32)
        per_dest = counts.view(self.world, nl)
        lo = 0
        for r in range(self.world):
            c = per_dest[r]
            m = int(c.sum())
            buf.remote(r, "counts")[self.rank].copy_(c.to(self.device))
            if m:
                buf.remote(r, "pairs")[self.rank, :m].copy_(order[lo : lo + m])
            lo += m

    # ---- 2/3. walk waves: pull + compute ---------------------------------------------------

    def _tiles(self) -> tuple[list[list[Tile]], WavePlan]:
        counts = self.buf.local("counts").cpu().long()           # [world, n_local]
        pairs = self.buf.local("pairs")
        starts = torch.cumsum(counts, 1) - counts                # per source, per expert
        per_expert = counts.sum(0).tolist()
        k = self.shard.topk
        plan = plan_waves(
            per_expert, self._hw_for_tile(),
            tokens=round(sum(per_expert) * self.world / k),  # even-routing estimate of the global batch
            topk=k, n_experts=self.shard.n_experts,
            expert_width=self.shard.w1[0].shape[0] if self.shard.n_local else 1,
            ring_tiles=self.ring_tiles,
            dispatch_bytes=torch.empty((), dtype=self.dispatch_dtype).element_size(),
            combine_bytes=torch.empty((), dtype=self.combine_dtype).element_size())
        T = self.shard.tile
        waves: list[list[Tile]] = []
        for wave in plan.waves:
            tiles: list[Tile] = []
            for e in wave:
                cur: list[tuple[int, torch.Tensor]] = []
                filled = 0
                for s in range(self.world):
                    c, st = int(counts[s, e]), int(starts[s, e])
                    done = 0
                    while done < c:
                        take = min(T - filled, c - done)
                        cur.append((s, pairs[s, st + done : st + done + take].long()))
                        filled += take
                        done += take
                        if filled == T:
                            tiles.append(Tile(e, cur, T))
                            cur, filled = [], 0
                if cur:
                    tiles.append(Tile(e, cur, filled))
            waves.append(tiles)
        return waves, plan

    def _hw_for_tile(self) -> Hardware:
        hw = self.hw
        return Hardware(hw.peak_flops, hw.link_bytes_per_s, hw.compute_units, self.shard.tile)

    def _pull(self, waves: list[list[Tile]], ring: _Ring) -> None:
        try:
            k = self.shard.topk
            i = 0
            if self._cuda:
                torch.cuda.set_device(self.device)
            ctx = torch.cuda.stream(self._pull_stream) if self._cuda else _nullctx()
            with ctx:
                for tiles in waves:
                    for t in tiles:
                        ring.wait_free()
                        if ring.error:
                            return
                        slot = i % self.ring_tiles
                        if self._cuda and self._done[slot] is not None:
                            self._pull_stream.wait_event(self._done[slot])
                        lo = 0
                        for s, p in t.segments:
                            n = p.shape[0]
                            src_x, src_w = self.buf.remote(s, "x"), self.buf.remote(s, "w")
                            p_dev = p.to(self.device)
                            torch.index_select(src_x, 0, p_dev // k, out=self.ring_x[slot, lo : lo + n])
                            torch.index_select(src_w, 0, p_dev, out=self.ring_w[slot, lo : lo + n])
                            if self.fp8:
                                torch.index_select(self.buf.remote(s, "xs"), 0, p_dev // k,
                                                   out=self.ring_s[slot, lo : lo + n])
                            lo += n
                        if lo < self.shard.tile:
                            self.ring_x[slot, lo:].zero_()
                            self.ring_w[slot, lo:].zero_()
                        if self._cuda:
                            self._ready[slot].record(self._pull_stream)
                        ring.publish()
                        i += 1
        except BaseException as e:  # surfaces in the compute thread
            ring.fail(e)

    def _compute(self, waves: list[list[Tile]], ring: _Ring) -> None:
        """GEMMs of a wave, free its ring slots, then push its combine rows (on CUDA the push runs
        on its own stream, so wave j's combine overlaps wave j+1's GEMMs)."""
        i = 0
        for tiles in waves:
            n = len(tiles)
            # a wave that fits the ring is taken whole; an oversized one (one skewed expert) streams
            step = n if 0 < n <= self.ring_tiles else 1
            for lo in range(0, n, step):
                group = tiles[lo : lo + step]
                ring.wait_produced(i + len(group))
                ys = []
                for j, t in enumerate(group):
                    slot = (i + j) % self.ring_tiles
                    if self._cuda:
                        torch.cuda.current_stream(self.device).wait_event(self._ready[slot])
                    xt = self.ring_x[slot]
                    if self.fp8:
                        xt = dequantize_rows(xt, self.ring_s[slot])
                    ys.append(self.shard.ffn_tile(t.expert, xt, self.ring_w[slot]).to(self.combine_dtype))
                    if self._cuda:
                        ev = torch.cuda.Event()
                        ev.record(torch.cuda.current_stream(self.device))
                        self._done[slot] = ev
                i += len(group)
                ring.free(len(group))
                self._push_combine(group, ys)

    def _push_combine(self, group: list[Tile], ys: list[torch.Tensor]) -> None:
        ctx = _nullctx()
        if self._cuda:
            self._combine_stream.wait_stream(torch.cuda.current_stream(self.device))
            ctx = torch.cuda.stream(self._combine_stream)
        with ctx:
            for t, y in zip(group, ys):
                if self._cuda:
                    y.record_stream(self._combine_stream)
                r = 0
                for s, p in t.segments:
                    m = p.shape[0]
                    self.buf.remote(s, "comb").index_copy_(0, p.to(self.device), y[r : r + m])
                    r += m

    # ---- the call --------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Routed output ``[N, h]`` in fp32 for this rank's tokens ``x [N, h]``, ``idx``/``w [N, k]``."""
        n, k = idx.shape
        if n > self.max_tokens:
            raise ValueError(f"x has {n} tokens; this MegaMoE was built for max_tokens={self.max_tokens}")
        if k != self.shard.topk or x.shape != (n, self.shard.hidden) or w.shape != idx.shape:
            raise ValueError(f"expected x [N, {self.shard.hidden}], idx and w [N, {self.shard.topk}]; got "
                             f"x {tuple(x.shape)}, idx {tuple(idx.shape)}, w {tuple(w.shape)}")
        self._push_metadata(x.to(self.device), idx.cpu(), w.to(self.device))
        self.buf.barrier()
        waves, plan = self._tiles()
        ring = _Ring(self.ring_tiles)
        if self._cuda:  # the pulls start after the metadata barrier on the compute stream
            self._pull_stream.wait_stream(torch.cuda.current_stream(self.device))
        puller = threading.Thread(target=self._pull, args=(waves, ring), daemon=True)
        puller.start()
        try:
            self._compute(waves, ring)
        except BaseException as e:
            ring.fail(e)
            raise
        finally:
            puller.join()
        if ring.error:
            raise RuntimeError("megamoe puller failed") from ring.error
        if self._cuda:  # every combine row is written before the barrier
            torch.cuda.current_stream(self.device).wait_stream(self._combine_stream)
        self.buf.barrier()
        all_tiles = [t for ts in waves for t in ts]
        self.last = CallStats(
            pulled_rows=sum(t.rows for t in all_tiles),
            remote_rows=sum(p.shape[0] for t in all_tiles for s, p in t.segments if s != self.rank),
            tiles=len(all_tiles), ring_peak=ring.peak, waves=plan.waves)
        # No third barrier: peers write these combine rows again only after the next call's
        # metadata barrier, which this rank reaches after reading them.
        return reduce_topk(self.buf.local("comb"), idx)

    __call__ = forward

    def close(self) -> None:
        self.buf.close()


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
