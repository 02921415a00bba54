"""Byte-level batches in a deterministic order that depends only on (seed, step, micro-batch).

A global step consumes ``world * grad_accum`` micro-batches, numbered ``rank * grad_accum + micro``.
Because a batch is a pure function of its numbers, resuming from a checkpoint needs no data-loader
state, and one process with ``grad_accum = k * a`` sees exactly the micro-batches that ``k``
processes with ``grad_accum = a`` see.
"""

from __future__ import annotations

import torch


class ByteBatches:
    def __init__(self, data: bytes, seq_len: int, batch_size: int, seed: int = 0, val_fraction: float = 0.05):
        if seq_len < 4:
            raise ValueError(f"train field 'seq_len' must be >= 4, got {seq_len}")
        if batch_size < 1:
            raise ValueError(f"train field 'batch_size' must be >= 1, got {batch_size}")
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        n_val = max(seq_len + 1, int(len(tokens) * val_fraction))
        if len(tokens) - n_val < 2 * (seq_len + 1):
            raise ValueError(f"train field 'seq_len' ({seq_len}) is too long for {len(tokens)} bytes of text")
        self.train, self.val = tokens[:-n_val], tokens[-n_val:]
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

    def starts(self, step: int, micro: int) -> torch.Tensor:
        """``[batch_size]`` corpus offsets of global micro-batch ``micro`` of ``step``: each
        sequence's identity (its tokens are a function of it)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 4099 + micro)
        hi = len(self.train) - self.seq_len
        return torch.randint(0, hi, (self.batch_size,), generator=g)

    def batch(self, step: int, micro: int) -> torch.Tensor:
        """``[batch_size, seq_len]`` token ids of global micro-batch ``micro`` of ``step``."""
        return self.at(self.starts(step, micro))

    def at(self, starts: torch.Tensor) -> torch.Tensor:
        """The training sequences beginning at ``starts``."""
        return self.train[starts[:, None] + torch.arange(self.seq_len)[None, :]]

    def val_batches(self, n: int) -> list[torch.Tensor]:
        """Fixed, evenly spaced validation windows."""
        hi = len(self.val) - self.seq_len
        starts = torch.linspace(0, hi, n * self.batch_size).long().view(n, self.batch_size)
        return [self.val[s[:, None] + torch.arange(self.seq_len)[None, :]] for s in starts]
