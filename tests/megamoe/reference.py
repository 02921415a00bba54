"""The single-process routed layer, written here from the model's own pieces (``Expert`` modules
and ``ops.moe_combine``), independent of the expert-parallel code: gather each pair's row in
(expert, pair) order, run each expert's module on its rows, put the outputs back at their pairs,
reduce per token."""

import torch

from v4stack import ops


def single_process_routed(moe, x, w, idx, *, combine_dtype=torch.float32):
    n, k = idx.shape
    order = torch.sort(idx.reshape(-1), stable=True).indices
    xs, ws = x[order // k], w.reshape(-1)[order]
    counts = torch.bincount(idx.reshape(-1), minlength=moe.n_experts).tolist()
    outs, lo = [], 0
    for e, c in enumerate(counts):
        if c:
            outs.append(moe.experts[e](xs[lo : lo + c], ws[lo : lo + c]))
        lo += c
    ys = torch.cat(outs).to(combine_dtype)
    y = torch.zeros(n * k, x.shape[1], dtype=ys.dtype, device=ys.device)
    y = y.index_put((order,), ys)
    return ops.moe_combine(y.view(n, k, -1), idx)
