"""Sample-ordered gradients: a step's parameter gradients independent of the order of its sequences.

A parameter's gradient is a sum over the step's sequences. The plain path adds them in the order
the batch holds them (inside each weight-gradient GEMM, then micro-batch by micro-batch), so
the same sequences in another order - a shuffled batch, a length-balanced regrouping, another
``batch_size`` x ``grad_accum`` split - give other bits. Here each sequence's contribution is
its own forward and backward (batch 1: what it computes never sees another sequence), and the
contributions are added into ``.grad`` one after another in the order of the sequences' *keys*
(their identity - the corpus offset in the trainer - not their batch position):

    grad = ((g[k1] + g[k2]) + g[k3]) + ...      k1 <= k2 <= ... the step's keys, sorted

so the bits depend only on the set of (key, sequence) pairs a replica trains in the step. Two
entries with one key must hold the same tokens (then their contributions are the same bits and
their order changes nothing); a key shared by different tokens is refused.

The ops mode does not matter for this property (a batch-1 backward sees one sequence whatever
the mode); the run-to-run determinism of the backward itself is ``bench/grad_determinism.py``'s.
Across data-parallel replicas the sum still follows the rank order: which replica trains a
sequence is part of the layout, as ``dp`` is.

Cost: no extra memory (the gradients accumulate in place), one forward and backward per
sequence instead of one per micro-batch - free where a micro-batch is one long sequence anyway,
slower for many short ones (``bench/grad_determinism.py`` times both on the GPU).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

LossFn = Callable[[object, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]]


def canonical_order(micro: Sequence[torch.Tensor], keys: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """``(micro-batch, row)`` of every sequence, sorted by key (ties: rows holding the same tokens)."""
    if len(micro) != len(keys):
        raise ValueError(f"sample keys: {len(keys)} key lists for {len(micro)} micro-batches")
    items = []
    for m, (tokens, ks) in enumerate(zip(micro, keys)):
        ks = [int(k) for k in ks]
        if len(ks) != tokens.shape[0]:
            raise ValueError(f"sample keys: micro-batch {m} has {tokens.shape[0]} sequences and {len(ks)} keys")
        items += [(k, m, r) for r, k in enumerate(ks)]
    items.sort(key=lambda t: t[0])
    for (k0, m0, r0), (k1, m1, r1) in zip(items, items[1:]):
        if k0 == k1 and not torch.equal(micro[m0][r0], micro[m1][r1]):
            raise ValueError(f"sample key {k0} names two different sequences (micro-batch {m0} row {r0}, "
                             f"micro-batch {m1} row {r1}): a key must identify its tokens")
    return [(m, r) for _, m, r in items]


def sample_accumulate(model, micro: Sequence[torch.Tensor], keys: Sequence[Sequence[int]], weight: float,
                      losses: LossFn, mtp_weight: float = 0.0) -> torch.Tensor:
    """Backward of ``weight`` x each sequence's mean loss, one sequence at a time in key order
    (``weight`` = 1 / the step's sequences over all replicas: the plain path's objective, and the
    same number for every ``batch_size`` x ``grad_accum`` split). Returns ``[main, mtp]`` summed
    over the micro-batches' means (as the trainer logs them)."""
    sums = torch.zeros(2, dtype=torch.float32, device=micro[0].device)
    for m, r in canonical_order(micro, keys):
        tokens = micro[m][r:r + 1]
        main, extra = losses(model, tokens, mtp_weight > 0)
        total = main if extra is None else main + mtp_weight * extra
        (total * weight).backward()
        sums[0] += main.detach().float() / micro[m].shape[0]
        if extra is not None:
            sums[1] += extra.detach().float() / micro[m].shape[0]
    return sums
