"""Fast mode's decode attention in CUDA C++ (``cuda_attention.cu``): ``ops.sparse_attention`` and
``fused.normed_sparse_attention`` for bf16 queries of 512-wide heads in groups of 64, the pools'
rows read by index. The kernel's own comment says how it works; this module checks the call and
launches it: 256-thread blocks over the (row, 64-head group) items, one block an item, or, where
a row has at most ``WALK_CHUNKS`` chunks of candidates, at most one an SM walking several (the
same bits either way)."""

from __future__ import annotations

import functools

import torch

from v4stack.kernels import cubin

HEADS, WIDTH = 64, 512
SOURCE = "cuda_attention.cu"
CHUNK, STAGES = 64, 2  # the .cu's CH, NST
# rows of at most this many chunks walk several items a block: on an H100 at 256 rows the window's
# 2 chunks took 37.0 us walking against 39.7 one block a row, HCA at 16k's 4 took 49.5 against
# 50.6, CSA's 10 took 95.1 against 90.0 (bench/results/attention_cuda_h100_7cbf2b1.json, cuda_grid)
WALK_CHUNKS = 4
# the .cu's SMEM_BYTES: queries, stages, score partials, address slots, head scales, warps' extents,
# alignment
SMEM = (HEADS * 1024 + STAGES * CHUNK * 1024 + 2 * (CHUNK // 2) * 128 * 4 + (STAGES + 1) * CHUNK * 8 + HEADS * 4
        + 8 * 4 + 1024)
TYPES = ("p", "i64", "i64", "p", "p", "i64", "i32", "i32", "p", "p", "i64", "i32", "i32", "p", "p", "i64", "i64",
         "f32", "f32", "i32", "i32", "i32")
LOG2E = 1.4426950408889634
MIN_ROWS = 64  # from here fast mode takes it over the Triton launches (bench/results/attention_cuda_h200.json)


def ready() -> bool:
    """A Hopper GPU, and nvcc builds the source (``cubin.ready``: asked once)."""
    return cubin.ready(SOURCE, "fast mode keeps the Triton launches")


@functools.lru_cache(maxsize=None)
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device: torch.device) -> int:
    return _sms_of(device.index if device.index is not None else torch.cuda.current_device())


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def accepts(q, pools, idx, sink, scale) -> bool:
    """The shapes the kernel is written for; ``pools`` None: asked before the candidates exist."""
    if q.dim() != 3 or q.dtype != torch.bfloat16 or not q.is_cuda:
        return False
    T, H, D = q.shape
    if D != WIDTH or H % HEADS or q.stride(2) != 1 or q.stride(1) % 8 or q.stride(0) % 8 or not _aligned(q):
        return False
    if T * (H // HEADS) >= 2 ** 31:  # the kernel's item index is an int
        return False
    if pools is None:
        return True
    if not 1 <= len(pools) <= 2 or len(idx) != len(pools):
        return False
    for p, i in zip(pools, idx):
        if p.dtype != torch.bfloat16 or p.dim() != 2 or p.shape[1] != D or not p.is_cuda:
            return False
        if i.dim() != 2 or i.shape[0] != T or i.dtype not in (torch.int32, torch.int64):
            return False
    return sink.numel() == H and sink.is_cuda


def sparse_attention(q, pools, idx, sink, scale: float, q_eps: float | None = None, walk: bool | None = None):
    """``walk``: whether blocks walk several items (None: rows of at most ``WALK_CHUNKS`` chunks)."""
    T, H, D = q.shape
    p0, i0 = pools[0].contiguous(), idx[0]
    p1, i1 = (pools[1].contiguous(), idx[1]) if len(pools) > 1 else (p0, i0[:, :0])
    it = i0.dtype if i0.shape[1] else i1.dtype
    i0, i1 = i0.to(it).contiguous(), i1.to(it).contiguous()
    K0, K1 = i0.shape[1], i1.shape[1]
    out = torch.empty_like(q)
    if T == 0:
        return out
    fn = cubin.load(SOURCE, "decode_attention_i64" if it == torch.int64 else "decode_attention_i32", TYPES, SMEM,
                    q.device.index if q.device.index is not None else torch.cuda.current_device())
    sink = sink.float().contiguous()
    items = T * (H // HEADS)  # int32 in the kernel: T < 2^31 / (H / 64)
    if walk is None:
        walk = -(-(K0 + K1) // CHUNK) <= WALK_CHUNKS
    grid = min(items, _sms(q.device)) if walk else items
    fn.launch((grid, 1, 1), 256, q, q.stride(0), q.stride(1), p0, i0, i0.stride(0) if K0 else 0, K0, p0.shape[0],
              p1, i1, i1.stride(0) if K1 else 0, K1, p1.shape[0], sink, out, out.stride(0), out.stride(1),
              float(scale) * LOG2E, 0.0 if q_eps is None else float(q_eps), int(q_eps is not None), items,
              H // HEADS)
    return out


def normed_sparse_attention(q, pools, idx, sink, scale: float, eps: float):
    return sparse_attention(q, pools, idx, sink, scale, q_eps=eps)
