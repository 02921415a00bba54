"""Cache groups described as data.

A block covers ``block_tokens`` token positions (a multiple of lcm(m, m')); each group says what
one block (or one state slot) of it holds for one layer. The block pool, the state pool and the
byte accounting all read these specs; nothing else hard-codes a layout.

Groups:
- ``compressed_kv`` (per CSA / HCA layer): ``block_tokens / ratio`` closed entries of width c;
- ``index_keys`` (per CSA layer): ``block_tokens / m`` indexer keys of width d_I - in the cache
  dtype, or with ``index_fp8`` as V4's packed e4m3 rows of ``fp8_keys.width(d_I)`` bytes (144 at
  V4's width; ``ops/fp8_keys.py``, exact for keys under V4's activation rounding);
- ``swa_kv`` (per layer, state): the window, ``n_win`` rows;
- ``compressor_tail`` / ``index_tail`` (per compressed layer, state): ``coff * ratio`` rows of kv
  and gate scores, fp32.
Prefix reuse needs every block of the prefix from the paged groups, and only the state at the
boundary from the state groups (kept per block as a boundary snapshot, its own evictable pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v4stack.config import ModelConfig
from v4stack.ops import fp8_keys


@dataclass(frozen=True)
class GroupSpec:
    kind: str  # compressed_kv | index_keys | swa_kv | compressor_tail | index_tail
    layer: int
    ratio: int  # 0 for swa_kv
    rows: int  # rows per block (paged) or per slot (state)
    width: int
    dtype: torch.dtype
    paged: bool

    @property
    def bytes(self) -> int:
        per = torch.empty((), dtype=self.dtype).element_size()
        tails = 2 if self.kind.endswith("tail") else 1  # kv + score
        return self.rows * self.width * per * tails


@dataclass(frozen=True)
class CacheSpec:
    block_tokens: int
    groups: tuple[GroupSpec, ...]

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype: torch.dtype, block_multiple: int = 1,
                    index_fp8: bool = False) -> "CacheSpec":
        B = cfg.block_tokens * block_multiple
        dI = cfg.index_head_dim
        keys = (fp8_keys.width(dI), torch.uint8) if index_fp8 else (dI, dtype)
        cd = torch.float64 if dtype == torch.float64 else torch.float32
        groups = []
        for i, r in enumerate(cfg.layer_ratios):
            groups.append(GroupSpec("swa_kv", i, 0, cfg.sliding_window, cfg.head_dim, dtype, False))
            if not r:
                continue
            csa = cfg.is_csa(r)
            coff = 2 if csa else 1
            groups.append(GroupSpec("compressed_kv", i, r, B // r, cfg.head_dim, dtype, True))
            groups.append(GroupSpec("compressor_tail", i, r, coff * r, coff * cfg.head_dim, cd, False))
            if csa:
                groups.append(GroupSpec("index_keys", i, r, B // r, *keys, True))
                groups.append(GroupSpec("index_tail", i, r, 2 * r, 2 * cfg.index_head_dim, cd, False))
        return cls(B, tuple(groups))

    @property
    def paged(self) -> list[GroupSpec]:
        return [g for g in self.groups if g.paged]

    @property
    def state(self) -> list[GroupSpec]:
        return [g for g in self.groups if not g.paged]

    def block_bytes(self) -> int:
        return sum(g.bytes for g in self.paged)

    def slot_bytes(self) -> int:
        return sum(g.bytes for g in self.state)

    def bytes_per_token(self) -> dict[str, float]:
        """Block-cache growth per token, by kind (state groups are per request, not per token)."""
        out: dict[str, float] = {}
        for g in self.paged:
            out[g.kind] = out.get(g.kind, 0.0) + g.bytes / self.block_tokens
        return out
