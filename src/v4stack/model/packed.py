"""Linears that read the same rows, packed into one weight: a serving step runs them as one GEMM.

An attention layer projects its input ``x`` several times: ``wq_a`` and ``wkv``, and where the
layer compresses, the compressor's ``wkv`` / ``wgate`` and the indexer compressor's. At decode
widths each of these is a skinny GEMM that reads its weight at a fraction of the copy rate and
costs a launch; one GEMM over the stacked weight ``[sum N, K]`` reads the same bytes in one pass.

``pack(owner, linears)`` copies the weights into one buffer and points each Parameter's data at
its row slice (the Parameter objects stay the same, so an optimiser holding them updates the
buffer in place; no memory is added). ``run(owner, linears, x)`` gives the outputs as column
views of one ``ops.linear`` call, or None where the packing no longer holds: a weight replaced
(assigned, moved, cast), quantised, or the layer never packed. The caller then runs the linears
one by one, so a stale packing costs speed, never a wrong result.

Bits: in invariant mode an output element's K chain is a function of K alone (``ops``' fixed
slices), so the packed GEMM gives the very bits of the separate ones; fast mode's library GEMM may
block a wider N differently.
"""

from __future__ import annotations

import torch

from v4stack import ops

_ATTR = "_packed_weight"


def _plain(linears) -> bool:
    w0 = linears[0].weight
    return len(linears) > 1 and all(
        lin.qweight is None and lin.weight.dim() == 2 and lin.weight.shape[1] == w0.shape[1]
        and lin.weight.dtype == w0.dtype and lin.weight.device == w0.device for lin in linears)


def _holds(buf: torch.Tensor, linears) -> bool:
    """Whether every linear's weight is still its row slice of ``buf``, in order."""
    K, es, row = buf.shape[1], buf.element_size(), 0
    for lin in linears:
        w = lin.weight
        if (lin.qweight is not None or w.dtype != buf.dtype or w.device != buf.device or w.dim() != 2
                or w.shape[1] != K or not w.is_contiguous() or w.data_ptr() != buf.data_ptr() + row * K * es):
            return False
        row += w.shape[0]
    return row == buf.shape[0]


def joined(owner, linears) -> torch.Tensor | None:
    """The packed ``[sum N, K]`` weight if every linear's weight is still its row slice, else None
    (and a stale buffer is dropped)."""
    buf = getattr(owner, _ATTR, None)
    if buf is not None and not _holds(buf, linears):
        setattr(owner, _ATTR, None)
        buf = None
    return buf


def pack(owner, linears) -> bool:
    """Pack ``linears`` (same K, dtype, device, none quantised) into one buffer held by ``owner``;
    False where they cannot be packed. Packing an already packed set is a no-op."""
    if joined(owner, linears) is not None:
        return True
    if not _plain(linears):
        return False
    ws = [lin.weight for lin in linears]
    with torch.no_grad():
        buf = torch.cat([w.detach() for w in ws])
        row = 0
        for w in ws:
            n = w.shape[0]
            w.data = buf[row:row + n]
            row += n
    setattr(owner, _ATTR, buf)
    return True


def run(owner, linears, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """``(lin(x) for lin in linears)`` as column views of one GEMM, or None (see the module)."""
    if torch.is_grad_enabled() and any(lin.weight.requires_grad for lin in linears):
        return None  # the buffer is not the Parameters autograd would differentiate
    buf = joined(owner, linears)
    if buf is None:
        return None
    return ops.linear(x, buf).split([lin.weight.shape[0] for lin in linears], dim=-1)
