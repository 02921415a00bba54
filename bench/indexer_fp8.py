"""A candidate for the indexer's keys stored as e4m3 with one fp32 scale a key (V4's cache keeps its
keys quantised): the decode step's scoring by index over such a pool, timed against the shipped
scoring over bf16 keys, with how far the chosen entries move.

    python -m bench.indexer_fp8 --out bench/results/indexer_fp8_h100.json

Then (``packed_rows``) the form the engine stores: the shipped kernel over V4's packed keys
(``ops/fp8_keys.py``: e4m3 codes, a power-of-two scale a 32 dims), against the same kernel over
bf16 keys, at one to four chunks a program. (Five other widenings of the packed keys - the codes
scaled as ``[blocks, 32, entries]``, the exponent added to the bf16 bits, one MMA a 32-dim block
chained - were measured slower at 6d0e8fd, ``indexer_fp8_h100_6d0e8fd.json``; code at that commit.)

A key ``k`` is stored as ``k8 = e4m3(k / s)`` with ``s = max|k| / 448`` (1 for a zero key), so
``k ~ s k8``; since ``s > 0``, ``sum_h w_h relu(q_h . s k8) = s sum_h w_h relu(q_h . k8)``, and the
kernel scales each key's head sum once. The e4m3 bytes widen to bf16 exactly, so the MMA is the
shipped kernel's (``triton_gemm._indexer_score``) on other key values. Half the key bytes of bf16
(plus 4 bytes a key for the scale): at 16k tokens a CSA layer's decode step at batch 256 reads
~268 MB of bf16 keys, ~140 MB of these.

Each row: device time per call under a CUDA graph (``bench.timing.graph_time``) of the shipped
bf16 scoring and of the candidate at a few launch shapes, ``queries`` x ``entries`` (64 heads of
128, each query's entries contiguous in the pool, as a request's closed entries are), the largest
score difference against the fp32 scores of the dequantised keys, and how many of the top-512
entries of the bf16 keys' scores the candidate's top-512 keeps. On an H100 it was no faster than the
bf16 scoring (111 against 109 us at 256 x 4096, ``indexer_fp8_h100_92e840f.json``), and a scale a key
cannot hold V4's rounded keys exactly, so the engine stores the packed form above instead; the
candidate stays as the record.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from v4stack.kernels.gdc import pdl_enter
from v4stack.kernels.launch import cdiv, launch, next_pow2
from v4stack.kernels.triton_gemm import _indexer_score, indexer_query

E4M3_MAX = 448.0
TILE = dict(BS=128, num_warps=4, num_stages=3)  # the shipped bf16 launch's shape (triton_gemm.INDEXER_TILE)


def quantize(k: torch.Tensor):
    """``k [N, d]`` -> (e4m3 ``[N, d]``, fp32 scale ``[N]``): ``s = max|k| / 448`` a row (1 where 0)."""
    a = k.float().abs().amax(-1)
    s = torch.where(a > 0, a / E4M3_MAX, torch.ones_like(a))
    return (k.float() / s[:, None]).to(torch.float8_e4m3fn), s


@triton.jit
def indexer_fp8_kernel(Q, Wt, K8, KS, Rows, Y, S, H, NK, s_qt, s_qh, s_wt, s_ks, s_rt, s_yt, D: tl.constexpr,
                       BH: tl.constexpr, BS: tl.constexpr):
    """One program a (query, BS entries): the entries' e4m3 keys by pool row (-1, or a row outside
    ``[0, NK)``: no entry, scored -inf), widened to the query's dtype, the shipped score, times
    each key's scale."""
    pdl_enter()
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    q, w = indexer_query(Q, Wt, t, H, s_qt, s_qh, s_wt, D, BH)
    s = tl.program_id(1) * BS + tl.arange(0, BS)
    r = tl.load(Rows + t * s_rt + s, mask=s < S, other=-1).to(tl.int64)
    ok = (r >= 0) & (r < NK)
    score = tl.full([BS], float("-inf"), tl.float32)
    if tl.sum(ok.to(tl.int32), 0) > 0:
        k = tl.load(K8 + r[None, :] * s_ks + d[:, None], mask=ok[None, :], other=0.0).to(q.dtype)
        sc = tl.load(KS + r, mask=ok, other=0.0)
        score = tl.where(ok, _indexer_score(q, k, w, False) * sc, float("-inf"))
    tl.store(Y + t * s_yt + s, score, mask=s < S)


def scores_fp8(q, w, k8, ks, rows, tile=None):
    """``I[t, s] = ks[r] sum_h w[t, h] relu(q[t, h] . k8[r])`` for ``r = rows[t, s]`` (fp32, -inf where
    ``r`` is no entry): ``q [T, H, d]`` half, ``w [T, H]``, ``k8 [N, d]`` e4m3, ``ks [N]`` fp32."""
    t = tile or TILE
    T, H, D = q.shape
    S = rows.shape[1]
    out = torch.empty(T, S, dtype=torch.float32, device=q.device)
    if T and S:
        qc, wc, rc = q.contiguous(), w.contiguous(), rows.contiguous()
        launch(indexer_fp8_kernel, (T, cdiv(S, t["BS"])), qc, wc, k8, ks, rc, out, S, H, k8.shape[0], qc.stride(0),
               qc.stride(1), wc.stride(0), k8.stride(0), rc.stride(0), out.stride(0), D=D, BH=max(16, next_pow2(H)),
               BS=t["BS"], num_warps=t["num_warps"], num_stages=t["num_stages"])
    return out


