"""Batch-invariant GPU kernels in TileLang: the GEMM and RMSNorm of ``ops``' invariant mode.

Why these are invariant: tile shapes are constants of the kernel (never chosen from M), M is a
dynamic dimension, and every output element is produced by exactly one thread block.

- ``gemm_nt``: ``C = A @ B^T`` (A ``[M, K]``, B ``[N, K]``, the layout of a linear weight). One
  block per 64 x 128 output tile; its K loop runs the 64-wide K tiles in order, each one tensor-
  core MMA sequence, accumulating in fp32 registers. No split-K, no stream-K, so a row's sum over
  K has the same order whatever M is or wherever the row sits; rows past M are zero-filled by the
  bulk copy and never stored.
- ``rms_norm``: one block per row; the row's sum of squares is reduced by a fixed thread / warp
  pattern that depends on D and the block size only, then ``1 / sqrt`` (IEEE, no rsqrt
  approximation) and the weight.

Float semantics are explicit: kernels are built with TileLang's fast-math pass config off
unless the call site opted in (``ops.opt_in``), and fp32 inputs are not offered to the GEMM
(tensor cores would round them to TF32): the torch reference serves them.

This module imports ``tilelang`` lazily: the package imports and runs without it.
"""

# no ``from __future__ import annotations``: TileLang reads the kernels' annotations as objects

import functools
import importlib.util

GEMM_TILE = dict(block_M=64, block_N=128, block_K=64, stages=3, threads=128)
NORM_THREADS = 128
DTYPES = {"bfloat16": "bfloat16", "float16": "float16"}


def tilelang_installed() -> bool:
    return importlib.util.find_spec("tilelang") is not None


def gemm_nt(N: int, K: int, dtype: str = "bfloat16", out_dtype: str | None = None, **tile):
    """The TileLang program for ``C[M, N] = A[M, K] @ B[N, K]^T`` with dynamic M."""
    import tilelang.language as T

    t = {**GEMM_TILE, **tile}
    bM, bN, bK = t["block_M"], t["block_N"], t["block_K"]
    out_dtype = out_dtype or dtype
    M = T.dynamic("m")

    @T.prim_func
    def gemm(A: T.Tensor((M, K), dtype), B: T.Tensor((N, K), dtype), C: T.Tensor((M, N), out_dtype)):
        with T.Kernel(T.ceildiv(N, bN), T.ceildiv(M, bM), threads=t["threads"]) as (bx, by):
            As = T.alloc_shared((bM, bK), dtype)
            Bs = T.alloc_shared((bN, bK), dtype)
            acc = T.alloc_fragment((bM, bN), "float32")
            T.clear(acc)
            for k in T.Pipelined(T.ceildiv(K, bK), num_stages=t["stages"]):
                T.copy(A[by * bM, k * bK], As)
                T.copy(B[bx * bN, k * bK], Bs)
                T.gemm(As, Bs, acc, transpose_B=True)
            T.copy(acc, C[by * bM, bx * bN])

    return gemm


def rms_norm(D: int, eps: float, dtype: str = "bfloat16", threads: int = NORM_THREADS):
    """The TileLang program for RMSNorm of rows ``X[M, D]`` with weight ``W[D]`` (fp32 math)."""
    import tilelang.language as T

    M = T.dynamic("m")

    @T.prim_func
    def norm(X: T.Tensor((M, D), dtype), W: T.Tensor((D,), dtype), Y: T.Tensor((M, D), dtype)):
        with T.Kernel(M, threads=threads) as bx:
            xs = T.alloc_shared((1, D), dtype)
            xf = T.alloc_fragment((1, D), "float32")
            sq = T.alloc_fragment((1, D), "float32")
            ss = T.alloc_fragment((1,), "float32")
            T.copy(X[bx, 0], xs)
            T.copy(xs, xf)
            for i, j in T.Parallel(1, D):
                sq[i, j] = xf[i, j] * xf[i, j]
            T.reduce_sum(sq, ss, dim=1)
            for i in T.Parallel(1):
                ss[i] = T.float32(1.0) / T.sqrt(ss[i] / T.float32(D) + T.float32(eps))
            for i, j in T.Parallel(1, D):
                xf[i, j] = xf[i, j] * ss[i] * T.Cast("float32", W[j])
            T.copy(xf, Y[bx, 0])

    return norm


