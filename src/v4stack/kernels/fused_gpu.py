"""CUDA registrations of the fused decode-path ops (``ops/fused.py``): their contracts and the
Triton kernels of ``triton_mhc.py``, ``triton_route.py``, ``triton_ring.py`` and ``triton_sample.py``, in both modes (the kernels are row-local); and the existing
row-local mHC read / write kernels for fast mode as well."""

import importlib
import os

import torch


def hc_split_ok(mix, scale, base, n, iters, eps) -> bool:
    return (mix.is_cuda and mix.dtype == torch.float32 and mix.dim() == 2 and mix.stride(1) == 1
            and mix.shape[1] == n * n + 2 * n and n >= 1 and n & (n - 1) == 0 and 1 <= iters <= 64
            and scale.dtype == torch.float32 and base.dtype == torch.float32 and scale.is_contiguous()
            and base.is_contiguous() and scale.device == mix.device and base.device == mix.device)


def hc_pre_ok(x, fn, scale, base, n, iters, eps, norm_eps) -> bool:
    return (x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.dim() == 3
            and x.is_contiguous() and x.shape[1] == n and fn.dtype == torch.float32 and fn.is_contiguous()
            and tuple(fn.shape) == (n * n + 2 * n, x.shape[1] * x.shape[2]) and n >= 1 and n & (n - 1) == 0
            and n * n + 2 * n <= 64  # hc_mix's projection: one N tile
            and 1 <= iters <= 64 and scale.dtype == torch.float32 and base.dtype == torch.float32
            and scale.is_contiguous() and base.is_contiguous()
            and fn.device == x.device and scale.device == x.device and base.device == x.device)


def hc_pre_wide_ok(x, fn, scale, base, n, iters, eps, norm_eps) -> bool:
    """Fast mode's ``triton_wide.hc_pre``: bf16 streams (the weight's bf16 parts multiply them
    exactly), the weight fp32."""
    return x.dtype == torch.bfloat16 and hc_pre_ok(x, fn, scale, base, n, iters, eps, norm_eps)


# Most rows the fused coefficients-and-read launch takes: at decode sizes it is the faster (256 rows
# 14.7 against 15.2 us for the two launches on an H100), at a prefill's 4096 rows the slower (172.7
# against 141.9: its one program a row runs the partials' sum, the split and the read in turn);
# bench/results/wide_projections_h100.json, part read_norm.
READ_NORM_FUSED_ROWS = 256


def hc_pre_read_norm_wide_ok(x, fn, scale, base, n, iters, eps, norm_eps, weight, rms_eps) -> bool:
    """Fast mode's ``triton_wide.hc_pre_read_norm``: ``hc_pre_wide_ok``, a row read in one block,
    at most ``READ_NORM_FUSED_ROWS`` rows (more: the two launches)."""
    from v4stack.kernels.triton_rows import READ_NORM_ONE

    return (x.shape[0] <= READ_NORM_FUSED_ROWS and hc_pre_wide_ok(x, fn, scale, base, n, iters, eps, norm_eps)
            and x.shape[2] <= READ_NORM_ONE and _norm_weight_ok(x, weight)
            and (weight is None or weight.is_contiguous()))


def hc_head_read_norm_wide_ok(x, fn, scale, base, eps, norm_eps, weight, rms_eps) -> bool:
    """Fast mode's ``triton_wide.hc_head_read_norm``: ``hc_head_pre_wide_ok``, a row read in one
    block, at most ``READ_NORM_FUSED_ROWS`` rows (more: the separate launches)."""
    from v4stack.kernels.triton_rows import READ_NORM_ONE

    return (x.shape[0] <= READ_NORM_FUSED_ROWS and hc_head_pre_wide_ok(x, fn, scale, base, eps, norm_eps)
            and x.shape[2] <= READ_NORM_ONE and _norm_weight_ok(x, weight)
            and (weight is None or weight.is_contiguous()))


