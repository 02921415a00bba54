"""Fast mode's indexer scores over key rows read by index, in CUDA C++ (``cuda_indexer.cu``):
``ops.indexer_scores(q, w, pool, rows=rows)`` for bf16 queries of 64 heads of 128 over a bf16
pool - a CSA layer's decode step at V4-Flash's and V4-Pro's indexer widths. The kernel's own
comment says how it works; this module checks the call and launches it: 128-thread blocks over
(query, slice of ``FORMS[form][1]`` chunks of 64 columns).

The scores are the Triton kernel's function (``triton_gemm.indexer_scores``) in another order of
the head sum, so their bits may differ by a rounding; fast mode promises no bits across kernels.
Packed e4m3 pools and other widths stay on the Triton kernel."""

from __future__ import annotations

import os

import torch

from v4stack.kernels import cubin

HEADS, WIDTH, CHUNK = 64, 128, 64
SOURCE = "cuda_indexer.cu"
# form -> (stages, chunks a block); the .cu's entries indexer_rows_{i64,i32}_s{stages}_c{chunks}
FORMS = {"s3_c8": (3, 8), "s2_c8": (2, 8), "s4_c8": (4, 8), "s3_c4": (3, 4), "s4_c16": (4, 16)}
# the shipped one (int32 indices: this form only): on an H100 it was the fastest form at every case of
# bench/indexer_cuda.py (256 x 4096 95.2 us against s3_c8's 97.1; 64 x 4096 26.2 against 29.6;
# indexer_cuda_h100_998536d.json)
FORM = "s2_c8"
TYPES = ("p", "i64", "i64", "p", "i64", "p", "i64", "p", "i64", "i32", "p", "i64", "i32")
MIN_ROWS = 64  # from here fast mode takes it over the Triton launch
# fast mode's indexed scores take this kernel (``kernels/gpu.py``); V4STACK_CUDA_INDEXER=0 keeps the
# Triton launch. On an H100 it scored a flash4 batch-256 16k step's indexer in 102 us against the
# Triton kernel's 111-112 (two interleaved profiles a side, serve_profile_ci{0,1}_h100_998536d_*.json)
ENABLED = os.environ.get("V4STACK_CUDA_INDEXER", "1") != "0"


def smem(form: str) -> int:
    """The .cu's ISMEM: the query's tile, the stages, the slice's row addresses, the alignment."""
    nst, cpb = FORMS[form]
    return CHUNK * WIDTH * 2 * (1 + nst) + cpb * CHUNK * 8 + 1024


def ready() -> bool:
    """A Hopper GPU, and nvcc builds the source (``cubin.ready``: asked once)."""
    return cubin.ready(SOURCE, "fast mode keeps the Triton launch")


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def accepts(q, w, pool, rows) -> bool:
    """The shapes the kernel is written for."""
    if q.dim() != 3 or q.dtype != torch.bfloat16 or not q.is_cuda or q.shape[1:] != (HEADS, WIDTH):
        return False
    if q.stride(2) != 1 or q.stride(1) % 8 or q.stride(0) % 8 or not _aligned(q):
        return False
    if w.dtype != torch.bfloat16 or w.shape != q.shape[:2] or w.stride(1) != 1 or w.stride(0) % 2 \
            or w.data_ptr() % 4:
        return False
    if pool.dtype != torch.bfloat16 or pool.dim() != 2 or pool.shape[1] != WIDTH or pool.stride() != (WIDTH, 1) \
            or not _aligned(pool):
        return False
    if rows.dim() != 2 or rows.shape[0] != q.shape[0] or rows.dtype not in (torch.int32, torch.int64):
        return False
    T, S = rows.shape
    return S < 2 ** 31 - FORMS[FORM][1] * CHUNK and T * -(-S // (FORMS[FORM][1] * CHUNK)) < 2 ** 31


def indexer_scores_rows(q, w, pool, rows, form: str | None = None):
    """``I[t, s] = sum_h w[t, h] relu(q[t, h] . pool[rows[t, s]])`` in bf16, -inf where ``rows[t, s]``
    is -1 or outside the pool; ``form``: a key of ``FORMS`` (None: ``FORM``)."""
    form = form or FORM
    nst, cpb = FORMS[form]
    T, S = rows.shape
    out = torch.empty(T, S, dtype=torch.bfloat16, device=q.device)
    if T == 0 or S == 0:
        return out
    r = rows if rows.stride(1) == 1 else rows.contiguous()
    if r.dtype == torch.int32 and form != FORM:
        r = r.long()
    it = "i32" if r.dtype == torch.int32 else "i64"
    fn = cubin.load(SOURCE, f"indexer_rows_{it}_{form}", TYPES, smem(form),
                    q.device.index if q.device.index is not None else torch.cuda.current_device())
    slices = -(-S // (cpb * CHUNK))
    fn.launch((T * slices, 1, 1), 128, q, q.stride(0), q.stride(1), w, w.stride(0), pool, pool.shape[0], r,
              r.stride(0), S, out, out.stride(0), slices)
    return out