ATTN_TILE = dict(block_H=16, block_K=64, threads=128)


def attention_sink(H: int, C: int, scale: float, dtype: str = "bfloat16", **tile):
    """The TileLang program for shared-KV attention with a sink, one block per (row, head group).

    Q ``[T, H, C]``, Kv ``[T, K, C]`` (key == value, each query row with its own candidates),
    Bias ``[T, K]`` fp32 (0 visible, -inf hidden), Sink ``[H]`` fp32 -> O ``[T, H, C]``. T and K
    are dynamic. The candidates are visited in blocks of ``block_K`` in order, with an online
    softmax whose running max starts at the sink logit (so the sink joins the denominator
    only); nothing is split across blocks, so a row's order depends on its own K alone.
    """
    import tilelang.language as T

    t = {**ATTN_TILE, **tile}
    bH, bK = min(t["block_H"], H), t["block_K"]
    NT, NK = T.dynamic("t"), T.dynamic("k")
    f32 = "float32"

    @T.prim_func
    def attn(Q: T.Tensor((NT, H, C), dtype), Kv: T.Tensor((NT, NK, C), dtype), Bias: T.Tensor((NT, NK), f32),
             Sink: T.Tensor((H,), f32), O: T.Tensor((NT, H, C), dtype)):
        with T.Kernel(T.ceildiv(H, bH), NT, threads=t["threads"]) as (bx, by):
            Qs = T.alloc_shared((bH, C), dtype)
            Ks = T.alloc_shared((bK, C), dtype)
            Ps = T.alloc_shared((bH, bK), dtype)
            S = T.alloc_fragment((bH, bK), f32)
            acc = T.alloc_fragment((bH, C), f32)
            m = T.alloc_fragment((bH,), f32)
            m_prev = T.alloc_fragment((bH,), f32)
            lsum = T.alloc_fragment((bH,), f32)
            rs = T.alloc_fragment((bH,), f32)
            T.copy(Q[by, bx * bH, 0], Qs)
            T.fill(acc, 0)
            for i in T.Parallel(bH):
                m[i] = Sink[bx * bH + i]
                lsum[i] = T.float32(1.0)
            for kb in T.serial(T.ceildiv(NK, bK)):
                T.copy(Kv[by, kb * bK, 0], Ks)
                T.clear(S)
                T.gemm(Qs, Ks, S, transpose_B=True)
                for i, j in T.Parallel(bH, bK):
                    S[i, j] = T.if_then_else(kb * bK + j < NK, S[i, j] * T.float32(scale) + Bias[by, kb * bK + j],
                                             -T.infinity(f32))
                T.copy(m, m_prev)
                T.reduce_max(S, m, dim=1, clear=False)
                for i in T.Parallel(bH):
                    lsum[i] = lsum[i] * T.exp(m_prev[i] - m[i])
                for i, j in T.Parallel(bH, C):
                    acc[i, j] = acc[i, j] * T.exp(m_prev[i] - m[i])
                for i, j in T.Parallel(bH, bK):
                    S[i, j] = T.exp(S[i, j] - m[i])
                T.reduce_sum(S, rs, dim=1)
                for i in T.Parallel(bH):
                    lsum[i] = lsum[i] + rs[i]
                T.copy(S, Ps)
                T.gemm(Ps, Ks, acc)
            for i, j in T.Parallel(bH, C):
                acc[i, j] = acc[i, j] / lsum[i]
            T.copy(acc, O[by, bx * bH, 0])

    return attn


def pass_configs(fast_math: bool = False) -> dict:
    from tilelang.transform import PassConfigKey

    return {PassConfigKey.TL_ENABLE_FAST_MATH: bool(fast_math)}