def hc_head_pre_wide_ok(x, fn, scale, base, eps, norm_eps) -> bool:
    """Fast mode's ``triton_wide.hc_head_pre``: bf16 streams, the rest as ``hc_head_pre_ok``."""
    return x.dtype == torch.bfloat16 and hc_head_pre_ok(x, fn, scale, base, eps, norm_eps)


def linear_widened_ok(x, w, wide) -> bool:
    """``triton_wide.linear_widened``: bf16 rows, a bf16 or fp32 weight of at most 64 rows widened
    to fp32."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] >= 1
            and w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float32) and w.stride(1) == 1
            and w.shape[1] == x.shape[1] and 1 <= w.shape[0] <= 64 and w.device == x.device
            and wide.dtype == torch.float32)


def swiglu_act_ok(gate, up, limit, weight, out_dtype) -> bool:
    fl = (torch.float32, torch.bfloat16, torch.float16)
    return (gate.is_cuda and gate.dim() == 2 and gate.dtype in fl and up.dtype in fl and gate.shape == up.shape
            and gate.is_contiguous() and up.is_contiguous() and up.device == gate.device and out_dtype in fl
            and (weight is None or (weight.dim() == 1 and weight.shape[0] == gate.shape[0] and weight.is_contiguous()
                                    and weight.dtype == torch.float32 and weight.device == gate.device)))


def hc_head_pre_ok(x, fn, scale, base, eps, norm_eps) -> bool:
    """Where the projection would run the project's ``hc_mix`` on the streams copied to fp32 (the
    kernel reads them as they are, widening each value: the same products)."""
    from v4stack import ops
    from v4stack.ops.dispatch import resolve

    if not (x.is_cuda and x.dim() == 3 and x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16,
                                                                                torch.float16)
            and 1 <= x.shape[1] <= 16 and x.shape[1] & (x.shape[1] - 1) == 0
            and fn.dtype == torch.float32 and fn.is_contiguous() and fn.device == x.device
            and tuple(fn.shape) == (x.shape[1], x.shape[1] * x.shape[2])
            and scale.dtype == torch.float32 and base.dtype == torch.float32 and scale.is_contiguous()
            and base.is_contiguous() and scale.device == x.device and base.device == x.device
            and base.shape[0] == x.shape[1]):
        return False
    flat = torch.empty(x.shape[0], fn.shape[1], dtype=torch.float32, device="meta")
    return resolve("hc_mix", ops.get_mode(), "float32", "cuda", flat, fn, norm_eps).name == "triton_hc_mix"


def _norm_weight_ok(x, weight) -> bool:
    """An RMS norm weight (or None) for rows of ``x [..., d]``."""
    return weight is None or (weight.dim() == 1 and weight.shape[0] == x.shape[-1] and weight.device == x.device
                              and weight.dtype in (torch.float32, torch.bfloat16, torch.float16))


def hc_read_norm_ok(x, pre, weight, eps) -> bool:
    fl = (torch.float32, torch.bfloat16, torch.float16)
    return (x.is_cuda and x.dim() == 3 and x.dtype in fl and 1 <= x.shape[1] <= 16 and x.shape[2] >= 1
            and pre.is_cuda and pre.dtype == torch.float32 and tuple(pre.shape) == tuple(x.shape[:2])
            and pre.device == x.device and _norm_weight_ok(x, weight))


def table_ok(table, positions, freqs) -> bool:
    return table is None or (table.dtype == torch.float32 and table.is_contiguous() and table.device == positions.device
                             and tuple(table.shape) == (positions.shape[0], 2, freqs.shape[0]))


def rope_table_ok(positions, freqs) -> bool:
    h = freqs.shape[0] if freqs.dim() == 1 else 0
    return (positions.is_cuda and positions.dim() == 1 and positions.dtype == torch.int64 and positions.is_contiguous()
            and freqs.dtype == torch.float64 and freqs.is_contiguous() and freqs.device == positions.device
            and 1 <= h <= 1024 and h & (h - 1) == 0)


def rope_ok(x, positions, freqs, inverse, table=None) -> bool:
    h = freqs.shape[0] if freqs.dim() == 1 else 0
    return (table_ok(table, positions, freqs) and x.is_cuda and x.dim() >= 2
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.is_contiguous() and positions.dim() == 1 and positions.shape[0] == x.shape[0]
            and positions.dtype == torch.int64 and positions.device == x.device and freqs.dtype == torch.float64
            and freqs.device == x.device and h >= 1 and h & (h - 1) == 0 and 2 * h <= x.shape[-1])


def greedy_draw_ok(logits) -> bool:
    return (logits.is_cuda and logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and logits.stride(1) == 1 and 0 < logits.shape[1] < 2**31)


def _gate_args_ok(T, E, dev, bias, table, token_ids, k) -> bool:
    return (1 <= E <= 1024 and 1 <= k <= min(E, 64)
            and (table is None) != (bias is None)
            and (bias is None or (bias.dtype == torch.float32 and bias.shape == (E,) and bias.is_contiguous()
                                  and bias.device == dev))
            and (table is None or (table.dtype in (torch.int32, torch.int64) and table.dim() == 2
                                   and table.shape[1] == k and table.is_contiguous() and table.device == dev
                                   and token_ids is not None and token_ids.dtype == torch.int64
                                   and token_ids.shape == (T,) and token_ids.is_contiguous()
                                   and token_ids.device == dev)))


def moe_gate_ok(logits, bias, table, token_ids, k, scale) -> bool:
    T = logits.shape[0] if logits.dim() == 2 else 0
    E = logits.shape[1] if logits.dim() == 2 else 0
    return (logits.is_cuda and logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1
            and _gate_args_ok(T, E, logits.device, bias, table, token_ids, k))


def router_ok(x, w, wide, bias, table, token_ids, k, scale) -> bool:
    """Fast mode's ``triton_wide.router``: ``linear_widened_ok`` rows and weight, ``moe_gate_ok``'s
    routing arguments for their logits."""
    return linear_widened_ok(x, w, wide) and _gate_args_ok(x.shape[0], w.shape[0], x.device, bias, table, token_ids, k)


def moe_route_ok(indices, weights, n_experts, joined=False) -> bool:
    return (indices.is_cuda and indices.dtype == torch.int64 and indices.dim() == 2 and indices.is_contiguous()
            and weights.dtype == torch.float32 and weights.shape == indices.shape and weights.is_contiguous()
            and weights.device == indices.device and 1 <= n_experts + joined <= 1024 and indices.numel() < 2**30)


def moe_unsort_combine_ok(out, rank, indices, shared, out_dtype, joined=False) -> bool:
    fl = (torch.float32, torch.bfloat16, torch.float16)
    P = indices.shape[0] * (indices.shape[1] + joined) if indices.dim() == 2 else -1
    return (out.is_cuda and out.dim() == 2 and out.dtype in fl and out.stride(1) == 1 and out.shape[0] == P
            and rank.dtype == torch.int64 and rank.shape == (P,) and rank.is_contiguous() and rank.device == out.device
            and indices.dtype == torch.int64 and indices.dim() == 2 and indices.is_contiguous()
            and indices.device == out.device and 1 <= indices.shape[1] + joined <= 64 and out_dtype in fl
            and (shared is None or (shared.dtype in fl and shared.shape == (indices.shape[0], out.shape[1])
                                    and shared.stride(1) == 1 and shared.device == out.device)))


def embed_streams_ok(ids, weight, n) -> bool:
    """Inference rows (no gradient to the table), 1-D integer ids beside a row-contiguous table."""
    return (weight.is_cuda and weight.dim() == 2 and weight.stride(1) == 1 and ids.dim() == 1
            and ids.dtype in (torch.int32, torch.int64) and ids.device == weight.device and 1 <= n <= 64
            and not (weight.requires_grad and torch.is_grad_enabled()) and weight.numel() < 2**40)


def rms_norm_pair_ok(a, wa, b, wb, eps) -> bool:
    """Two row sets of one token count whose norms the project's row kernel would run."""
    from v4stack import ops
    from v4stack.ops.dispatch import resolve

    m, fmt = ops.get_mode(), str(a.dtype)[6:]
    return (a.is_cuda and a.dim() == 2 and b.dim() == 2 and a.shape[0] == b.shape[0] and a.dtype == b.dtype
            and a.stride(1) == 1 and b.stride(1) == 1 and b.device == a.device
            and wa is not None and wb is not None and wa.shape == a.shape[1:] and wb.shape == b.shape[1:]
            and resolve("rms_norm", m, fmt, "cuda", a, wa, eps).name == "triton_rms_norm"
            and resolve("rms_norm", m, fmt, "cuda", b, wb, eps).name == "triton_rms_norm")


