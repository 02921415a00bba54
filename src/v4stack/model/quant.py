"""Quantised checkpoints on the model side: which weights are stored in which format, and the
activation rounding V4 was trained with (quantisation-aware), as the official inference applies it.

Activation rounding (``set_act_rounding(model, True)``; on by default for quantised checkpoints):

- window KV: after ``kv_norm`` and RoPE, the non-RoPE dims of every KV row are rounded to FP8 e4m3
  in blocks of 64 with a power-of-two scale per block (``2^ceil(log2(amax / 448))``); the RoPE
  dims stay as they are;
- compressed KV entries (CSA and HCA compressors): the same FP8 rounding, after the entry's
  RMSNorm and RoPE;
- lightning indexer: queries (after RoPE) and keys (the indexer compressor's entries, after RMSNorm
  and RoPE) pass an orthonormal Hadamard rotation ``H / sqrt(d)`` and are then rounded to FP4 e2m1
  in blocks of 32 with power-of-two scales (``2^ceil(log2(amax / 6))``). The rotation alone leaves
  every score ``q . k`` unchanged; it spreads outliers before the coarse FP4 grid.

A block narrower than the nominal width (a tiny config's last block) is rounded as one block.
The indexer's top-k breaks ties towards the earlier entry (deterministic), rounding on or off.

Weights in memory (``keep_quantized``): a loaded quantised layer holds its ``QuantizedWeight`` and
a dense dequantised copy. Where ``ops.linear`` has an implementation for the stored format on the
weight's device that reads it directly (a GPU kernel), the dense copy is dropped.
"""

from __future__ import annotations

import re

import torch

from v4stack.ops import fused
from v4stack.ops.quantized import (
    FormatError,
    QuantizedWeight,
    fp4_round,  # noqa: F401  (the roundings' compositions, re-exported where they were defined)
    fp8_round,  # noqa: F401
    quantize_fp4,
    quantize_fp8,
)

KV_BLOCK = 64
INDEX_BLOCK = 32

# the released checkpoints' weight formats, by tensor name
_FP4 = re.compile(r"(^|\.)ffn\.experts\.\d+\.w[123]\.weight$")
_FP8 = re.compile(r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123]|e_proj|h_proj)\.weight$")


def released_format(name: str) -> str | None:
    """``fp4`` for routed experts, ``fp8`` for the dense projections (attention, shared expert,
    MTP input projections), None for tensors stored dense (embedding, head, norms, gate,
    compressors, indexer, mHC, sinks)."""
    if _FP4.search(name):
        return "fp4"
    if _FP8.search(name):
        return "fp8"
    return None


def quantize_weight(name: str, w: torch.Tensor) -> QuantizedWeight | None:
    """Quantise one dense weight into its released format (None if it is stored dense)."""
    fmt = released_format(name)
    if fmt is None:
        return None
    data, scale = quantize_fp8(w) if fmt == "fp8" else quantize_fp4(w)
    return QuantizedWeight(fmt, data, scale)


# ---- activation rounding ---------------------------------------------------------------------


_HADAMARD: dict = {}


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard rotation ``x @ H / sqrt(d)`` over the last dim (d a power of 2)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two width, got {d}")
    key = (d, x.dtype, str(x.device))
    if key not in _HADAMARD:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        _HADAMARD[key] = (h * d ** -0.5).to(device=x.device, dtype=x.dtype)
    return x @ _HADAMARD[key]


class KVRounding:
    """FP8 rounding of the non-RoPE dims of KV rows (window rows and compressed entries)."""

    def __init__(self, rope_dims: int, block: int = KV_BLOCK):
        self.rope_dims, self.block = rope_dims, block

    def __call__(self, kv: torch.Tensor) -> torch.Tensor:
        return fused.kv_round(kv, self.rope_dims, self.block)  # one kernel on CUDA


class IndexRounding:
    """Hadamard rotation, then FP4 rounding (indexer queries and keys)."""

    def __init__(self, block: int = INDEX_BLOCK):
        self.block = block

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fused.fp4_round(hadamard(x), self.block)  # one kernel on CUDA


def set_act_rounding(model: torch.nn.Module, on: bool = True) -> torch.nn.Module:
    """Install (or remove) the official activation rounding on every attention layer of
    ``model`` (main stack and MTP). The hooks are the ``kv_rounding`` / ``rounding`` /
    ``q_rounding`` attributes of attention, compressor and indexer."""
    from v4stack.model.attention import Attention

    for mod in model.modules():
        if not isinstance(mod, Attention):
            continue
        kv = KVRounding(model.cfg.qk_rope_head_dim) if on else None
        mod.kv_rounding = kv
        if mod.compressor is not None:
            mod.compressor.rounding = kv
        if mod.indexer is not None:
            idx = IndexRounding() if on else None
            mod.indexer.q_rounding = idx
            mod.indexer.compressor.rounding = idx
    model.act_rounding = on
    return model


def grouped_weight(linear, groups: int, rank: int):
    """``wo_a``'s per-group weights: the dense weight viewed ``[g, rank, K]``, or - once its dense
    copy was dropped (``keep_quantized``) - row slices of the stored weight, made once."""
    if linear.qweight is None or linear.weight.numel():
        return linear.weight.view(groups, rank, -1)
    got = getattr(linear, "_qgroups", None)
    if got is None:
        got = linear._qgroups = [linear.qweight.rows(i * rank, (i + 1) * rank) for i in range(groups)]
    return got


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct storage the model holds: parameters, buffers, stored quantised
    weights and their scales, and dense copies cached on them."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device.type)
        if t.numel() and key not in seen:
            seen.add(key)
            total += st.nbytes()

    for t in list(model.parameters()) + list(model.buffers()):
        add(t)
    for mod in model.modules():
        qw = getattr(mod, "qweight", None)
        if qw is not None:
            for t in (qw.data, qw.scale, *qw._dense.values()):
                add(t)
    return total


def keep_quantized(model: torch.nn.Module) -> dict:
    """Drop the dense copy of every quantised layer whose matmul an implementation serves from the
    stored format (``ops.linear`` resolved for the model's activation dtype on the weight's device
    is not the dequantise-and-cache fallback). Only layers read through ``ops.linear`` qualify -
    the attention projections, ``wo_a`` (its groups become row slices) and the MTP projections;
    shared and routed experts keep their dense copies (their SwiGLU and the grouped expert backend
    read dense weights). Returns the layers dropped and the resident bytes before and after."""
    from torch import nn

    from v4stack.ops import dispatch
    from v4stack.ops.mode import get_mode

    before = resident_bytes(model)
    act = model.embed.weight.dtype if hasattr(model, "embed") else torch.bfloat16
    dropped = []
    for name, mod in model.named_modules():
        qw = getattr(mod, "qweight", None)
        if qw is None or "experts" in name or not mod.weight.numel():
            continue
        x = torch.empty(1, qw.shape[1], dtype=act, device=qw.device)
        if dispatch.resolve("linear", get_mode(), qw.fmt, qw.device.type, x, qw).name == "dequantize_cached":
            continue
        if name.endswith("attn.wo_a"):  # its groups must be whole scale blocks of rows
            attn = model.get_submodule(name[: -len(".wo_a")])
            try:
                mod._qgroups = [qw.rows(i * attn.group_rank, (i + 1) * attn.group_rank) for i in range(attn.groups)]
            except FormatError:
                continue
        mod.weight = nn.Parameter(mod.weight.data.new_empty(0), requires_grad=False)
        qw._dense.clear()
        dropped.append(name)
    return {"dropped": dropped, "bytes_before": before, "bytes_after": resident_bytes(model)}
