"""The single-process routed layer the expert-parallel backends must equal, written here in plain
torch from the layer's definition (``model/moe.py``): every expert on one process; the (token,
slot) pairs sorted by (expert, pair id); per expert ``w2((silu(min(w1 x, limit)) * clamp(w3 x,
-limit, limit)) * weight)`` with the products in the weight dtype and the activation in fp32; the
pair outputs put back at their pair ids and summed over the slots in fp32.

Nothing here comes from ``megamoe`` nor from the model's backends (``LocalGrouped``), so the
exactness tests check the expert maths and not only the transport; ``test_exact`` also checks
that this layer equals the model's own ``LocalGrouped`` bit for bit.

The operations are the ones whose bits the layer fixes: one GEMM per expert over that expert's
rows, pointwise functions over all rows at once (torch's CPU kernels may round a tensor's tail
differently), the gather ``x[order // k]`` whose backward adds each token's row gradients in pair
order.
"""

import torch
import torch.nn.functional as F


def single_process_routed(moe, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    T, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    ids = flat[order].tolist()
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    w1 = [e.w1.weight for e in moe.experts]
    wdt = w1[0].dtype
    rows = x[order // k].to(wdt)
    bounds = [0]
    for e in range(len(moe.experts)):
        bounds.append(bounds[-1] + ids.count(e))

    def per_expert(inp, name):
        outs = [F.linear(inp[a:b], getattr(moe.experts[e], name).weight)
                for e, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]
        return torch.cat(outs) if outs else inp.new_zeros(0, getattr(moe.experts[0], name).weight.shape[0])

    gate, up = per_expert(rows, "w1").to(cd), per_expert(rows, "w3").to(cd)
    if moe.limit > 0:
        gate = gate.clamp(max=moe.limit)
        up = up.clamp(-moe.limit, moe.limit)
    act = F.silu(gate) * up * w.reshape(-1)[order].to(cd).unsqueeze(-1)
    out = per_expert(act.to(wdt), "w2").to(cd)
    y = torch.empty(T * k, x.shape[1], dtype=cd, device=x.device)
    y[order] = out
    return y.view(T, k, x.shape[1]).sum(1)
