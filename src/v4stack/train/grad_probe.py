"""Per-sequence activation gradients, the probe behind the deterministic-backward checks.

The loss is the sum of each sequence's mean next-token loss, so a sequence's rows receive exactly its
own loss's gradient whatever else is in the batch; the probed tensors are the embedding output and
every block's output streams. ``tests/train/test_determinism.py`` (CPU, tiny) and
``bench/grad_determinism.py`` (Flash-width slices on the GPU) compare what it returns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activation_grads(model, batch: torch.Tensor):
    """(per-sequence activation gradients ``[B, T, ...]`` per probed tensor, parameter gradients by name)."""
    acts = []

    def keep(_mod, _inp, out):
        out.retain_grad()
        acts.append(out)

    hooks = [model.embed.register_forward_hook(keep)] + [b.register_forward_hook(keep) for b in model.layers]
    model.zero_grad(set_to_none=True)
    try:
        logits = model(batch)
        V = logits.shape[-1]
        per = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), batch[:, 1:].reshape(-1), reduction="none")
        per.view(batch.shape[0], -1).mean(1).sum().backward()
    finally:
        for h in hooks:
            h.remove()
    B, T = batch.shape
    return ([a.grad.view(B, T, *a.shape[1:]).clone() for a in acts],
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
