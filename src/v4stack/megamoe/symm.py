"""Symmetric buffers: every rank of a group allocates the same named tensors, and any rank can
read and write any peer's copy.

Two backends with one interface:

- ``ShmSymmetric`` (CPU): each rank maps one file in ``/dev/shm`` and maps every peer's file, so a
  peer's tensor is an ordinary CPU tensor backed by shared memory. The files are unlinked as soon
  as every rank has mapped them, so nothing is left behind when a process dies. Ordering: a writer
  finishes its stores before it enters ``barrier()`` (a collective on the group's gloo sockets), so
  whatever was written before the barrier is visible after it.
- ``CudaSymmetric`` (GPU): ``torch.distributed._symmetric_memory``; a peer's tensor is a CUDA
  tensor mapping that GPU's memory (readable by torch ops, Triton and TileLang kernels).

A layout is a dict ``name -> (shape, dtype)``; all ranks must pass the same layout.
"""

from __future__ import annotations

import math
import os
import secrets
import tempfile
from typing import Mapping

import torch
import torch.distributed as dist

Layout = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
_ALIGN = 256


def _offsets(layout: Layout) -> tuple[dict[str, int], int]:
    offsets, total = {}, 0
    for name, (shape, dtype) in layout.items():
        if any((not isinstance(s, int)) or s < 0 for s in shape):
            raise ValueError(f"buffer {name!r}: shape must be non-negative integers, got {shape!r}")
        offsets[name] = total
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        total += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, max(total, _ALIGN)


class SymmetricBuffer:
    """Base: named views into one byte segment per rank."""

    def __init__(self, layout: Layout, group=None):
        self.layout = dict(layout)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.offsets, self.nbytes = _offsets(self.layout)
        self._segments: list[torch.Tensor] = []  # uint8 [nbytes] per rank
        self._views: list[dict[str, torch.Tensor]] = []

    def _make_views(self) -> None:
        for seg in self._segments:
            views = {}
            for name, (shape, dtype) in self.layout.items():
                off = self.offsets[name]
                n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                views[name] = seg[off : off + n].view(dtype).view(shape)
            self._views.append(views)

    def local(self, name: str) -> torch.Tensor:
        return self._views[self.rank][name]

    def remote(self, rank: int, name: str) -> torch.Tensor:
        """Rank ``rank``'s copy of ``name`` (the local one when ``rank`` is this rank)."""
        return self._views[rank][name]

    def barrier(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._views.clear()
        self._segments.clear()


class ShmSymmetric(SymmetricBuffer):
    """CPU backend: one shared-memory file per rank, mapped by every rank of the (one-host) group."""

    def __init__(self, layout: Layout, group=None, root: str | None = None):
        super().__init__(layout, group)
        root = root or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        tag = [secrets.token_hex(8) if self.rank == 0 else None]
        dist.broadcast_object_list(tag, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        paths = [os.path.join(root, f"v4stack-megamoe-{tag[0]}-{r}") for r in range(self.world)]
        fd = os.open(paths[self.rank], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
        finally:
            os.close(fd)
        try:
            dist.barrier(group=group)
            for r in range(self.world):
                self._segments.append(torch.from_file(paths[r], shared=True, size=self.nbytes,
                                                      dtype=torch.uint8))
            dist.barrier(group=group)
        finally:
            os.unlink(paths[self.rank])
        dist.barrier(group=group)  # every file unlinked: nothing outlives the mappings
        self._make_views()

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class CudaSymmetric(SymmetricBuffer):
    """GPU backend: ``torch.distributed._symmetric_memory`` (one CUDA device per rank)."""

    def __init__(self, layout: Layout, group=None, device: torch.device | None = None):
        super().__init__(layout, group)
        from torch.distributed import _symmetric_memory as symm_mem  # GPU only; optional at import

        device = device or torch.device("cuda", torch.cuda.current_device())
        g = group if group is not None else dist.group.WORLD
        if hasattr(symm_mem, "is_symm_mem_enabled_for_group") and not symm_mem.is_symm_mem_enabled_for_group(g.group_name):
            symm_mem.enable_symm_mem_for_group(g.group_name)
        local = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=device)
        self._handle = symm_mem.rendezvous(local, g.group_name)
        for r in range(self.world):
            seg = local if r == self.rank else self._handle.get_buffer(r, (self.nbytes,), torch.uint8, 0)
            self._segments.append(seg)
        self._make_views()

    def barrier(self) -> None:
        self._handle.barrier()


def symmetric_buffer(layout: Layout, group=None, device: torch.device | str = "cpu") -> SymmetricBuffer:
    """The backend that fits ``device``: shared memory for CPU, symmetric memory for CUDA."""
    device = torch.device(device)
    if device.type == "cpu":
        return ShmSymmetric(layout, group)
    if device.type == "cuda":
        return CudaSymmetric(layout, group, device)
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device.type!r}")