def moe_hc_write_ok(x, out, rank, indices, joined, post, comb) -> bool:
    """The composition's two ops would run ``moe_unsort_combine``'s kernel and ``hc_write``'s (whose
    arithmetic the fused kernel runs); their own accept checks, asked through dispatch, hold the
    shapes, dtypes and devices."""
    from v4stack import ops
    from v4stack.ops.dispatch import resolve

    if not (x.is_cuda and x.dim() == 3 and out.dim() == 2 and indices.dim() == 2 and indices.shape[0] == x.shape[0]):
        return False
    m = ops.get_mode()
    # the combined rows' shape for hc_write's check: the first T rows of ``out`` are [T, d] like them
    return (resolve("moe_unsort_combine", m, str(out.dtype)[6:], "cuda", out, rank, indices, None, x.dtype,
                    joined).name == "triton_moe_unsort_combine"
            and resolve("hc_write", m, str(x.dtype)[6:], "cuda", x, out[: x.shape[0]], post, comb).name
            == "triton_hc_write")


def moe_route_rows_ok(x, indices, weights, n_experts, joined, dtype) -> bool:
    """A decode step's pairs (one block of ``route_kernel``) whose routing dispatch would run
    ``moe_route``'s kernel, and rows of ``x`` the kernel can copy."""
    from v4stack import ops
    from v4stack.kernels.triton_route import ROUTE_ONE
    from v4stack.ops.dispatch import resolve

    fl = (torch.float32, torch.bfloat16, torch.float16)
    if not (x.is_cuda and x.dim() == 2 and indices.dim() == 2 and x.shape[0] == indices.shape[0]):
        return False
    P = indices.shape[0] * (indices.shape[1] + joined)
    return (x.dtype in fl and dtype in fl and x.stride(1) == 1 and x.device == indices.device and 0 < P <= ROUTE_ONE
            and x.shape[1] > 0 and x.numel() < 2**31
            and resolve("moe_route", ops.get_mode(), str(weights.dtype)[6:], "cuda", indices, weights, n_experts,
                        joined).name == "triton_moe_route")


