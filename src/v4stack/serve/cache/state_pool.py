"""Fixed-size state slots: SWA window and compressor tails of every layer, one slot per request.

The same pool type stores boundary snapshots (the state at a block's end) for prefix reuse.
A slot's tensors are views into the pool, so the model writes the pool in place.
"""

from __future__ import annotations

import torch

from v4stack.model.state import CompressorTail, LayerState, RequestState
from v4stack.serve.cache.spec import CacheSpec


class StatePool:
    def __init__(self, spec: CacheSpec, n_layers: int, n_slots: int, device="cpu"):
        self.spec, self.n_layers, self.n_slots = spec, n_layers, n_slots
        self.scratch = n_slots  # one extra slot never handed out: the padding rows of a static step
        self.tensors: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
        for g in spec.state:
            n = n_slots + 1
            if g.kind == "swa_kv":
                self.tensors[(g.kind, g.layer)] = (torch.zeros(n, g.rows, g.width, dtype=g.dtype, device=device),)
            else:
                kv = torch.zeros(n, g.rows, g.width, dtype=g.dtype, device=device)
                score = torch.full((n, g.rows, g.width), float("-inf"), dtype=g.dtype, device=device)
                self.tensors[(g.kind, g.layer)] = (kv, score)
        self.free = list(range(n_slots - 1, -1, -1))

    @property
    def n_free(self) -> int:
        return len(self.free)

    def acquire(self) -> int | None:
        return self.free.pop() if self.free else None

    def release(self, slot: int) -> None:
        if slot in self.free:
            raise RuntimeError(f"state slot {slot} released twice")
        self.reset(slot)
        self.free.append(slot)

    def reset(self, slot: int) -> None:
        for key, ts in self.tensors.items():
            ts[0][slot].zero_()
            if len(ts) == 2:
                ts[1][slot].fill_(float("-inf"))

    def copy(self, src: "StatePool", src_slot: int, dst_slot: int) -> None:
        for key, ts in self.tensors.items():
            for d, s in zip(ts, src.tensors[key]):
                d[dst_slot].copy_(s[src_slot])

    def store(self, slot: int, layers: list[LayerState]) -> None:
        """Write per-layer fixed-size states (window, tails) into ``slot``."""
        for i, ls in enumerate(layers):
            self.tensors[("swa_kv", i)][0][slot].copy_(ls.swa_kv)
            for kind, t in (("compressor_tail", ls.tail), ("index_tail", ls.index_tail)):
                if t is not None:
                    dst = self.tensors[(kind, i)]
                    dst[0][slot].copy_(t.kv)
                    dst[1][slot].copy_(t.score)

    def view(self, slot: int, pos: int) -> RequestState:
        """A ``RequestState`` whose window and tails are views of ``slot`` (compressed parts unset)."""
        layers = []
        for i in range(self.n_layers):
            ls = LayerState(swa_kv=self.tensors[("swa_kv", i)][0][slot])
            t = self.tensors.get(("compressor_tail", i))
            if t is not None:
                ls.tail = CompressorTail(kv=t[0][slot], score=t[1][slot])
            t = self.tensors.get(("index_tail", i))
            if t is not None:
                ls.index_tail = CompressorTail(kv=t[0][slot], score=t[1][slot])
            layers.append(ls)
        return RequestState(pos=pos, layers=layers)
