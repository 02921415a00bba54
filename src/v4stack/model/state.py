"""Per-request decode state, named after the four kinds of serving state (spec/cache.md).

- ``swa_kv``: the SWA KV window, a ring of ``n_win`` rows indexed by ``position % n_win``;
- ``tail`` / ``index_tail``: the uncompressed tail of a compressor (projected kv and gate scores
  of the open block, and for an overlapped CSA compressor the previous block's too), a ring of
  ``coff * m`` rows indexed by ``position % (coff * m)``;
- ``compressed_kv``: closed CSA / HCA entries, one per ``m`` tokens, the whole history;
- ``index_keys``: lightning-indexer keys, aligned with the CSA entries.

The first two are fixed-size (the serving "state cache"); the last two grow by one row per closed
block (the paged "block cache"). Everything is a plain tensor so a cache manager can page it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from v4stack.config import ModelConfig
from v4stack.model.linear import compute_dtype


@dataclass
class CompressorTail:
    kv: torch.Tensor  # [coff * m, coff * width], compute dtype
    score: torch.Tensor  # [coff * m, coff * width], compute dtype

    @property
    def rows(self) -> int:
        return self.kv.shape[0]

    def read(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for positions ``[start, stop)`` in position order."""
        idx = torch.arange(start, stop, device=self.kv.device) % self.rows
        return self.kv[idx], self.score[idx]

    def write(self, start: int, kv: torch.Tensor, score: torch.Tensor) -> None:
        """Store rows for positions ``[start, start + len(kv))`` (only the last ``rows`` matter)."""
        n = kv.shape[0]
        keep = min(n, self.rows)
        idx = torch.arange(start + n - keep, start + n, device=self.kv.device) % self.rows
        self.kv[idx] = kv[n - keep :].to(self.kv.dtype)
        self.score[idx] = score[n - keep :].to(self.score.dtype)


@dataclass
class LayerState:
    swa_kv: torch.Tensor  # [n_win, head_dim]
    tail: CompressorTail | None = None
    compressed_kv: torch.Tensor | None = None  # [n_closed, head_dim]
    index_tail: CompressorTail | None = None
    index_keys: torch.Tensor | None = None  # [n_closed, index_head_dim]
    # boundary capture: positions P (inside the next step) whose fixed-size state to record, and
    # what was recorded: P -> a LayerState holding the window and tails as of position P
    capture_at: tuple[int, ...] = ()
    captured: dict = field(default_factory=dict)

    def blank(self) -> "LayerState":
        """A zeroed state of the same fixed-size layout (no compressed parts)."""
        def tail(t):
            if t is None:
                return None
            return CompressorTail(kv=torch.zeros_like(t.kv), score=torch.full_like(t.score, float("-inf")))
        return LayerState(swa_kv=torch.zeros_like(self.swa_kv), tail=tail(self.tail), index_tail=tail(self.index_tail))

    def read_window(self, start: int, stop: int) -> torch.Tensor:
        idx = torch.arange(start, stop, device=self.swa_kv.device) % self.swa_kv.shape[0]
        return self.swa_kv[idx]

    def write_window(self, start: int, kv: torch.Tensor) -> None:
        n, w = kv.shape[0], self.swa_kv.shape[0]
        keep = min(n, w)
        idx = torch.arange(start + n - keep, start + n, device=self.swa_kv.device) % w
        self.swa_kv[idx] = kv[n - keep :].to(self.swa_kv.dtype)


@dataclass
class RequestState:
    """Everything the incremental path needs to continue a sequence after ``pos`` tokens."""

    pos: int = 0
    layers: list[LayerState] = field(default_factory=list)

    def nbytes(self) -> dict[str, int]:
        out = {"swa_kv": 0, "compressor_tail": 0, "compressed_kv": 0, "index_keys": 0}
        for ls in self.layers:
            out["swa_kv"] += ls.swa_kv.numel() * ls.swa_kv.element_size()
            for t in (ls.tail, ls.index_tail):
                if t is not None:
                    out["compressor_tail"] += 2 * t.kv.numel() * t.kv.element_size()
            if ls.compressed_kv is not None:
                out["compressed_kv"] += ls.compressed_kv.numel() * ls.compressed_kv.element_size()
            if ls.index_keys is not None:
                out["index_keys"] += ls.index_keys.numel() * ls.index_keys.element_size()
        return out


def _tail(ratio: int, overlap: bool, width: int, dtype, device) -> CompressorTail:
    coff = 2 if overlap else 1
    rows = coff * ratio
    return CompressorTail(
        kv=torch.zeros(rows, coff * width, dtype=dtype, device=device),
        score=torch.full((rows, coff * width), float("-inf"), dtype=dtype, device=device),
    )


def new_request_state(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu") -> RequestState:
    """An empty state for the main layers of ``cfg`` (position 0)."""
    cd = compute_dtype(dtype)
    layers = []
    for ratio in cfg.layer_ratios:
        ls = LayerState(swa_kv=torch.zeros(cfg.sliding_window, cfg.head_dim, dtype=dtype, device=device))
        if ratio:
            csa = cfg.is_csa(ratio)
            ls.tail = _tail(ratio, csa, cfg.head_dim, cd, device)
            ls.compressed_kv = torch.zeros(0, cfg.head_dim, dtype=dtype, device=device)
            if csa:
                ls.index_tail = _tail(ratio, True, cfg.index_head_dim, cd, device)
                ls.index_keys = torch.zeros(0, cfg.index_head_dim, dtype=dtype, device=device)
        layers.append(ls)
    return RequestState(pos=0, layers=layers)
