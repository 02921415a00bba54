"""Fast mode's sparse attention for many query rows in TileLang: one block per (row, 64 heads),
the query in shared memory, candidates gathered from the pools by index a chunk at a time.

``ops.sparse_attention(q, pools, idx, sink, scale)``'s fast path at batch (the Triton online
kernel spills there: its ``[64, 512]`` fp32 accumulator and the chunk it gathers through
registers do not fit in one program's registers). This kernel keeps the query ``[64, D]`` and
each gathered chunk ``[64, D]`` in shared memory (two chunks in flight, pipelined), the scores
``[64, 64]`` and the accumulator ``[64, D]`` in registers split over two warpgroups, and runs the
textbook online softmax in base 2: ``M' = max(M, max s)``, ``p = 2^(s - M')``,
``L' = L 2^(M - M') + sum p``, ``A' = A 2^(M - M') + p @ v`` (``p`` rounded to the query dtype
for the MMA), started from the sink (``M = sink log2 e``, ``L = 1``, ``A = 0``), so the sink
joins the denominator only. Key = value: a chunk's rows serve both products.

Candidates: pool 0's rows ``idx[0] [T, K0]`` (the window ring) then pool 1's ``idx[1] [T, K1]``
(compressed entries); an index outside ``[0, N)`` (-1 padding) is no candidate: its row is not
read (the gather reads row 0 in its place) and its score is -inf. ``K0``, ``K1``, ``T`` and the
pools' rows are dynamic, so one build serves every step of a layer kind.

``QN``: each head's query is RMS-normalised first (weightless, fp32, rounded back to the query
dtype), in shared memory, so the normalised queries are never written out
(``fused.normed_sparse_attention``).

The arithmetic differs from the Triton kernels' (fast mode asks for no bits across launch
shapes); a row's result depends on its own inputs only (one block per row, chunks in order).
This module imports ``tilelang`` lazily.
"""

# no ``from __future__ import annotations``: TileLang reads the kernel's annotations as objects

import functools

LOG2E = 1.4426950408889634
TILE = dict(block_H=64, chunk=64, stages=2, threads=256)
MIN_ROWS = 128  # fewer rows leave SMs idle with one block a row: the Triton launches serve those