def fp4_round_ok(x, block) -> bool:
    D = x.shape[-1] if x.dim() else 0
    return (x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.is_contiguous()
            and not x.requires_grad and 0 < D <= 4096 and block > 0 and block & (block - 1) == 0)


def kv_round_ok(kv, rope_dims, block) -> bool:
    return fp4_round_ok(kv, block) and 0 < rope_dims < kv.shape[-1]


def pack_keys_into_ok(new, pool, dest) -> bool:
    from v4stack.ops.fp8_keys import width  # here: the ops package imports this module while it loads

    D = new.shape[1] if new.dim() == 2 else -1
    return (new.is_cuda and new.dim() == 2 and new.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and new.stride(1) == 1 and D >= 16 and D & (D - 1) == 0 and pool.dtype == torch.uint8
            and pool.is_contiguous() and pool.shape[-1] == width(D) and pool.device == new.device
            and dest.dtype == torch.int64 and dest.shape == (new.shape[0],) and dest.is_contiguous()
            and dest.device == new.device)


def tail_write_ok(kv, score, ape, positions, ratio, ring_kv, ring_score, dest, cd) -> bool:
    fl = (torch.float32, torch.bfloat16, torch.float16)
    dev = kv.device
    N = kv.shape[0] if kv.dim() == 2 else -1
    W = kv.shape[1] if kv.dim() == 2 else -1
    return (kv.is_cuda and kv.dim() == 2 and kv.dtype in fl and kv.stride(1) == 1 and score.shape == kv.shape
            and score.dtype in fl and score.stride(1) == 1 and score.device == dev and cd == torch.float32
            and ape.dtype == torch.float32 and ape.shape == (ratio, W) and ape.is_contiguous() and ape.device == dev
            and positions.dtype == torch.int64 and positions.shape == (N,) and positions.is_contiguous()
            and positions.device == dev and dest.dtype == torch.int64 and dest.shape == (N,) and dest.is_contiguous()
            and dest.device == dev
            and all(r.dtype == torch.float32 and r.dim() == 3 and r.shape[-1] == W and r.is_contiguous()
                    and r.device == dev for r in (ring_kv, ring_score)))


