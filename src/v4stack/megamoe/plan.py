"""The overlap budget and the wave planner.

A routed token-expert pair costs ``6 * h * d`` FLOPs (gate, up and down projections of width ``d``
on a hidden size ``h``) and moves ``h * (dispatch_bytes + combine_bytes)`` bytes, so communication
can hide behind compute when the hardware's FLOP-per-byte ratio stays under

    overlap_budget(d) = 6 d / (dispatch_bytes + combine_bytes).

The wave planner follows DeepGEMM's heuristic: a wave is the smallest run of consecutive local
experts whose expected Linear-1 tile count reaches about twice the number of compute units (SMs
on a GPU, cores on a CPU); all experts go in one wave when fewer than one token per expert is
expected; and no wave holds more tiles than the ring buffer can (half the ring, so the next wave
can be fetched while this one computes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def overlap_budget(expert_width: int, dispatch_bytes: float = 1, combine_bytes: float = 2) -> float:
    """FLOPs per byte a routed pair offers: ``6 d / (dispatch_bytes + combine_bytes)``.

    ``overlap_budget(3072) == 6144`` (V4-Pro: FP8 dispatch, BF16 combine).
    """
    if not (isinstance(expert_width, int) and expert_width > 0):
        raise ValueError(f"expert_width must be a positive integer, got {expert_width!r}")
    for name, v in (("dispatch_bytes", dispatch_bytes), ("combine_bytes", combine_bytes)):
        if not v > 0:
            raise ValueError(f"{name} must be > 0 bytes per element, got {v!r}")
    return 6 * expert_width / (dispatch_bytes + combine_bytes)


@dataclass(frozen=True)
class Hardware:
    """What the planner needs to know about one rank's device and its link."""

    peak_flops: float          # dense matmul FLOP/s at the compute dtype
    link_bytes_per_s: float    # per-direction bandwidth to the peers
    compute_units: int         # SMs (GPU) or cores (CPU)
    block_m: int = 128         # rows of one Linear-1 tile

    def validate(self) -> "Hardware":
        for name in ("peak_flops", "link_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Hardware.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("compute_units", "block_m"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"Hardware.{name} must be a positive integer, got {v!r}")
        return self


H200 = Hardware(peak_flops=989e12, link_bytes_per_s=450e9, compute_units=132, block_m=128)


@dataclass(frozen=True)
class WavePlan:
    waves: list[list[int]]      # local expert ids per wave, in walking order
    tiles: list[int]            # Linear-1 tiles per wave (from the histogram given)
    experts_per_wave: int       # the heuristic's choice before the ring cap splits a wave
    flops_per_byte_needed: float  # peak_flops / link bandwidth
    flops_per_byte_offered: float  # overlap_budget(d, dispatch, combine)

    @property
    def comm_hidden(self) -> bool:
        """True when the ideal overlap budget covers the hardware's FLOP/byte ratio."""
        return self.flops_per_byte_offered >= self.flops_per_byte_needed

    def as_dict(self) -> dict:
        return {"waves": self.waves, "tiles": self.tiles, "experts_per_wave": self.experts_per_wave,
                "flops_per_byte_needed": self.flops_per_byte_needed,
                "flops_per_byte_offered": self.flops_per_byte_offered, "comm_hidden": self.comm_hidden}


def experts_per_wave(tokens: int, topk: int, n_experts: int, n_local: int, hw: Hardware) -> int:
    """DeepGEMM's rule on the expected (even) routing: enough experts for ~2x SMs tiles."""
    expected = tokens * topk / n_experts  # expected rows per expert, from all sources
    if expected < 1:
        return n_local
    tiles_per_expert = math.ceil(expected / hw.block_m)
    return max(1, min(n_local, math.ceil(2 * hw.compute_units / tiles_per_expert)))


def plan_waves(
    counts: list[int],
    hw: Hardware,
    *,
    tokens: int,
    topk: int,
    n_experts: int,
    expert_width: int,
    ring_tiles: int,
    dispatch_bytes: float = 2,
    combine_bytes: float = 2,
) -> WavePlan:
    """Group this rank's local experts into waves.

    ``counts[e]`` is the number of rows local expert ``e`` receives (the routing histogram);
    ``tokens`` is the global token count of the layer call. The size comes from the expected
    routing; the ring cap applies to the real counts: a wave never holds more than
    ``ring_tiles // 2`` tiles unless a single expert alone needs more (that expert is then its own
    wave and the puller streams it through the ring in pieces).
    """
    hw.validate()
    if ring_tiles < 2:
        raise ValueError(f"ring_tiles must be >= 2 (double buffering), got {ring_tiles!r}")
    if any(c < 0 for c in counts):
        raise ValueError("counts must be >= 0 rows per expert")
    per_wave = experts_per_wave(tokens, topk, n_experts, len(counts), hw)
    cap = ring_tiles // 2
    waves: list[list[int]] = []
    tiles: list[int] = []
    cur: list[int] = []
    cur_tiles = 0
    for e, c in enumerate(counts):
        t = math.ceil(c / hw.block_m)
        if cur and (len(cur) >= per_wave or cur_tiles + t > cap):
            waves.append(cur)
            tiles.append(cur_tiles)
            cur, cur_tiles = [], 0
        cur.append(e)
        cur_tiles += t
    if cur:
        waves.append(cur)
        tiles.append(cur_tiles)
    return WavePlan(
        waves=waves,
        tiles=tiles,
        experts_per_wave=per_wave,
        flops_per_byte_needed=hw.peak_flops / hw.link_bytes_per_s,
        flops_per_byte_offered=overlap_budget(expert_width, dispatch_bytes, combine_bytes),
    )