def reference(q, w, k8, ks, rows):
    """The candidate's scores in fp32 from the dequantised keys (``-inf`` where no entry)."""
    ok = rows >= 0
    k = k8.float()[rows.clamp(min=0)] * ks[rows.clamp(min=0)][..., None]  # [T, S, d]
    dots = torch.einsum("thd,tsd->ths", q.float(), k)
    s = (dots.clamp(min=0) * w.float()[..., None]).sum(1)
    return torch.where(ok, s, torch.full_like(s, float("-inf")))


def case(T: int, E: int, device: str, H: int = 64, D: int = 128, seed: int = 0):
    """``T`` queries, each with ``E`` entries contiguous in a pool of ``T E`` keys."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(T, H, D, device=device, generator=g).bfloat16()
    w = torch.randn(T, H, device=device, generator=g) * (D ** -0.5 * H ** -0.5)
    keys = torch.randn(T * E, D, device=device, generator=g).bfloat16()
    rows = torch.arange(T * E, device=device).view(T, E)
    return q, w, keys, rows


def overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    """The mean share of each row's top-``k`` of ``a`` that is in its top-``k`` of ``b``."""
    ta, tb = a.topk(k, -1).indices, b.topk(k, -1).indices
    hit = (ta.unsqueeze(-1) == tb.unsqueeze(-2)).any(-1)
    return float(hit.float().mean())


def packed_rows(T: int, E: int) -> list:
    """The shipped kernel over V4's packed keys (``ops/fp8_keys.py``, the engine's
    ``index_keys="fp8"``) against the same kernel over the bf16 keys they hold, at a few tiles
    (``CH`` chunks a program: the query loaded once for more keys). The keys are rounded as V4's
    activation rounding leaves them, so each packed tile must give the bf16 pool's bits."""
    from bench.timing import time_tile
    from v4stack.kernels.triton_gemm import INDEXER_TILE, indexer_scores
    from v4stack.model.quant import IndexRounding
    from v4stack.ops import fp8_keys

    q, w, keys, rows = case(T, E, "cuda")
    keys = IndexRounding()(keys)
    packed = fp8_keys.pack(keys)
    assert torch.equal(fp8_keys.unpack(packed, keys.dtype, keys.shape[-1]), keys)
    base = indexer_scores(q, w, keys, rows)
    out = []
    for pool, form in ((keys, "bf16 keys"), (packed, "packed e4m3 keys")):
        for ch in (1, 2, 4):
            t = dict(INDEXER_TILE, CH=ch)
            out.append(time_tile({"queries": T, "entries": E, "form": form, "tile": t,
                                  "key_bytes": pool.numel() * pool.element_size()},
                                 lambda t=t, pool=pool: indexer_scores(q, w, pool, rows, t), base,
                                 "bits_equal_bf16_pool"))
    return out


def main(argv=None) -> None:
    from bench.runner import write_result
    from bench.timing import graph_time, time_tile
    from v4stack.kernels.triton_gemm import indexer_scores

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/indexer_fp8_h100.json")
    a = ap.parse_args(argv)
    rows_out = []
    tiles = [TILE, dict(TILE, BS=64), dict(TILE, num_warps=8)]
    for T, E in ((256, 4096), (64, 4096), (256, 1024)):
        q, w, keys, rows = case(T, E, "cuda")
        k8, ks = quantize(keys)
        base = indexer_scores(q, w, keys, rows).float()
        r = {"queries": T, "entries": E, "form": "bf16 keys (shipped)",
             "us": graph_time(lambda: indexer_scores(q, w, keys, rows)) * 1e6,
             "key_bytes": keys.numel() * keys.element_size()}
        print(r, flush=True)
        rows_out.append(r)
        ref = reference(q, w, k8, ks, rows)
        for t in tiles:
            r = time_tile({"queries": T, "entries": E, "form": "e4m3 keys + fp32 scale", "tile": t,
                           "key_bytes": k8.numel() + ks.numel() * 4},
                          lambda t=t: scores_fp8(q, w, k8, ks, rows, t), ref, "bits_equal_dequantised_fp32")
            if "error" not in r:  # how close, and how much of the bf16 keys' choice it keeps
                got = scores_fp8(q, w, k8, ks, rows, t)
                r["max_diff_vs_dequantised_fp32"] = float((got - ref).abs().max())
                r["top512_kept_vs_bf16"] = overlap(got, base, min(512, E))
                print({k: r[k] for k in ("max_diff_vs_dequantised_fp32", "top512_kept_vs_bf16")}, flush=True)
            rows_out.append(r)
    packed = [r for T, E in ((256, 4096), (64, 4096)) for r in packed_rows(T, E)]
    write_result(a.out, {"bench": "indexer_fp8", "device_name": torch.cuda.get_device_name(), "rows": rows_out,
                         "packed_rows": packed})


if __name__ == "__main__":
    main()