def rope_pair_ok(q, kv, positions, freqs, pool, dest, table=None) -> bool:
    """``triton_mhc.rope_pair``: where ``rope_`` would take ``q`` and ``rope_into`` would take ``kv``
    (one row a token), each by its kernel - so the pair's bits are theirs."""
    return (kv.dim() == 2 and q.device == kv.device and rope_ok(q, positions, freqs, False, table)
            and rope_into_ok(kv, positions, freqs, pool, dest, table))


def rope_into_ok(x, positions, freqs, pool, dest, table=None) -> bool:
    T = x.shape[0] if x.dim() else -1
    return (rope_ok(x, positions, freqs, False, table) and pool.dtype == x.dtype and pool.dim() == 2
            and pool.is_contiguous() and pool.device == x.device and T > 0 and pool.shape[1] * T == x.numel()
            and dest.dtype == torch.int64 and dest.shape == (T,) and dest.is_contiguous() and dest.device == x.device)


def group_linear_ok(x, w) -> bool:
    return (x.is_cuda and isinstance(w, torch.Tensor) and w.is_cuda and x.dim() == 3 and w.dim() == 3
            and x.dtype == w.dtype and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.shape[1] == w.shape[0] > 0 and x.shape[2] == w.shape[2] and x.device == w.device)


def group_linear_rows(x, w):
    """``group_linear`` (``x [T, g, k]``, ``w [g, r, k]``) as one grouped GEMM: group i's rows
    ``x[:, i]`` are "expert" i's rows of ``ops.grouped_linear`` (invariant mode: a row's bits do
    not depend on how many rows there are), instead of g GEMM launches of r columns each."""
    from v4stack import ops

    T, g, k = x.shape
    if T == 0:
        return x.new_empty(0, g * w.shape[1])
    rows = x.transpose(0, 1).reshape(g * T, k)
    offsets = torch.arange(0, (g + 1) * T, T, device=x.device, dtype=torch.int64)
    y = ops.grouped_linear(rows, w, offsets)
    return y.view(g, T, -1).transpose(0, 1).reshape(T, -1)


GROUP_TILE = dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4, occ=2)  # the engine's grouped tile at 256 rows
GROUP_TMA = os.environ.get("V4STACK_GROUP_TMA") != "0"  # 0: invariant wo_a keeps the gathered rows (A/B runs)