def lower_for(program, arch: str = "sm_90a", fast_math: bool = False):
    """Lower and compile ``program`` to a cubin for ``arch`` with nvcc; no GPU needed.

    Returns TileLang's artifact (``kernel_source`` holds the generated CUDA).
    """
    import tilelang
    from tilelang import tvm
    from tilelang.transform import PassContext

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    with PassContext(config=pass_configs(fast_math)), target:
        return tilelang.lower(program, target=target, enable_device_compile=True)


def programs(widths=((4096, 4096), (1024, 4096))) -> dict:
    """Every kernel program at representative V4 widths, by name (for compile checks)."""
    out = {}
    for N, K in widths:
        out[f"gemm_nt_bf16_{N}x{K}"] = gemm_nt(N, K)
    out["rms_norm_bf16_4096"] = rms_norm(4096, 1e-6)
    out["attention_sink_bf16_64x512"] = attention_sink(64, 512, 512 ** -0.5)
    return out


# ---- runtime (GPU) -------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, key: tuple, fast_math: bool):
    import tilelang

    if kind == "gemm":
        N, K, dtype = key
        prog, out_idx = gemm_nt(N, K, dtype), [2]
    elif kind == "attn":
        H, C, scale, dtype = key
        prog, out_idx = attention_sink(H, C, scale, dtype), [4]
    else:
        D, eps, dtype = key
        prog, out_idx = rms_norm(D, eps, dtype), [2]
    return tilelang.compile(prog, out_idx=out_idx, target="cuda", pass_configs=pass_configs(fast_math))


def _name(dt) -> str | None:
    return DTYPES.get(str(dt).replace("torch.", ""))


def supports_linear(x, weight) -> bool:
    """bf16 / fp16 CUDA tensors, equal dtypes, K a multiple of 8 (16-byte rows for the bulk copy)."""
    return (x.is_cuda and weight.is_cuda and x.dtype == weight.dtype and _name(x.dtype) is not None
            and x.shape[-1] % 8 == 0 and weight.shape[0] % 8 == 0)


def linear(x, weight, fast_math: bool = False):
    N, K = weight.shape
    a = x.reshape(-1, K).contiguous()
    if a.shape[0] == 0:
        return x.new_zeros(*x.shape[:-1], N)
    c = _compiled("gemm", (N, K, _name(x.dtype)), fast_math)(a, weight.contiguous())
    return c.view(*x.shape[:-1], N)


def supports_rms_norm(x, weight) -> bool:
    return (x.is_cuda and weight is not None and weight.dtype == x.dtype and _name(x.dtype) is not None
            and x.shape[-1] % 8 == 0 and x.shape[-1] <= 8192)


def rms_norm_cuda(x, weight, eps: float, fast_math: bool = False):
    D = x.shape[-1]
    a = x.reshape(-1, D).contiguous()
    if a.shape[0] == 0:
        return x.clone()
    y = _compiled("norm", (D, float(eps), _name(x.dtype)), fast_math)(a, weight.contiguous())
    return y.view(x.shape)


def supports_attention(q, keys) -> bool:
    """bf16 / fp16 on CUDA; heads a multiple of 16 and width a multiple of 64 (MMA tiles)."""
    H, C = q.shape[1], q.shape[2]
    return (q.is_cuda and keys.dtype == q.dtype and _name(q.dtype) is not None and H % 16 == 0
            and C % 64 == 0 and C <= 512)


def attention(q, keys, mask, sink, scale: float, fast_math: bool = False):
    import torch

    T_, H, C = q.shape
    if T_ == 0:
        return q.clone()
    if keys.shape[1] == 0:  # only the sink: every weight is 0
        return torch.zeros_like(q)
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=q.device).masked_fill(~mask, float("-inf"))
    fn = _compiled("attn", (H, C, float(scale), _name(q.dtype)), fast_math)
    return fn(q.contiguous(), keys.contiguous(), bias, sink.float().contiguous())
