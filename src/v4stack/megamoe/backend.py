"""Expert-parallel backends for the model's expert seam (``V4Model.set_expert_backend``).

``backend(moe, x, weights, indices) -> [T, d]`` (fp32, the routed part; the layer adds the shared
expert). Two transports, one protocol: ``"megamoe"`` (symmetric buffers, pull dispatch) and
``"all_to_all"`` (the baseline). Each rank holds its block of experts.

Under autograd the call is two autograd functions around the model's own expert math:

    rows, weights = Dispatch(x, w)      # forward: pull;  backward: push the row gradients back
    out_rows      = experts(rows)       # the model's swiglu per local expert (plain autograd)
    comb          = Combine(out_rows)   # forward: push;  backward: pull the output gradients
    routed        = ops.moe_combine(comb)

so the backward runs the protocol in reverse, in the same fixed order, and the source adds each
token's row gradients in pair order (expert-major), as the index backward of the single-process
layer's gather does: gradients equal the single-process layer's bitwise. Every rank must take
part in every backward move (they are collectives), as in any data-parallel step.

Without autograd the call is inference: on CUDA with ``megamoe`` the device-side pipeline
(``pipeline.py``); elsewhere the same protocol with FP8 dispatch and a BF16 combine as options.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from v4stack.megamoe import kernels as K
from v4stack.megamoe.baseline import AllToAllTransport
from v4stack.megamoe.experts import LocalExperts, reduce_pairs
from v4stack.megamoe.fp8 import FP8, pack_rows, unpack_rows
from v4stack.megamoe.pull import SymmetricTransport

PATHS = ("megamoe", "all_to_all")


class _Box:
    route = None


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, idx, transport, box):
        route, xe, we = transport.dispatch(x, w, idx)
        box.route = route
        ctx.transport, ctx.route = transport, route
        ctx.x_meta, ctx.w_meta = (x.shape, x.dtype, x.device), (w.shape, w.dtype)
        return xe, we

    @staticmethod
    def backward(ctx, gxe, gwe):
        (shape, dtype, device), (wshape, wdtype) = ctx.x_meta, ctx.w_meta
        r = ctx.route
        if gxe is None:
            gxe = torch.zeros(r.rows, shape[1], dtype=dtype, device=device)
        if gwe is None:
            gwe = torch.zeros(r.rows, dtype=wdtype, device=device)
        gpair, gw = ctx.transport.scatter_pairs(r, gxe.contiguous(), gwe.contiguous())
        # the single-process gather x[order // k] accumulates its row gradients in this order
        gx = torch.zeros(shape, dtype=dtype, device=device)
        gx.index_put_((r.order // r.k,), gpair[r.order].to(dtype), accumulate=True)
        return gx, gw.to(wdtype).view(wshape), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ye, transport, box):
        ctx.transport, ctx.route = transport, box.route
        return transport.combine(box.route, ye)

    @staticmethod
    def backward(ctx, gcomb):
        return ctx.transport.gather_pairs(ctx.route, gcomb.contiguous()), None, None


def make_transport(path: str, *, n_experts: int, topk: int, hidden: int, max_tokens: int, group=None,
                   device="cpu"):
    if path == "megamoe":
        return SymmetricTransport(n_experts=n_experts, topk=topk, hidden=hidden, max_tokens=max_tokens,
                                  group=group, device=device)
    if path == "all_to_all":
        return AllToAllTransport(n_experts=n_experts, topk=topk, hidden=hidden, group=group, device=device)
    raise ValueError(f"path must be one of {PATHS}, got {path!r}")


class ExpertParallel:
    """One MoE layer's routed experts over ``group`` (this rank holds its block of experts)."""

    def __init__(self, moe, transport, *, dispatch_dtype: torch.dtype | None = None,
                 combine_dtype: torch.dtype = torch.float32, pipeline=None, kernels: bool | None = None,
                 experts: LocalExperts | None = None, kernel_dtype: torch.dtype = torch.bfloat16,
                 source_order: bool = False):
        """``source_order``: under autograd run each source rank's rows as their own expert batch and
        add the weight gradients in rank order (``LocalExperts.ffn_by_source``), which is what a
        data-parallel trainer needs to equal one process accumulating its micro-batches; without
        it each expert's rows from all sources are one batch, as in one layer call over all tokens."""
        rank, world = dist.get_rank(transport.group), dist.get_world_size(transport.group)
        self.experts = experts or LocalExperts(moe, rank, world)
        self.transport, self.pipeline = transport, pipeline
        # inference GEMMs: the Triton kernels (the pipeline's own) on CUDA, the model's swiglu elsewhere
        self.kernels = (transport.device.type == "cuda" and K.available()) if kernels is None else kernels
        self.kernel_dtype = kernel_dtype
        self.dispatch_dtype, self.combine_dtype = dispatch_dtype, combine_dtype
        self.source_order = source_order
        self.last_route = None

    def _needs_grad(self, x, w) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or self.experts.w1[0].requires_grad)

    def __call__(self, moe, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if self._needs_grad(x, weights):
            if self.dispatch_dtype not in (None, x.dtype) or self.combine_dtype != torch.float32:
                raise ValueError("lossy dispatch/combine dtypes are for inference; under autograd rows travel "
                                 "in x's dtype and outputs in fp32")
            box = _Box()
            xe, we = _Dispatch.apply(x, weights, indices, self.transport, box)
            if self.source_order:
                ye = self.experts.ffn_by_source(xe, we, box.route.grid)
            else:
                ye = self.experts.ffn(xe, we, box.route.counts)
            comb = _Combine.apply(ye, self.transport, box)
            self.last_route = box.route
            return reduce_pairs(comb, indices)
        with torch.no_grad():
            return self.infer(x, weights, indices)

    @torch.no_grad()
    def infer(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if self.pipeline is not None:
            return self.pipeline(x, weights, indices)
        dd = self.dispatch_dtype or x.dtype
        sent = pack_rows(x) if dd == FP8 else x.to(dd)
        route, xe, we = self.transport.dispatch(sent, weights, indices)
        self.last_route = route
        if dd == FP8:
            xe = unpack_rows(xe, x.shape[1], x.dtype)
        if self.kernels:
            ye = self.grouped_ffn(xe.to(self.kernel_dtype), we.float(), route.counts)
        else:
            ye = self.experts.ffn(xe, we, route.counts).to(self.combine_dtype)
        comb = self.transport.combine(route, ye)
        return reduce_pairs(comb, indices)

    def grouped_ffn(self, xe: torch.Tensor, we: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """All local experts in one grouped SwiGLU GEMM and one grouped down GEMM (the kernels and
        tiles of the MegaMoE pipeline, so both paths give the same bits)."""
        ex, dev = self.experts, xe.device
        w1, w3, w2 = ex.stacked(self.kernel_dtype)
        rows = xe.shape[0]
        per = torch.tensor(counts, dtype=torch.int64).to(dev, non_blocking=True)
        bound = -(-rows // K.BM) + ex.n_local
        tiles, tstart, exp_off = K.tile_map(per, bound)
        act = torch.empty(rows, ex.inner, dtype=self.kernel_dtype, device=dev)
        y = torch.empty(rows, ex.hidden, dtype=self.combine_dtype, device=dev)
        if rows:
            K.swiglu_gemm(xe, we, w1, w3, act, tiles, tstart, ex.n_local, exp_off, ex.limit, bound)
            K.down_gemm(act, w2, y, tiles, tstart, ex.n_local, exp_off, bound)
        return y


def expert_parallel_factory(path: str = "megamoe", *, max_tokens: int = 4096, group=None, device="cpu",
                            pipeline: bool | None = None, pipeline_opts: dict | None = None, **opts):
    """``factory(layer_id, moe) -> backend`` for ``V4Model.set_expert_backend``; all layers share
    one transport (each move is self-contained, see ``pull.py``), built on first use.

    With ``path="megamoe"`` on CUDA (or ``pipeline=True``), inference calls go through the
    device-side pipeline, one set of buffers and streams shared by all layers (``bind``)."""
    shared: dict = {}
    device = torch.device(device)
    use_pipe = (path == "megamoe" and device.type == "cuda" and K.available()) if pipeline is None else pipeline

    def factory(layer_id: int, moe):
        e0 = moe.experts[0]
        key = (moe.n_experts, moe.gate.topk, e0.w1.in_features)
        if key not in shared:
            shared[key] = make_transport(path, n_experts=key[0], topk=key[1], hidden=key[2],
                                         max_tokens=max_tokens, group=group, device=device)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        experts = LocalExperts(moe, rank, world)
        pipe = None
        if use_pipe:
            from v4stack.megamoe.pipeline import DevicePipeline

            if ("pipe",) + key not in shared:
                shared[("pipe",) + key] = DevicePipeline(experts, max_tokens=max_tokens, group=group, device=device,
                                                         **(pipeline_opts or {}))
            pipe = shared[("pipe",) + key].bind(experts)
        return ExpertParallel(moe, shared[key], experts=experts, pipeline=pipe, **opts)

    return factory