def group_linear_inplace_ok(x, w) -> bool:
    """From 64 rows (below, the copies are small and the grouped table's narrow tiles serve), bf16 /
    fp16 on Hopper, TMA's terms (``V4STACK_GROUP_TMA=0``: never, for A/B runs)."""
    from v4stack.kernels import triton_grouped_tma as tma

    return (GROUP_TMA and group_linear_ok(x, w) and x.shape[0] >= 64 and tma.group_usable(x, w, GROUP_TILE["BK"])
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def group_linear_inplace(x, w):
    """Invariant ``group_linear`` with each group's rows read where they lie (``x`` as ``[T, g k]``,
    column ``i k`` for group i; ``triton_grouped_tma.group_linear_tma``) and the result written in
    its final layout: the K chains of ``group_linear_rows`` (every grouped tile gives a row the same
    bits) without its two copies (``python -m bench.group_linear_inplace``: 36.6 against 82.2 us at 256
    rows on an H100, ``bench/results/group_linear_inplace_h100_456015c.json``)."""
    from v4stack.kernels import triton_grouped_tma as tma

    return tma.group_linear_tma(x, w, GROUP_TILE)


def _ints(*ts) -> bool:
    return all(t.is_cuda and t.dtype == torch.int64 and t.is_contiguous() and t.device == ts[0].device for t in ts)


def ring_rows_ok(positions, slots, R, W) -> bool:
    return (_ints(positions, slots) and positions.dim() == 1 and slots.shape == positions.shape and R >= 1
            and 0 <= W <= 4096)


def ring_capture_ok(pool, snap, slots, seq, pos, slot, R, fill) -> bool:
    fl = (torch.float32, torch.bfloat16, torch.float16)
    return (_ints(slots, seq, pos, slot) and pool.is_cuda and pool.device == slots.device and pool.dim() == 2
            and pool.is_contiguous() and pool.dtype in fl and snap.dtype in fl and snap.dim() == 3
            and snap.is_contiguous() and snap.device == pool.device and R >= 1 and snap.shape[1:] == (R, pool.shape[1])
            and slots.dim() == 1 and seq.dim() == 1 and pos.shape == seq.shape and slot.shape == seq.shape)


def closing_rows_ok(kv_pool, score_pool, slots, seq, entry, R, m, lookback, coff, c) -> bool:
    fl = (torch.float32, torch.bfloat16, torch.float16)
    return (_ints(slots, seq, entry) and kv_pool.is_cuda and kv_pool.device == slots.device and kv_pool.dim() == 2
            and kv_pool.is_contiguous() and kv_pool.dtype in fl and score_pool.shape == kv_pool.shape
            and score_pool.dtype in fl and score_pool.is_contiguous() and score_pool.device == kv_pool.device
            and coff in (1, 2) and c >= 1 and kv_pool.shape[1] == coff * c and R >= 1 and m >= 1 and lookback >= 0
            and seq.dim() == 1 and entry.shape == seq.shape)


def entry_rows_ok(table, positions, ratio, per, E) -> bool:
    return (_ints(table, positions) and table.dim() == 2 and positions.dim() == 1
            and table.shape[0] == positions.shape[0] and table.shape[1] >= 1 and ratio >= 1 and per >= 1 and E >= 0)


def feed_ids_ok(ids, src, fed) -> bool:
    return (ids.is_cuda and ids.dim() == 1 and src.shape == ids.shape and fed.dim() == 1
            and ids.dtype == src.dtype == fed.dtype == torch.int64 and ids.is_contiguous() and src.is_contiguous()
            and src.device == ids.device == fed.device)


def layout_in_ok(buf, staging, fed, R) -> bool:
    """The kernel reads the staging through the device's mapping of pinned host memory."""
    return (buf.is_cuda and staging.device.type == "cpu" and staging.is_pinned() and fed.device == buf.device
            and buf.dim() == staging.dim() == fed.dim() == 1 and buf.shape == staging.shape
            and buf.dtype == staging.dtype == fed.dtype == torch.int64 and buf.is_contiguous()
            and staging.is_contiguous() and 0 <= 5 * R <= buf.shape[0])


def topk_rows_ok(scores, rows, k) -> bool:
    from v4stack.kernels.triton_select import MAX_ENTRIES

    return (scores.is_cuda and scores.dim() == 2 and scores.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and scores.stride(1) == 1 and rows.dtype == torch.int64 and rows.shape == scores.shape and rows.stride(1) == 1
            and rows.device == scores.device and 1 <= k <= scores.shape[1] <= MAX_ENTRIES)


refused: dict[str, str] = {}  # op -> why its kernel failed to build or run (then the reference serves)


def _guarded(op: str, kernel, reference):
    """``kernel``, or ``reference`` for the rest of the process once the kernel has raised (a
    Triton build this machine refuses); ``refused`` says why."""
    def call(*args):
        if op not in refused:
            try:
                return kernel(*args)
            except Exception as e:  # noqa: BLE001  (any build or launch error)
                refused[op] = f"{type(e).__name__}: {e}"[:500]
        return reference(*args)

    call.__name__ = getattr(kernel, "__name__", op)
    return call


def register_all(register) -> None:
    from v4stack.kernels.gpu import _lazy, _with

    def ref(name):
        return lambda *a: getattr(importlib.import_module("v4stack.ops.fused"), name)(*a)

    register("hc_split", "triton_hc_split", _guarded("hc_split", _lazy("triton_mhc", "hc_split"),
             ref("hc_split_reference")), device="cuda", accepts=_with("triton", hc_split_ok))
    register("hc_pre", "triton_hc_pre", _guarded("hc_pre", _lazy("triton_mhc", "hc_pre"), ref("hc_pre_reference")),
             device="cuda", accepts=_with("triton", hc_pre_ok))
    # fast mode: the projections of half rows with bf16 parts of the weight (triton_wide.py), ahead
    # of the 3xTF32 slice kernels both modes share
    register("hc_pre", "triton_hc_pre_wide", _guarded("hc_pre_wide", _lazy("triton_wide", "hc_pre"),
             ref("hc_pre_reference")), mode="fast", device="cuda", accepts=_with("triton", hc_pre_wide_ok))
    register("hc_pre_read_norm", "triton_hc_pre_read_norm_wide", _guarded("hc_pre_read_norm_wide",
             _lazy("triton_wide", "hc_pre_read_norm"), ref("hc_pre_read_norm_reference")), mode="fast", device="cuda",
             accepts=_with("triton", hc_pre_read_norm_wide_ok))
    register("hc_head_read_norm", "triton_hc_head_read_norm_wide", _guarded("hc_head_read_norm_wide",
             _lazy("triton_wide", "hc_head_read_norm"), ref("hc_head_read_norm_reference")), mode="fast",
             device="cuda", accepts=_with("triton", hc_head_read_norm_wide_ok))
    register("hc_head_pre", "triton_hc_head_pre_wide", _guarded("hc_head_pre_wide",
             _lazy("triton_wide", "hc_head_pre"), ref("hc_head_pre_reference")), mode="fast", device="cuda",
             accepts=_with("triton", hc_head_pre_wide_ok))
    register("router", "triton_router_wide", _guarded("router_wide", _lazy("triton_wide", "router"),
             ref("router_reference")), mode="fast", device="cuda", accepts=_with("triton", router_ok))
    register("linear_widened", "triton_linear_widened", _guarded("linear_widened",
             _lazy("triton_wide", "linear_widened"), ref("linear_widened_reference")), mode="fast", device="cuda",
             accepts=_with("triton", linear_widened_ok))
    # fast mode too: the row-local mHC read / write kernels measured faster than the torch
    # composition at every size (bench/results/ops_h200.json: invariant/fast 0.05-0.52), in one
    # launch each instead of 4-6
    from v4stack.kernels import contracts as C

    register("hc_read", "triton_hc_read", _lazy("triton_rows", "hc_read", "row_mix"), mode="fast", device="cuda",
             accepts=_with("triton", C.hc_read))
    register("hc_write", "triton_hc_write", _lazy("triton_rows", "hc_write", "row_mix"), mode="fast", device="cuda",
             accepts=_with("triton", C.hc_write))
    # each: its Triton kernel (module, function of the op's name), its accepts check ``<op>_ok``, and
    # ``ops.fused.<op>_reference`` for the rest of the process should the kernel not build
    register("rms_norm_pair", "triton_rms_norm_pair", _guarded("rms_norm_pair", _lazy("triton_rows", "rms_norm_pair"),
             ref("rms_norm_pair_reference")), device="cuda", accepts=_with("triton", rms_norm_pair_ok))
    register("moe_hc_write", "triton_moe_hc_write", _guarded("moe_hc_write", _lazy("triton_route", "moe_hc_write"),
             ref("moe_hc_write_reference")), mode="fast", device="cuda", accepts=_with("triton", moe_hc_write_ok))
    for op, module in (("swiglu_act", "triton_mhc"), ("hc_head_pre", "triton_mhc"), ("hc_read_norm", "triton_rows"),
                       ("rope", "triton_mhc"), ("moe_gate", "triton_route"), ("moe_route", "triton_route"),
                       ("moe_route_rows", "triton_route"), ("embed_streams", "triton_rows"),
                       ("moe_unsort_combine", "triton_route"), ("tail_write", "triton_ring"),
                       ("kv_round", "triton_round"), ("fp4_round", "triton_round"), ("pack_keys_into", "triton_ring")):
        register(op, f"triton_{op}", _guarded(op, _lazy(module, op), ref(f"{op}_reference")), device="cuda",
                 accepts=_with("triton", globals()[f"{op}_ok"]))
    # invariant mode's wo_a: one grouped GEMM per call instead of one GEMM per group
    register("group_linear", "grouped_rows", group_linear_rows, mode="invariant", device="cuda",
             accepts=_with("triton", group_linear_ok))
    register("group_linear", "grouped_in_place", group_linear_inplace, mode="invariant", device="cuda",
             accepts=_with("triton", group_linear_inplace_ok), first=True)
    register("rope_", "triton_rope_inplace", _guarded("rope_", _lazy("triton_mhc", "rope_"),
             ref("rope_inplace_reference")), device="cuda", accepts=_with("triton", rope_ok))
    register("rope_table", "triton_rope_table", _guarded("rope_table", _lazy("triton_mhc", "rope_table"),
             ref("rope_table_reference")), device="cuda", accepts=_with("triton", rope_table_ok))
    register("rope_into", "triton_rope_into", _guarded("rope_into", _lazy("triton_mhc", "rope_into"),
             ref("rope_into_reference")), device="cuda", accepts=_with("triton", rope_into_ok))
    register("rope_pair", "triton_rope_pair", _guarded("rope_pair", _lazy("triton_mhc", "rope_pair"),
             ref("rope_pair_reference")), device="cuda", accepts=_with("triton", rope_pair_ok))
    register("ring_rows", "triton_ring_rows", _guarded("ring_rows", _lazy("triton_layout", "ring_rows"),
             ref("ring_rows_reference")), device="cuda", accepts=_with("triton", ring_rows_ok))
    register("ring_capture", "triton_ring_capture", _guarded("ring_capture", _lazy("triton_ring", "ring_capture"),
             ref("ring_capture_reference")), device="cuda", accepts=_with("triton", ring_capture_ok))
    register("closing_rows", "triton_closing_rows", _guarded("closing_rows", _lazy("triton_ring", "closing_rows"),
             ref("closing_rows_reference")), device="cuda", accepts=_with("triton", closing_rows_ok))
    register("entry_rows", "triton_entry_rows", _guarded("entry_rows", _lazy("triton_layout", "entry_rows"),
             ref("entry_rows_reference")), device="cuda", accepts=_with("triton", entry_rows_ok))
    register("feed_ids", "triton_feed_ids", _guarded("feed_ids", _lazy("triton_layout", "feed_ids"),
             ref("feed_ids_reference")), device="cuda", accepts=_with("triton", feed_ids_ok))
    register("layout_in", "triton_layout_in", _guarded("layout_in", _lazy("triton_layout", "layout_in"),
             ref("layout_in_reference")), device="cuda", accepts=_with("triton", layout_in_ok))
    register("topk_rows", "triton_topk_rows", _guarded("topk_rows", _lazy("triton_select", "topk_rows"),
             ref("topk_rows_reference")), device="cuda", accepts=_with("triton", topk_rows_ok))
    register("greedy_draw", "triton_greedy_draw", _guarded("greedy_draw", _lazy("triton_sample", "greedy_draw"),
             ref("greedy_draw_reference")), device="cuda", accepts=_with("triton", greedy_draw_ok))
