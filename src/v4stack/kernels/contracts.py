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


_FLOATS = ("torch.float32", "torch.bfloat16", "torch.float16")


def linear(x, weight, **kw) -> bool:
    return not kw and weight.dim() == 2 and x.dtype == weight.dtype and str(x.dtype) in _FLOATS


def fp8_linear(x, qw) -> bool:
    w = qw.data
    return (str(x.dtype) in ("torch.bfloat16", "torch.float16") and w.is_cuda and w.stride(1) == 1
            and tuple(qw.scale.shape) == (-(-w.shape[0] // 128), -(-w.shape[1] // 128)))


def hc_mix(flat, fn, eps) -> bool:
    return flat.dtype == fn.dtype and str(flat.dtype) == "torch.float32" and fn.shape[0] <= 64


def indexer_scores(q, w, k) -> bool:
    D = q.shape[-1]
    return (q.dim() == 3 and k.dim() == 2 and k.dtype == q.dtype and _pow2(D) and 16 <= D <= 256 and q.shape[1] <= 128
            and str(q.dtype) in _FLOATS)


def softmax(x, dim=-1) -> bool:
    return x.dim() >= 1 and dim in (-1, x.dim() - 1) and str(x.dtype) in _FLOATS


def weighted_pool(kv, score, dim) -> bool:
    return (kv.dim() >= 2 and kv.shape == score.shape and dim % kv.dim() == kv.dim() - 2 and kv.shape[-2] <= 256
            and str(kv.dtype) in _FLOATS and str(score.dtype) in _FLOATS)


def moe_combine(y, idx) -> bool:
    return y.dim() == 3 and idx.shape == y.shape[:2] and y.shape[1] <= 64 and str(y.dtype) in _FLOATS


def topk(x, k, stable=False) -> bool:
    return str(x.dtype) in _FLOATS and x.shape[-1] < 2**31


def rms_norm(x, weight, eps) -> bool:
    return str(x.dtype) in _FLOATS and (weight is None or weight.shape == x.shape[-1:])


def attention_with_sink(q, keys, mask, sink, scale) -> bool:
    D = q.shape[2]
    return (keys.dtype == q.dtype and _pow2(D) and 16 <= D <= 512 and keys.is_contiguous()
            and keys.shape[0] * keys.shape[1] < 2**31)
