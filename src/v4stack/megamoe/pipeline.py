"""MegaMoE's device-side pipeline (inference): no host round trip inside a layer call.

1. The source sorts its pairs on the device, writes its rows (BF16, or FP8 with per-128 scales)
   and routing weights into its own symmetric buffers, and its counts and sorted pair ids into
   its row of every destination's ``counts`` / ``pairs``. A device-side barrier
   (``symm_mem`` signal pads: each rank signals its peers and waits for theirs on the stream)
   publishes them; the host never reads a count.
2. Each expert rank turns the counts into index maps with fixed-shape device ops: where each of a
   source's pairs lands in expert-major order, the span of each wave in each source's pair list,
   and the tile map of the grouped GEMMs.
3. Waves (``plan.experts_per_wave`` on the expected routing) walk the local experts. For wave w,
   on the pull stream, copy kernels read its rows out of the peers' buffers into ring slot
   ``w % slots``; the compute stream runs one grouped SwiGLU GEMM and one grouped down GEMM; the
   combine stream writes the output rows into each source's ``comb`` buffer at their pair ids.
   Events tie them: a slot is pulled again only after the GEMM that read it finished
   (back-pressure), an output slot is reused only after its combine finished. So pulling wave w+1
   and combining wave w-1 overlap computing wave w.
4. Barrier; each source reduces its ``comb`` rows with ``ops.moe_combine`` (fixed order).

Kernel launch grids are upper bounds derived from ``max_tokens``; surplus programs return at once.
On a CPU the same code runs under ``TRITON_INTERPRET=1`` (gloo barriers instead of signals).
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist

from v4stack.megamoe import kernels as K
from v4stack.megamoe.experts import reduce_pairs, route_order
from v4stack.megamoe.fp8 import FP8, n_scales, quantize_rows
from v4stack.megamoe.plan import H200, Hardware, experts_per_wave
from v4stack.megamoe.symm import symmetric_buffer


MIN_WAVES = 4        # at least this many waves once experts get MIN_WAVE_ROWS rows on average
MIN_WAVE_ROWS = 64


class DevicePipeline:
    def __init__(self, experts, *, max_tokens: int, group=None, device="cuda",
                 dispatch_dtype: torch.dtype = torch.bfloat16, combine_dtype: torch.dtype = torch.float32,
                 ring_slots: int = 2, hw: Hardware = H200, weight_dtype: torch.dtype = torch.bfloat16,
                 wave_experts: int | None = None):
        if not K.available():
            raise RuntimeError("the device pipeline needs Triton")
        if ring_slots < 2:
            raise ValueError(f"ring_slots must be >= 2 (double buffering), got {ring_slots!r}")
        if dispatch_dtype not in (torch.bfloat16, FP8):
            raise ValueError(f"dispatch_dtype must be bfloat16 or float8_e4m3fn, got {dispatch_dtype}")
        self.ex, self.group = experts, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device(device)
        self.max_tokens, self.slots, self.hw = max_tokens, ring_slots, hw
        self.wave_experts = wave_experts  # fixed experts per wave (tests); None: the planner's rule
        self.fp8 = dispatch_dtype == FP8
        self.combine_dtype = combine_dtype
        h, k, E, nl = experts.hidden, experts.topk, experts.n_experts, experts.n_local
        self.mtk = max_tokens * k
        self.buf = symmetric_buffer({
            "x": ((max_tokens, h), dispatch_dtype),
            "xs": ((max_tokens, n_scales(h) if self.fp8 else 1), torch.float32),
            "w": ((self.mtk,), torch.float32),
            "counts": ((self.world, E), torch.int32),
            "pairs": ((self.world, self.mtk), torch.int32),
            "comb": ((self.mtk, h), combine_dtype),
        }, group, self.device)
        rows = self.world * self.mtk  # every row this rank's experts can receive in one call
        # weight_dtype is also the GEMMs' operand dtype (bf16 on GPUs; fp32 under the CPU interpreter)
        self.ring_x = torch.zeros(ring_slots, rows, h, dtype=weight_dtype, device=self.device)
        self.ring_w = torch.zeros(ring_slots, rows, dtype=torch.float32, device=self.device)
        self.act = torch.zeros(ring_slots, rows, experts.inner, dtype=weight_dtype, device=self.device)
        self.y = torch.zeros(ring_slots, rows, h, dtype=combine_dtype, device=self.device)
        self.w1, self.w3, self.w2 = experts.stacked(weight_dtype)
        self._cuda = self.device.type == "cuda"
        self.pull_stream = self.comb_stream = None
        if self._cuda:
            self.pull_stream = torch.cuda.Stream(self.device)
            self.comb_stream = torch.cuda.Stream(self.device)
        self.last_waves: list[tuple[int, int]] = []
        self._bounds: dict = {}

    def bind(self, experts) -> "DevicePipeline":
        """The same buffers and streams with another layer's experts (layers run one at a time)."""
        other = copy.copy(self)
        other.ex = experts
        other.w1, other.w3, other.w2 = experts.stacked(self.w1.dtype)
        return other

    def waves(self, n_tokens: int) -> list[tuple[int, int]]:
        """Local expert ranges per wave, from the expected routing of ``world * n_tokens`` tokens."""
        ex = self.ex
        hw = Hardware(self.hw.peak_flops, self.hw.link_bytes_per_s, self.hw.compute_units, K.BM)
        per = self.wave_experts or experts_per_wave(self.world * max(1, n_tokens), ex.topk, ex.n_experts,
                                                    ex.n_local, hw)
        if self.wave_experts is None and self.world * n_tokens * ex.topk >= MIN_WAVE_ROWS * ex.n_experts:
            # Each tile also spans the N/BN column blocks, so a wave of few experts still fills the
            # GPU; with real work per expert, take at least MIN_WAVES waves so pulls and combines
            # hide behind the GEMMs (DeepGEMM's rule alone gives one wave up to ~2 tiles/expert).
            per = min(per, -(-ex.n_local // MIN_WAVES))
        return [(e, min(e + per, ex.n_local)) for e in range(0, ex.n_local, per)]

    # ---- the call ----------------------------------------------------------------------------

    def _publish(self, x, w, idx):
        n, k = idx.shape
        order, counts = route_order(idx, self.ex.n_experts)
        if self.fp8:
            q, s = quantize_rows(x)
            self.buf.local("x")[:n].copy_(q)
            self.buf.local("xs")[:n].copy_(s)
        else:
            self.buf.local("x")[:n].copy_(x)
        self.buf.local("w")[: n * k].copy_(w.reshape(-1))
        order32 = order.to(torch.int32)
        for r in range(self.world):
            self.buf.remote(r, "counts")[self.rank].copy_(counts)
            self.buf.remote(r, "pairs")[self.rank, : n * k].copy_(order32)
        self.buf.barrier()

    def _maps(self, waves, mt: int):
        ex, world, nl = self.ex, self.world, self.ex.n_local
        cnt = self.buf.local("counts").long()
        c = cnt[:, ex.first : ex.first + nl]                                  # [world, nl]
        pre = cnt[:, : ex.first].sum(1, keepdim=True)
        per_exp = c.sum(0)
        src_off = torch.cumsum(c, 0) - c
        cum = (pre + torch.cumsum(c, 1)).contiguous()                        # end of expert e in pairs[s]
        start = cum - c
        r = torch.arange(mt * self.ex.topk, device=self.device).expand(world, -1).contiguous()
        e_r = torch.searchsorted(cum, r, right=True).clamp_(max=nl - 1)
        max_tiles = -(-world * mt * self.ex.topk // K.BM) + nl
        tiles, tstart, exp_off = K.tile_map(per_exp, max_tiles)
        dest = exp_off.long()[e_r] + src_off.gather(1, e_r) + r - start.gather(1, e_r)
        key = tuple(waves)
        if key not in self._bounds:  # made once per wave layout (no host-to-device copy per call)
            self._bounds[key] = torch.tensor([e0 for e0, _ in waves] + [nl], device=self.device)
        bounds = self._bounds[key]
        spans = torch.cat([start, cum[:, -1:]], 1)[:, bounds].to(torch.int32).contiguous()
        return dest.to(torch.int32).contiguous(), spans, tiles, tstart, exp_off

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, *,
                 peer_tokens: int | None = None) -> torch.Tensor:
        """Routed output ``[N, h]`` (fp32). ``peer_tokens`` bounds the tokens any rank sends in this
        call (a serving engine knows its batch bucket); it only sizes the kernel grids."""
        n, k = idx.shape
        ex = self.ex
        mt = self.max_tokens if peer_tokens is None else peer_tokens
        if not (n <= mt <= self.max_tokens):
            raise ValueError(f"peer_tokens must lie in [N={n}, max_tokens={self.max_tokens}], got {peer_tokens!r}")
        if n > self.max_tokens or k != ex.topk or x.shape != (n, ex.hidden) or w.shape != idx.shape:
            raise ValueError(f"expected x [N <= {self.max_tokens}, {ex.hidden}], weights and indices "
                             f"[N, {ex.topk}]; got x {tuple(x.shape)}, weights {tuple(w.shape)}, "
                             f"indices {tuple(idx.shape)}")
        x = x.to(self.device, torch.bfloat16)
        w, idx = w.to(self.device, torch.float32), idx.to(self.device)
        self._publish(x, w, idx)
        waves = self.waves(n)
        self.last_waves = waves
        dest, spans, tiles, tstart, exp_off = self._maps(waves, mt)
        cur = torch.cuda.current_stream(self.device) if self._cuda else None
        if self._cuda:
            self.pull_stream.wait_stream(cur)
            self.comb_stream.wait_stream(cur)
        ev = {}

        def on(stream):
            return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

        def record(name, w_, stream):
            if self._cuda:
                e = torch.cuda.Event()
                e.record(stream)
                ev[(name, w_)] = e

        def wait(stream, name, w_):
            if self._cuda and (name, w_) in ev:
                stream.wait_event(ev[(name, w_)])

        pairs = self.buf.local("pairs")
        for wi, (e0, e1) in enumerate(waves):
            ne, slot = e1 - e0, wi % self.slots
            rows_bound = min(mt * k, ne * mt)                          # from one source
            tiles_bound = -(-min(self.world * mt * k, ne * self.world * mt) // K.BM) + ne
            base = exp_off[e0:]
            with on(self.pull_stream):
                wait(self.pull_stream, "gemm1", wi - self.slots)        # back-pressure on the ring
                for s in range(self.world):
                    K.move_rows(self.buf.remote(s, "x"), self.ring_x[slot], pairs[s], dest[s], spans[s, wi:],
                                base, k=k, bound_rows=rows_bound, pull=True, srcw=self.buf.remote(s, "w"),
                                dstw=self.ring_w[slot], scales=self.buf.remote(s, "xs") if self.fp8 else None)
                record("pull", wi, self.pull_stream)
            wait(cur, "pull", wi)
            K.swiglu_gemm(self.ring_x[slot], self.ring_w[slot], self.w1, self.w3, self.act[slot],
                          tiles, tstart[e0:], ne, base, ex.limit, tiles_bound)
            record("gemm1", wi, cur)
            wait(cur, "comb", wi - self.slots)                           # output slot free again
            K.down_gemm(self.act[slot], self.w2, self.y[slot], tiles, tstart[e0:], ne, base, tiles_bound)
            record("gemm2", wi, cur)
            with on(self.comb_stream):
                wait(self.comb_stream, "gemm2", wi)
                for s in range(self.world):
                    K.move_rows(self.y[slot], self.buf.remote(s, "comb"), pairs[s], dest[s], spans[s, wi:], base,
                                k=k, bound_rows=rows_bound, pull=False)
                record("comb", wi, self.comb_stream)
        if self._cuda:
            cur.wait_stream(self.comb_stream)
        self.buf.barrier()
        return reduce_pairs(self.buf.local("comb")[: n * k], idx)

    def graphed(self, n: int, *, peer_tokens: int | None = None):
        """One call for ``n`` tokens captured as a CUDA graph (possible because no step of the call
        reads anything back to the host): returns ``run(x, w, idx) -> out`` that copies the inputs
        into static buffers and replays. The returned output tensor is reused by every replay."""
        ex, dev = self.ex, self.device
        sx = torch.randn(n, ex.hidden, device=dev).to(torch.bfloat16)
        sw = torch.full((n, ex.topk), 1.0 / ex.topk, device=dev)
        sidx = (torch.arange(n * ex.topk, device=dev) % ex.n_experts).view(n, ex.topk)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compile, tune and cache before capturing
            for _ in range(2):
                self(sx, sw, sidx, peer_tokens=peer_tokens)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self(sx, sw, sidx, peer_tokens=peer_tokens)

        def run(x, w, idx):
            sx.copy_(x)
            sw.copy_(w)
            sidx.copy_(idx)
            graph.replay()
            return out

        run.graph = graph
        return run

    def close(self) -> None:
        self.buf.close()
