"""Call-time contract checks of the GPU kernels (the ``accepts`` of their dispatch entries)."""


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def tilelang_linear(x, weight, **kw) -> bool:
    return (not kw and weight.dim() == 2 and x.dtype == weight.dtype and x.shape[-1] % 8 == 0
            and weight.shape[0] % 8 == 0)


def tilelang_rms_norm(x, weight, eps) -> bool:
    return weight is not None and weight.dtype == x.dtype and x.shape[-1] % 8 == 0 and x.shape[-1] <= 8192


def tilelang_attention(q, keys, mask, sink, scale) -> bool:
    H, c = q.shape[1], q.shape[2]
    return keys.dtype == q.dtype and H % 16 == 0 and c % 64 == 0 and c <= 512


def sparse_attention(q, pools, idx, sink, scale) -> bool:
    D = q.shape[2]
    return (len(pools) <= 2 and _pow2(D) and 16 <= D <= 512 and q.stride(2) == 1
            and all(p.dtype == q.dtype for p in pools) and all(not j.is_floating_point() for j in idx))


def grouped_linear(x, w, offsets) -> bool:
    return x.dtype == w.dtype and x.dtype.is_floating_point and x.shape[1] == w.shape[2] and w.shape[0] > 0


def torch_grouped_mm(x, w, offsets) -> bool:
    import torch

    return (hasattr(torch, "_grouped_mm") and x.dtype == w.dtype == torch.bfloat16 and x.shape[1] % 8 == 0
            and w.shape[1] % 8 == 0 and x.is_contiguous())
