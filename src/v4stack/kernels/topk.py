"""Stable top-k without a full sort: each value is packed with its position into one int64 key
(order-preserving float bits above, ``N - 1 - index`` below), so keys are distinct and
``torch.topk`` on them has exactly one answer - the stable descending sort's first ``k``
(largest values, ties to the lower index). An exact selection, so batch-invariant on any device.
``-0.0`` is keyed as ``+0.0`` (they tie in the sort); NaNs are outside the contract.
"""

import torch


def stable_topk(x: torch.Tensor, k: int, stable: bool = True):
    N = x.shape[-1]
    v = x.float() + 0.0  # -0.0 -> +0.0; bf16 / fp16 widen exactly
    bits = v.view(torch.int32).to(torch.int64)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # float order == signed integer order
    pos = torch.arange(N - 1, -1, -1, device=x.device, dtype=torch.int64)
    packed = (key << 32) | pos
    idx = (N - 1) - (packed.topk(k, dim=-1).values & 0xFFFFFFFF)
    return x.gather(-1, idx), idx