def program(H: int, D: int, scale: float, qn: bool, eps: float, two: bool = True, dtype: str = "bfloat16", **tile):
    """The TileLang program: Q ``[T, H, D]``, P0 ``[N0, D]``, I0 ``[T, K0]`` (int64), P1 ``[N1, D]``,
    I1 ``[T, K1]``, Sink ``[H]`` fp32 -> O ``[T, H, D]``; without ``two`` P1 / I1 are not read (a
    layer with the window only passes pool 0 there again)."""
    import tilelang.language as T

    t_ = {**TILE, **tile}
    bH, BC, threads = t_["block_H"], t_["chunk"], t_["threads"]
    NT, N0, N1, K0, K1 = T.dynamic("t"), T.dynamic("n0"), T.dynamic("n1"), T.dynamic("k0"), T.dynamic("k1")
    f32, i64 = "float32", "int64"
    scale2 = float(scale) * LOG2E

    @T.macro
    def chunks(Pool, Idx, N, K, t, Qs, Ks, Ps, ok, S, acc, m, mp, alpha, lsum, rs):
        for c in T.Pipelined(T.ceildiv(K, BC), num_stages=t_["stages"]):
            for i in T.Parallel(BC):
                ok[i] = T.if_then_else(c * BC + i < K, Idx[t, T.min(c * BC + i, K - 1)], T.int64(-1))
            for i, d in T.Parallel(BC, D):
                Ks[i, d] = Pool[T.max(T.min(T.if_then_else(c * BC + i < K, Idx[t, T.min(c * BC + i, K - 1)],
                                                           T.int64(0)), N - 1), T.int64(0)), d]
            T.gemm(Qs, Ks, S, transpose_B=True, clear_accum=True)
            for h, i in T.Parallel(bH, BC):
                S[h, i] = T.if_then_else((ok[i] >= 0) & (ok[i] < N), S[h, i] * T.float32(scale2), -T.infinity(f32))
            T.copy(m, mp)
            T.reduce_max(S, m, dim=1, clear=False)
            for h in T.Parallel(bH):
                alpha[h] = T.exp2(mp[h] - m[h])
            for h, i in T.Parallel(bH, BC):
                S[h, i] = T.exp2(S[h, i] - m[h])
            T.reduce_sum(S, rs, dim=1)
            for h in T.Parallel(bH):
                lsum[h] = lsum[h] * alpha[h] + rs[h]
            for h, d in T.Parallel(bH, D):
                acc[h, d] = acc[h, d] * alpha[h]
            T.copy(S, Ps)
            T.gemm(Ps, Ks, acc)

    @T.prim_func
    def attn(Q: T.Tensor((NT, H, D), dtype), P0: T.Tensor((N0, D), dtype), I0: T.Tensor((NT, K0), i64),
             P1: T.Tensor((N1, D), dtype), I1: T.Tensor((NT, K1), i64), Sink: T.Tensor((H,), f32),
             O: T.Tensor((NT, H, D), dtype)):
        with T.Kernel(NT, H // bH, threads=threads) as (t, hb):
            Qs = T.alloc_shared((bH, D), dtype)
            Ks = T.alloc_shared((BC, D), dtype)
            Ps = T.alloc_shared((bH, BC), dtype)
            ok = T.alloc_fragment((BC,), i64)
            S = T.alloc_fragment((bH, BC), f32)
            acc = T.alloc_fragment((bH, D), f32)
            m = T.alloc_fragment((bH,), f32)
            mp = T.alloc_fragment((bH,), f32)
            alpha = T.alloc_fragment((bH,), f32)
            lsum = T.alloc_fragment((bH,), f32)
            rs = T.alloc_fragment((bH,), f32)
            T.copy(Q[t, hb * bH, 0], Qs)
            if qn:
                qf = T.alloc_fragment((bH, D), f32)
                ss = T.alloc_fragment((bH,), f32)
                T.copy(Qs, qf)
                for h, d in T.Parallel(bH, D):
                    qf[h, d] = qf[h, d] * qf[h, d]
                T.reduce_sum(qf, ss, dim=1)
                for h in T.Parallel(bH):
                    ss[h] = T.float32(1.0) / T.sqrt(ss[h] / T.float32(D) + T.float32(eps))
                T.copy(Qs, qf)
                for h, d in T.Parallel(bH, D):
                    qf[h, d] = qf[h, d] * ss[h]
                T.copy(qf, Qs)
            T.fill(acc, 0)
            for h in T.Parallel(bH):
                m[h] = Sink[hb * bH + h] * T.float32(LOG2E)
                lsum[h] = T.float32(1.0)
            chunks(P0, I0, N0, K0, t, Qs, Ks, Ps, ok, S, acc, m, mp, alpha, lsum, rs)
            if two:
                chunks(P1, I1, N1, K1, t, Qs, Ks, Ps, ok, S, acc, m, mp, alpha, lsum, rs)
            for h, d in T.Parallel(bH, D):
                acc[h, d] = acc[h, d] / lsum[h]
            T.copy(acc, O[t, hb * bH, 0])

    return attn


def pass_configs() -> dict:
    from tilelang.transform import PassConfigKey

    return {PassConfigKey.TL_ENABLE_FAST_MATH: False}


@functools.lru_cache(maxsize=None)
def _compiled(H: int, D: int, scale: float, qn: bool, eps: float, two: bool, dtype: str):
    import tilelang
    import torch
    from tilelang import tvm

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")  # Hopper's wgmma needs the arch-specific target
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    return tilelang.compile(program(H, D, scale, qn, eps, two, dtype), out_idx=[6], target=target,
                            pass_configs=pass_configs())


_refused: list = []  # a build this machine could not make (no nvcc, an unsupported target): the Triton kernels serve


def usable(q, pools, idx) -> bool:
    """bf16 / fp16 queries of 64-head groups, width a multiple of 64 up to 512, at least MIN_ROWS
    rows; one or two pools of the query dtype, int64 indices (``pools`` None: the question asked
    before the candidates exist, ``fused.normalises_queries``)."""
    import torch

    if _refused or q.dim() != 3:
        return False
    T_, H, D = q.shape
    ok = (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and T_ >= MIN_ROWS and H % TILE["block_H"] == 0
          and D % 64 == 0 and D <= 512)
    if not ok or pools is None:
        return ok
    return (1 <= len(pools) <= 2 and len(idx) == len(pools)
            and all(p.dtype == q.dtype and p.dim() == 2 and p.shape[1] == D for p in pools)
            and all(j.dtype == torch.int64 and j.dim() == 2 and j.shape[0] == T_ for j in idx))


def sparse_attention(q, pools, idx, sink, scale: float, q_eps: float | None = None):
    """``ops.sparse_attention`` (``q_eps``: ``fused.normed_sparse_attention``) by the TileLang kernel;
    where the kernel cannot be built here, the Triton online launch serves (and does from then on)."""
    T_, H, D = q.shape
    name = str(q.dtype).replace("torch.", "")
    try:
        fn = _compiled(H, D, float(scale), q_eps is not None, float(q_eps or 0.0), len(pools) > 1, name)
    except Exception as e:  # noqa: BLE001 - any build failure: the other kernel serves
        _refused.append(repr(e)[:300])
        from v4stack.kernels import triton_attention_online as tao

        return tao.sparse_attention(q, pools, idx, sink, scale, force=True, q_eps=q_eps)
    p0, i0 = pools[0].contiguous(), idx[0].contiguous()
    p1, i1 = (pools[1].contiguous(), idx[1].contiguous()) if len(pools) > 1 else (p0, i0)
    return fn(q.contiguous(), p0, i0, p1, i1, sink.float().contiguous())


def normed_sparse_attention(q, pools, idx, sink, scale: float, eps: float):
    return sparse_attention(q, pools, idx, sink, scale, q_eps=eps)
