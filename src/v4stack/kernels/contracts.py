"""Call-time contract checks of the GPU kernels: the ``accepts`` of their dispatch entries.

Each check is the part of a kernel's contract that depends on the call: dtypes, ranks, widths
the tiles need, every tensor on the GPU, and strides the proofs assume (``specs.py`` proves the
rest - bounds, disjoint stores, dividing tiles - for every shape that passes). A call that fails
its check goes to the next implementation in the table. Kept to attribute reads and integer
tests: ``bench/ops_gpu_check.py`` measures one under a microsecond.
"""

import torch

FLOATS = frozenset((torch.float32, torch.bfloat16, torch.float16))
HALF = frozenset((torch.bfloat16, torch.float16))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def tilelang_linear(x, weight) -> bool:
    return (weight.is_cuda and weight.dim() == 2 and x.dtype == weight.dtype and x.shape[-1] % 8 == 0
            and weight.shape[0] % 8 == 0)


def tilelang_rms_norm(x, weight, eps) -> bool:
    return (weight is not None and weight.is_cuda and weight.dtype == x.dtype and x.shape[-1] % 8 == 0
            and x.shape[-1] <= 8192)


def tilelang_attention(q, keys, mask, sink, scale) -> bool:
    H, c = q.shape[1], q.shape[2]
    return keys.is_cuda and keys.dtype == q.dtype and H % 16 == 0 and c % 64 == 0 and c <= 512


def sparse_attention(q, pools, idx, sink, scale) -> bool:
    D = q.shape[2]
    return (q.dtype in FLOATS and len(pools) <= 2 and _pow2(D) and 16 <= D <= 512 and q.stride(2) == 1 and sink.is_cuda
            and all(p.dtype == q.dtype and p.is_cuda for p in pools)
            and all(j.is_cuda and not j.is_floating_point() for j in idx))


def attention_with_sink(q, keys, mask, sink, scale) -> bool:
    D = q.shape[2]
    return (q.dtype in FLOATS and keys.dtype == q.dtype and keys.is_cuda and mask.is_cuda and sink.is_cuda and _pow2(D)
            and 16 <= D <= 512 and keys.is_contiguous() and keys.shape[0] * keys.shape[1] < 2**31)


def grouped_linear(x, w, offsets) -> bool:
    return x.dtype == w.dtype and x.dtype in FLOATS and w.is_cuda and offsets.is_cuda and w.shape[0] > 0


def torch_grouped_mm(x, w, offsets) -> bool:
    return (hasattr(torch, "_grouped_mm") and x.dtype == w.dtype == torch.bfloat16 and w.is_cuda
            and offsets.is_cuda and x.shape[1] % 8 == 0 and w.shape[1] % 8 == 0 and x.is_contiguous())


def linear(x, weight) -> bool:
    return weight.is_cuda and weight.dim() == 2 and x.dtype == weight.dtype and x.dtype in FLOATS


def fp8_linear(x, qw) -> bool:
    w = qw.data
    return (x.dtype in HALF and qw.fmt == "fp8" and w.is_cuda and w.stride(1) == 1
            and tuple(qw.scale.shape) == (-(-w.shape[0] // 128), -(-w.shape[1] // 128)))


def hc_mix(flat, fn, eps) -> bool:
    return flat.dtype == fn.dtype == torch.float32 and fn.is_cuda and fn.shape[0] <= 64


def indexer_scores(q, w, k) -> bool:
    D = q.shape[-1]
    shared_or_per_row = k.dim() == 2 or (k.dim() == 3 and k.shape[0] == q.shape[0])
    return (q.dim() == 3 and shared_or_per_row and k.dtype == q.dtype and q.dtype in FLOATS and w.is_cuda and k.is_cuda
            and _pow2(D) and 16 <= D <= 256 and q.shape[1] <= 128)


def indexer_scores_rows(q, w, pool, rows) -> bool:
    """Half or fp32 key pools of the queries' dtype, or V4's packed e4m3 keys (uint8 rows of D codes,
    D / 32 exponent bytes and zeros to a multiple of 16: ``ops/fp8_keys.py``) for half queries."""
    from v4stack.ops.fp8_keys import width  # here: the ops package imports this module while it loads

    D = q.shape[-1]
    packed = pool.dtype == torch.uint8 and pool.shape[-1] == width(D) and q.dtype in HALF
    return ((pool.dtype == q.dtype or packed) and q.dtype in FLOATS and w.is_cuda and pool.is_cuda and rows.is_cuda
            and not rows.is_floating_point() and pool.stride(-1) == 1 and _pow2(D) and 16 <= D <= 256
            and q.shape[1] <= 128)


def softmax(x, dim=-1) -> bool:
    return (dim == -1 or dim == x.dim() - 1) and x.dtype in FLOATS


def weighted_pool(kv, score, dim) -> bool:
    return (kv.dim() >= 2 and kv.shape == score.shape and score.is_cuda and dim % kv.dim() == kv.dim() - 2
            and kv.shape[-2] <= 256 and kv.dtype in FLOATS and score.dtype in FLOATS)


def moe_combine(y, idx) -> bool:
    return y.dim() == 3 and idx.is_cuda and idx.shape == y.shape[:2] and y.shape[1] <= 64 and y.dtype in FLOATS


def rms_norm(x, weight, eps) -> bool:
    return x.dtype in FLOATS and (weight is None or (weight.is_cuda and weight.shape == x.shape[-1:]))


def hc_read(x, pre) -> bool:
    return x.dim() == 3 and pre.is_cuda and pre.shape == x.shape[:2] and x.shape[1] <= 16 and x.dtype in FLOATS


def hc_write(x, out, post, comb) -> bool:
    n = x.shape[1] if x.dim() == 3 else 0
    return (0 < n <= 16 and out.is_cuda and post.is_cuda and comb.is_cuda and out.shape == (x.shape[0], x.shape[2])
            and post.shape == x.shape[:2] and comb.shape == (x.shape[0], n, n) and x.dtype in FLOATS)
