"""Composite steps of the model as ops, so a device can run each as one kernel.

- ``hc_split(mix, scale, base, n, iters, eps)``: mHC's coefficients from its projection ``mix [N,
  n^2 + 2n]``: ``pre = sigmoid(mix[:n] s0 + b) + eps``, ``post = 2 sigmoid(mix[n:2n] s1 + b)`` and
  ``comb`` = Sinkhorn of ``mix[2n:] s2 + b`` viewed ``[n, n]``.
- ``group_linear(x, w)``: V4's grouped output projection ``wo_a`` (one GEMM per group, then
  concatenated); fast mode on CUDA runs it as one batched GEMM.
- ``hc_pre(x, fn, scale, base, n, iters, eps, norm_eps)``: the projection and ``hc_split`` from
  the streams ``x [N, n, d]`` (one pair of kernels on CUDA).
- ``hc_head_pre(x, fn, scale, base, eps, norm_eps)``: the hyper-connection head's stream weights
  ``sigmoid(hc_mix(x) * scale + base) + eps`` from the streams (two kernels on CUDA, the streams
  read in the projection's kernel instead of copied to fp32 first).
- ``hc_read_norm(x, pre, weight, eps)``: a sublayer's input, ``rms_norm(hc_read(x, pre), weight,
  eps)`` (``triton_rows.py``: one row kernel, the read never written).
- ``hc_pre_read_norm(x, fn, scale, base, n, iters, eps, norm_eps, weight, rms_eps)``: the two
  above, the input and post, comb returned (fast mode on CUDA: the coefficients' finish and the
  read in one launch).
- ``hc_head_read_norm(x, fn, scale, base, eps, norm_eps, weight, rms_eps)``: ``hc_head_pre`` then
  ``hc_read_norm``, the output head's normalised input (fast mode on CUDA: the finish, the weights
  and the read in one launch).
- ``embed_streams(ids, weight, n)``: the mHC streams' first copies, each token's embedding row in
  all ``n`` streams (one kernel on CUDA instead of a gather and a concatenation).
- ``swiglu_act(gate, up, limit, weight, out_dtype)``: the experts' clamped SwiGLU activation
  (times the routing weight) between their GEMMs, one kernel on CUDA.
- ``rms_norm_pair(a, wa, b, wb, eps)``: two weighted RMS norms (a layer's query and KV
  projections') in one launch on CUDA, each norm's bits.
- ``moe_hc_write(x, out, rank, indices, joined, post, comb)``: ``hc_write`` of the MoE sublayer's
  output made from the experts' sorted outputs by ``moe_unsort_combine`` (fast mode on CUDA: the
  combine inside the write's kernel, never stored).
- ``rope(x, positions, freqs, inverse)``: the interleaved rotation of ``x``'s last ``2 *
  len(freqs)`` channels by ``positions * freqs`` (``model/rope.py``).
- ``moe_gate(logits, bias, table, token_ids, k, scale)``: the router after its projection:
  ``sqrt(softplus)`` scores, top-k of ``score + bias`` (or a hash layer's table), normalised
  weights (``triton_route.py``: one kernel instead of ~8).
- ``moe_route(indices, weights, n_experts)``: the (token, slot) pairs stably sorted by expert:
  the grouped GEMM's row offsets, the pair order, each sorted pair's token and weight (one
  counting-sort kernel instead of a radix sort and ~5 index kernels).
- ``moe_route_rows(x, indices, weights, n_experts, joined, dtype)``: ``moe_route`` and the sorted
  pairs' rows ``x[tok].to(dtype)``, the grouped GEMM's inputs (a decode step's pairs on CUDA: one
  kernel instead of the route's and torch's gather).
- ``moe_unsort_combine(out, rank, indices, shared, out_dtype)``: the sorted expert outputs back
  per token, ``moe_combine``'d, plus the shared expert, in the model's dtype (one kernel on CUDA).
- ``tail_write(kv, score, ape, positions, ratio, ring_kv, ring_score, dest, cd)``: a compressor's
  decode-step projections into its tail rings (``triton_ring.py``: one kernel instead of ~7).
- ``ring_capture(pool, snap, slots, seq, pos, slot, R, fill)``: a decode step's boundary captures
  of one ring into their snapshot slots (``triton_ring.py``: one kernel instead of ~10).
- ``closing_rows(kv_pool, score_pool, slots, seq, entry, R, m, lookback, coff, c)``: the rows a
  decode step's closing entries pool, from their tail rings (``triton_ring.py``: one kernel
  instead of ~12).
- ``rope_table(positions, freqs)``: the cosines and sines a step's rotations share (one kernel a
  step instead of the fp64 functions in every rotation's programs).
- ``rope_pair(q, kv, positions, freqs, pool, dest, table)``: ``rope_`` of a decode step's queries
  and ``rope_into`` of its window rows, one launch on CUDA.
- ``rope_(x, positions, freqs, inverse, table)``: ``rope`` in place (a decode step's queries and
  attention outputs: the kernel reads and writes the rotated tail only).
- ``rope_into(x, positions, freqs, pool, dest)``: ``rope`` written straight into rows of a pool
  (the window ring of a decode step; one kernel instead of two).
- ``ring_rows(positions, slots, R, W)``, ``entry_rows(table, positions, ratio, per, E)``: a
  decode step's ring destinations, window rows and compressed-entry rows, the index tensors its
  layers share (``triton_layout.py``: one kernel each instead of ~3-17 integer kernels).
- ``feed_ids(ids, src, fed)``: a decode step's token ids from the previous step's device draws
  where ``src >= 0`` (``ids[t] = fed[src[t]]``, in place; ``triton_layout.py``: one kernel).
- ``layout_in(buf, staging, fed, R)``: a static decode step's layout copied from its staging into
  ``buf`` and its ids fed (``feed_ids``); on CUDA from pinned staging, one kernel that reads host
  memory (no copy-engine transfer in the step's graph).
- ``topk_rows(scores, rows, k)``: the indexer's top-k as pool rows in entry order
  (``triton_select.py``: one kernel instead of a radix sort, a sort and two gathers).
- ``normed_sparse_attention(q, pools, idx, sink, scale, eps)``: the sparse attention of
  per-head RMS-normalised queries (fast mode's many-row kernel normalises the queries it loads;
  ``normalises_queries(q)`` says where, so the caller skips its own pass).
- ``router(x, w, wide, bias, table, token_ids, k, scale)``: ``moe_gate`` of ``linear_widened``
  (fast mode on CUDA: the logits' partials summed in the gate's kernel).
- ``linear_widened(x, w, wide)``: a narrow fp32 projection of half rows (the router's logits):
  ``linear(x.to(wide.dtype), wide)``; fast mode on CUDA reads the rows unwidened (``triton_wide.py``).
- ``greedy_draw(logits)``: a decode step's greedy tokens and their log-probabilities from the
  logits ``[B, V]`` in one pass (the sampler's all-greedy path on CUDA; ``triton_sample.py``).

The references compose the other ops exactly as the model did before these ops existed (so every
CPU result keeps its bits, in both modes); on CUDA the fused Triton kernels of
``v4stack.kernels.triton_mhc`` serve both modes (each row computed alone, so batch-invariant); fast
mode's ``hc_pre`` and ``linear_widened`` on half rows run ``triton_wide``'s kernels (fp32-accurate,
row-local, other bits than invariant mode's).
"""

from __future__ import annotations

import torch

from v4stack import ops
from v4stack.ops import fp8_keys, quantized
from v4stack.ops.dispatch import call, register, resolve


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project ``[..., n, n]`` logits onto (approximately) doubly-stochastic matrices.

    Row-softmax (+eps) and a column normalisation first, then ``iters - 1`` rounds of row then
    column normalisation.
    """
    m = ops.softmax(logits, dim=-1) + eps
    m = m / (ops.sum(m, -2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (ops.sum(m, -1, keepdim=True) + eps)
        m = m / (ops.sum(m, -2, keepdim=True) + eps)
    return m


def hc_split_reference(mix, scale, base, n: int, iters: int, eps: float):
    base, scale = base.to(mix.dtype), scale.to(mix.dtype)
    pre = ops.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * ops.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = (mix[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n)
    return pre, post, sinkhorn(comb, iters, eps)


def hc_pre_reference(x, fn, scale, base, n: int, iters: int, eps: float, norm_eps: float):
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    mix = ops.hc_mix(x.reshape(x.shape[0], -1).to(cd), fn.to(cd), norm_eps)
    return hc_split(mix, scale, base, n, iters, eps)


def swiglu_act_reference(gate, up, limit: float, weight, out_dtype):
    cd = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u = gate.to(cd), up.to(cd)
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    act = ops.silu(g) * u
    if weight is not None:
        act = act * weight.to(cd).unsqueeze(-1)
    return act.to(out_dtype)


def rms_norm_pair_reference(a, wa, b, wb, eps: float):
    return ops.rms_norm(a, wa, eps), ops.rms_norm(b, wb, eps)


def moe_hc_write_reference(x, out, rank, indices, joined: bool, post, comb):
    return ops.hc_write(x, moe_unsort_combine(out, rank, indices, None, x.dtype, joined), post, comb)


def hc_head_pre_reference(x, fn, scale, base, eps: float, norm_eps: float):
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32  # the model's compute dtype
    mix = ops.hc_mix(x.reshape(x.shape[0], -1).to(cd), fn.to(cd), norm_eps)
    return ops.sigmoid(mix * scale.to(mix.dtype) + base.to(mix.dtype)) + eps


def hc_read_norm_reference(x, pre, weight, eps: float):
    return ops.rms_norm(ops.hc_read(x, pre), weight, eps)


def hc_head_read_norm_reference(x, fn, scale, base, eps: float, norm_eps: float, weight, rms_eps: float):
    return hc_read_norm(x, hc_head_pre(x, fn, scale, base, eps, norm_eps), weight, rms_eps)  # each op dispatched


def hc_pre_read_norm_reference(x, fn, scale, base, n: int, iters: int, eps: float, norm_eps: float, weight,
                               rms_eps: float):
    pre, post, comb = hc_pre(x, fn, scale, base, n, iters, eps, norm_eps)  # each op as its own dispatch serves it
    return hc_read_norm(x, pre, weight, rms_eps), post, comb


def rope_reference(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool) -> torch.Tensor:
    r = 2 * freqs.shape[0]
    ang = positions.to(torch.float64).unsqueeze(-1) * freqs
    calc = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = ops.cos(ang).to(calc), ops.sin(ang).to(calc)
    shape = [positions.shape[0]] + [1] * (x.dim() - 2) + [r // 2]
    cos, sin = cos.view(shape), sin.view(shape)
    if inverse:
        sin = -sin
    head, tail = x[..., :-r], x[..., -r:]
    t = tail.to(cos.dtype).unflatten(-1, (r // 2, 2))
    a, b = t[..., 0], t[..., 1]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((head, rot.to(x.dtype)), dim=-1)


def group_linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.cat([ops.linear(x[:, i], w[i]) for i in range(w.shape[0])], dim=-1)


def _group_linear_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One batched GEMM over the groups, written straight into the ``[T, G * r]`` result (group g's
    rows at columns ``[g r, (g + 1) r)``: the GEMM's output leading dimension is ``G r``), so no
    copy follows it."""
    T, G, _ = x.shape
    r = w.shape[1]
    y = torch.empty(T, G * r, dtype=x.dtype, device=x.device)
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=y.view(T, G, r).transpose(0, 1))
    return y


def linear_widened_reference(x: torch.Tensor, w: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
    return ops.linear(x.to(wide.dtype), wide)


def greedy_draw_reference(logits: torch.Tensor):
    raw = logits.float()
    tok = torch.argmax(raw, dim=-1)
    lp = raw.gather(1, tok[:, None])[:, 0] - torch.logsumexp(raw, -1)
    return tok, torch.stack([tok.double(), lp.double(), lp.clamp(max=0.0).double()], 1)


def moe_gate_reference(logits, bias, table, token_ids, k: int, scale: float):
    scores = ops.softplus(logits).sqrt()
    if table is not None:
        idx = table[token_ids].long()
    else:
        idx = ops.topk(scores + bias.to(scores.dtype), k)[1]
    w = scores.gather(1, idx)
    return idx, w / ops.sum(w, -1, keepdim=True) * scale


def router_reference(x, w, wide, bias, table, token_ids, k: int, scale: float):
    return moe_gate(linear_widened(x, w, wide), bias, table, token_ids, k, scale)  # each op as its dispatch serves it


def moe_route_reference(indices: torch.Tensor, weights: torch.Tensor, n_experts: int, joined: bool = False):
    if joined:
        indices = torch.nn.functional.pad(indices, (0, 1), value=n_experts)
        weights = torch.nn.functional.pad(weights, (0, 1), value=1.0)
        n_experts += 1
    k = indices.shape[1]
    ids, order = torch.sort(indices.reshape(-1), stable=True)  # by expert, then pair id (token * k + slot)
    # row offsets without a host sync (bincount would read the max on the host)
    offsets = torch.searchsorted(ids, torch.arange(n_experts + 1, device=indices.device))
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.shape[0], device=order.device)
    return offsets, order, rank, order // k, weights.reshape(-1)[order]


def embed_streams_reference(ids: torch.Tensor, weight: torch.Tensor, n: int) -> torch.Tensor:
    e = torch.nn.functional.embedding(ids, weight).unsqueeze(1)
    return torch.cat([e] * n, 1)  # the copies (a broadcast copy runs ~2.6x slower on CUDA)


def moe_route_rows_reference(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, n_experts: int,
                             joined: bool, dtype):
    off, order, rank, tok, ws = moe_route(indices, weights, n_experts, joined)  # as its own dispatch serves it
    return off, order, rank, tok, ws, x[tok].to(dtype)


def rope_inplace_reference(x, positions, freqs, inverse: bool, table=None) -> torch.Tensor:
    return x.copy_(rope(x, positions, freqs, inverse))


def rope_table_reference(positions, freqs) -> torch.Tensor:
    ang = positions.to(torch.float64).unsqueeze(-1) * freqs
    return torch.stack((ops.cos(ang), ops.sin(ang)), 1).to(torch.float32)


def rope_into_reference(x, positions, freqs, pool, dest, table=None) -> None:
    pool.index_copy_(0, dest, rope(x, positions, freqs, False).reshape(x.shape[0], -1).to(pool.dtype))


def rope_pair_reference(q, kv, positions, freqs, pool, dest, table=None) -> torch.Tensor:
    rope_into(kv, positions, freqs, pool, dest, table)  # each op dispatched
    return rope_(q, positions, freqs, False, table)


def tail_write_reference(kv, score, ape, positions, ratio: int, ring_kv, ring_score, dest, cd) -> None:
    kv, score = kv.to(cd), score.to(cd) + ape.to(cd)[positions % ratio]
    for ring, new in ((ring_kv, kv), (ring_score, score)):
        ring.view(-1, ring.shape[-1]).index_copy_(0, dest, new.to(ring.dtype))


def kv_round_reference(kv, rope_dims: int, block: int):
    r = rope_dims
    return torch.cat((quantized.fp8_round(kv[..., :-r], block), kv[..., -r:]), dim=-1)


def fp4_round_reference(x, block: int):
    return quantized.fp4_round(x, block)


def pack_keys_into_reference(new, pool, dest) -> None:
    pool.view(-1, pool.shape[-1]).index_copy_(0, dest, fp8_keys.pack(new))


def _ring_gather(pool, slots, seq, q, R: int, fill: float):
    """Rows of ``pool [S * R, D]`` holding positions ``q [n, L]`` in the rings of state slots
    ``slots[seq]`` (``R`` rows a slot, row ``q % R``), ``fill`` before position 0."""
    idx = torch.where(q >= 0, slots[seq].unsqueeze(1) * R + q % R, -1)
    rows = pool[idx.clamp(min=0)]
    return torch.where((idx >= 0).unsqueeze(-1), rows, torch.full((), fill, dtype=rows.dtype, device=rows.device))


def ring_capture_reference(pool, snap, slots, seq, pos, slot, R: int, fill: float) -> None:
    q = pos.unsqueeze(1) - R + torch.arange(R, device=pos.device)
    snap[slot.unsqueeze(1), q % R] = _ring_gather(pool, slots, seq, q, R, fill).to(snap.dtype)


def overlap_halves(rows: torch.Tensor, m: int, c: int) -> torch.Tensor:
    """An overlapped compressor's pooled rows ``[n, 2m, 2c]`` -> ``[n, 2m, c]``: the previous block's
    ``m`` rows from channels ``[0, c)``, the entry's own ``m`` from ``[c, 2c)``."""
    return torch.cat((rows[:, :m, :c], rows[:, m:, c:]), dim=1)


def closing_rows_reference(kv_pool, score_pool, slots, seq, entry, R: int, m: int, lookback: int, coff: int, c: int):
    q = entry.unsqueeze(1) * m - lookback + torch.arange(coff * m, device=entry.device)
    out = []
    for pool, fill in ((kv_pool, 0.0), (score_pool, float("-inf"))):
        rows = _ring_gather(pool, slots, seq, q, R, fill)
        out.append(overlap_halves(rows, m, c) if coff == 2 else rows)
    return tuple(out)


def ring_rows_reference(positions, slots, R: int, W: int):
    dest = slots * R + positions % R
    if not W:
        return dest, None
    q = positions.unsqueeze(1) + torch.arange(-W + 1, 1, device=positions.device)
    return dest, torch.where(q >= 0, slots.unsqueeze(1) * R + q % R, -1)


def entry_rows_reference(table, positions, ratio: int, per: int, E: int):
    e = torch.arange(E, device=table.device)
    blk = table[:, (e // per).clamp(max=max(table.shape[1] - 1, 0))] if E else table[:, :0]
    ok = (e.unsqueeze(0) < ((positions + 1) // ratio).unsqueeze(1)) & (blk >= 0)
    return torch.where(ok, blk * per + e % per, -1)


def feed_ids_reference(ids, src, fed):
    return ids.copy_(torch.where(src >= 0, fed[src.clamp(min=0)], ids))


def layout_in_reference(buf, staging, fed, R: int):
    buf.copy_(staging, non_blocking=True)
    return feed_ids(buf[:R], buf[4 * R : 5 * R], fed)


def topk_rows_reference(scores, rows, k: int):
    _, idx = ops.topk(scores.masked_fill(rows < 0, float("-inf")), k, stable=True)
    return rows.gather(1, torch.sort(idx, dim=1).values)


def moe_unsort_combine_reference(out, rank, indices, shared, out_dtype, joined: bool = False):
    if joined:  # the joined slot's expert sorts after every routed one
        indices = torch.nn.functional.pad(indices, (0, 1), value=1 << 30)
    T, k = indices.shape
    cd = torch.float64 if out.dtype == torch.float64 else torch.float32
    r = ops.moe_combine(out.to(cd)[rank].view(T, k, -1), indices)
    if shared is not None:
        r = r + shared.to(r.dtype)
    return r.to(out_dtype)


def normed_sparse_attention_reference(q, pools, idx, sink, scale: float, eps: float):
    return ops.sparse_attention(ops.rms_norm(q, None, eps), pools, idx, sink, scale)


register("normed_sparse_attention", "torch_composite", normed_sparse_attention_reference)
register("greedy_draw", "torch_composite", greedy_draw_reference)
register("linear_widened", "torch_composite", linear_widened_reference)
register("moe_gate", "torch_composite", moe_gate_reference)
register("router", "composite", router_reference)
register("moe_route", "torch_composite", moe_route_reference)
register("moe_route_rows", "torch_composite", moe_route_rows_reference)
register("embed_streams", "torch_composite", embed_streams_reference)
register("moe_unsort_combine", "torch_composite", moe_unsort_combine_reference)
register("tail_write", "torch_composite", tail_write_reference)
register("pack_keys_into", "torch_composite", pack_keys_into_reference)
register("kv_round", "torch_composite", kv_round_reference)
register("fp4_round", "torch_composite", fp4_round_reference)
register("rope_into", "torch_composite", rope_into_reference)
register("rope_pair", "composite", rope_pair_reference)
register("rope_", "torch_composite", rope_inplace_reference)
register("rope_table", "torch_composite", rope_table_reference)
register("hc_split", "torch_composite", hc_split_reference)
register("hc_pre", "torch_composite", hc_pre_reference)
register("swiglu_act", "torch_composite", swiglu_act_reference)
register("moe_hc_write", "composite", moe_hc_write_reference)
register("rms_norm_pair", "composite", rms_norm_pair_reference)
register("hc_read_norm", "torch_composite", hc_read_norm_reference)
register("hc_pre_read_norm", "composite", hc_pre_read_norm_reference)
register("hc_head_pre", "torch_composite", hc_head_pre_reference)
register("hc_head_read_norm", "composite", hc_head_read_norm_reference)
register("group_linear", "torch_per_group", group_linear_reference)
register("group_linear", "torch_bmm", _group_linear_bmm, mode="fast", device="cuda",
         accepts=lambda x, w: x.dtype == w.dtype and not isinstance(w, ops.QuantizedWeight))
register("rope", "torch_composite", rope_reference)
register("ring_rows", "torch_composite", ring_rows_reference)
register("ring_capture", "torch_composite", ring_capture_reference)
register("closing_rows", "torch_composite", closing_rows_reference)
register("entry_rows", "torch_composite", entry_rows_reference)
register("topk_rows", "torch_composite", topk_rows_reference)
register("feed_ids", "torch_composite", feed_ids_reference)
register("layout_in", "torch_composite", layout_in_reference)


def feed_ids(ids: torch.Tensor, src: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
    """``ids [T]`` (int64) with ``ids[t] = fed[src[t]]`` where ``src[t] >= 0``, in place: a decode
    step's token ids taken from the tokens the step before drew on the device."""
    return call("feed_ids", ops.get_mode(), "int64", ids.device.type, ids, src, fed)


def layout_in(buf: torch.Tensor, staging: torch.Tensor, fed: torch.Tensor, R: int) -> None:
    """``buf [n]`` (int64, a static decode step's layout: ids, positions, ends, slots, feed sources
    ``[R]`` each, then the rest) set to ``staging [n]`` (its host copy), with the ids then fed from
    ``fed`` where the sources are >= 0 (``feed_ids``)."""
    call("layout_in", ops.get_mode(), "int64", buf.device.type, buf, staging, fed, R)


def topk_rows(scores: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """The indexer's choice: per query the pool rows ``[n, k]`` of its ``k`` best ``scores [n, E]``
    (entries whose ``rows [n, E]`` is -1 count as -inf; ties to the lower entry), in ascending
    entry order; -1 where a chosen entry has no row (fewer than ``k`` entries)."""
    return call("topk_rows", ops.get_mode(), str(scores.dtype)[6:], scores.device.type, scores, rows, k)


def ring_capture(pool: torch.Tensor, snap: torch.Tensor, slots: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor,
                 slot: torch.Tensor, R: int, fill: float) -> None:
    """A decode step's boundary captures of one ring kind: capture ``c`` (step row ``seq[c]`` at
    position ``pos[c]``) writes its state slot's ring (``slots[seq[c]]``, ``R`` rows of ``pool [S *
    R, D]``, row ``q % R`` holding position ``q``) as it stood at ``pos[c]`` - positions ``pos[c] -
    R .. pos[c] - 1``, ``fill`` before 0 - into ``snap[slot[c]]`` (``[P, R, D]``), in place."""
    call("ring_capture", ops.get_mode(), str(pool.dtype)[6:], pool.device.type, pool, snap, slots, seq, pos, slot,
         R, fill)


def closing_rows(kv_pool: torch.Tensor, score_pool: torch.Tensor, slots: torch.Tensor, seq: torch.Tensor,
                 entry: torch.Tensor, R: int, m: int, lookback: int, coff: int, c: int):
    """The rows a decode step's closing entries pool, read from their requests' tail rings
    (``pool [S * R, coff * c]``, position ``q`` at row ``slots[seq] * R + q % R``): for entry
    ``entry[i]`` of step row ``seq[i]`` the positions ``entry m - lookback + j``, ``j < coff m`` ->
    ``(kv, score) [n, coff m, c]``; with ``coff`` 2 the first ``m`` rows' channels ``[0, c)``, the
    rest's ``[c, 2c)``; 0 / -inf before position 0."""
    return call("closing_rows", ops.get_mode(), str(kv_pool.dtype)[6:], kv_pool.device.type, kv_pool, score_pool,
                slots, seq, entry, R, m, lookback, coff, c)


def ring_rows(positions: torch.Tensor, slots: torch.Tensor, R: int, W: int = 0):
    """A decode step's ring rows (rings of ``R`` rows a state slot, row ``position % R``): every
    row's own ``slots * R + positions % R`` ``[T]``, and with ``W`` its window of ``W`` positions
    ending at its own ``[T, W]`` (-1 before position 0; else None). int64."""
    return call("ring_rows", ops.get_mode(), "int64", positions.device.type, positions, slots, R, W)


def entry_rows(table: torch.Tensor, positions: torch.Tensor, ratio: int, per: int, E: int) -> torch.Tensor:
    """A decode step's compressed entries ``e < E`` of every row as pool rows ``[T, E]`` through
    its block table ``[T, nb]`` (``per`` entries a block: ``block * per + e % per``); -1 where the
    entry has not closed once the row's token is in (``e >= (positions + 1) // ratio``) or its
    block is -1."""
    return call("entry_rows", ops.get_mode(), "int64", positions.device.type, table, positions, ratio, per, E)


def normed_sparse_attention(q: torch.Tensor, pools, idx, sink: torch.Tensor, scale: float, eps: float):
    """``ops.sparse_attention`` of the queries RMS-normalised per head (weightless, ``eps``); a
    kernel may normalise the queries as it loads them instead of writing normalised
    queries (fast mode's many-row launch on CUDA)."""
    return call("normed_sparse_attention", ops.get_mode(), str(q.dtype)[6:], q.device.type, q, tuple(pools),
                tuple(idx), sink, scale, eps)


def normalises_queries(q: torch.Tensor) -> bool:
    """Whether ``normed_sparse_attention`` of queries like ``q [T, H, D]`` runs a kernel that folds
    the normalisation in - where it does, a caller that would normalise, rotate, then attend can
    rotate the raw queries and hand them over (the rotation keeps a head's norm), saving the
    normalisation's pass over the queries; elsewhere it normalises first, as before."""
    return resolve("normed_sparse_attention", ops.get_mode(), str(q.dtype)[6:], q.device.type, q, None, None, None,
                   0.0, 0.0).name != "torch_composite"


def hc_split(mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int, eps: float):
    """-> pre ``[N, n]``, post ``[N, n]``, comb ``[N, n, n]`` in ``mix``'s dtype."""
    return call("hc_split", ops.get_mode(), str(mix.dtype)[6:], mix.device.type, mix, scale, base, n, iters, eps)


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int,
           eps: float, norm_eps: float):
    """mHC coefficients from the streams ``x [N, n, d]``: ``hc_split`` of ``hc_mix`` of the
    flattened streams (in the compute dtype) -> pre, post, comb."""
    return call("hc_pre", ops.get_mode(), str(x.dtype)[6:], x.device.type, x, fn, scale, base, n, iters, eps,
                norm_eps)


def swiglu_act(gate: torch.Tensor, up: torch.Tensor, limit: float, weight: torch.Tensor | None, out_dtype):
    """SwiGLU's activation between the expert GEMMs: ``silu(clamp(gate, max=limit)) *
    clamp(up, -limit, limit)``, times the routing ``weight [T]`` if given, in the compute dtype,
    returned in ``out_dtype`` (the next GEMM's); ``limit`` 0 disables the clamps."""
    return call("swiglu_act", ops.get_mode(), str(gate.dtype)[6:], gate.device.type, gate, up, limit, weight,
                out_dtype)


def rms_norm_pair(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float):
    """``(ops.rms_norm(a, wa, eps), ops.rms_norm(b, wb, eps))`` (one launch on CUDA, the same bits)."""
    return call("rms_norm_pair", ops.get_mode(), str(a.dtype)[6:], a.device.type, a, wa, b, wb, eps)


def moe_hc_write(x: torch.Tensor, out: torch.Tensor, rank: torch.Tensor, indices: torch.Tensor, joined: bool,
                 post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``ops.hc_write(x, moe_unsort_combine(out, rank, indices, None, x.dtype, joined), post, comb)``:
    the MoE sublayer's mHC write from its experts' sorted outputs ``out`` (fast mode on CUDA: one
    kernel, the combined rows never stored; the same bits)."""
    return call("moe_hc_write", ops.get_mode(), str(x.dtype)[6:], x.device.type, x, out, rank, indices, joined, post,
                comb)


def hc_head_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float,
                norm_eps: float) -> torch.Tensor:
    """The head's stream weights ``pre [N, n]`` (compute dtype) from the streams ``x [N, n, d]``:
    ``sigmoid(hc_mix(x, fn) * scale + base) + eps``."""
    return call("hc_head_pre", ops.get_mode(), str(x.dtype)[6:], x.device.type, x, fn, scale, base, eps, norm_eps)


def hc_pre_read_norm(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int,
                     eps: float, norm_eps: float, weight: torch.Tensor | None, rms_eps: float):
    """A sublayer's mHC coefficients and its normalised input: ``hc_pre`` then ``hc_read_norm`` with
    its pre -> (input ``[N, d]`` in ``x``'s dtype, post, comb). Both modes compose the two ops;
    fast mode on CUDA does the finish, the split and the read in one launch (``triton_wide.py``)."""
    return call("hc_pre_read_norm", ops.get_mode(), str(x.dtype)[6:], x.device.type, x, fn, scale, base, n, iters,
                eps, norm_eps, weight, rms_eps)


def hc_head_read_norm(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float,
                      norm_eps: float, weight: torch.Tensor | None, rms_eps: float) -> torch.Tensor:
    """The output head's normalised input: ``hc_head_pre`` then ``hc_read_norm`` with its weights ->
    ``[N, d]`` in ``x``'s dtype. Both modes compose the two ops; fast mode on CUDA does the finish,
    the weights and the read in one launch (``triton_wide.py``)."""
    return call("hc_head_read_norm", ops.get_mode(), str(x.dtype)[6:], x.device.type, x, fn, scale, base, eps,
                norm_eps, weight, rms_eps)


def hc_read_norm(x: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The normalised sublayer input ``rms_norm(hc_read(x, pre), weight, eps)``: streams ``x [N, n,
    d]``, ``pre [N, n]`` -> ``[N, d]`` in ``x``'s dtype."""
    return call("hc_read_norm", ops.get_mode(), str(x.dtype)[6:], x.device.type, x, pre, weight, eps)


def group_linear(x: torch.Tensor, w: torch.Tensor, fp=None) -> torch.Tensor:
    """Grouped projection: ``x [N, g, k]``, ``w [g, r, k]`` -> ``[N, g * r]`` (group i's output
    ``x[:, i] @ w[i].T`` in columns ``i*r:(i+1)*r``); fast mode on CUDA runs one batched GEMM."""
    fp = ops._admit("group_linear", fp)
    m = ops.get_mode()
    if m == "fast" and x.is_cuda and not ops._ieee_flags():
        with ops._cuda_flags(fp):
            return call("group_linear", m, str(w.dtype)[6:], x.device.type, x, w)
    return call("group_linear", m, str(w.dtype)[6:], x.device.type, x, w)


def rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``x [T, ..., D]`` rotated on its last ``2 * len(freqs)`` channels; ``freqs`` fp64 on x's device."""
    return call("rope", ops.get_mode(), str(x.dtype)[6:], x.device.type, x, positions, freqs, inverse)


def rope_(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False,
          table: torch.Tensor | None = None) -> torch.Tensor:
    """``rope`` written into ``x`` itself (returned); for tensors nothing else reads (no autograd).
    ``table``: ``rope_table(positions, freqs)``, which a kernel may read instead of computing the
    angles' functions itself (the same values)."""
    return call("rope_", ops.get_mode(), str(x.dtype)[6:], x.device.type, x, positions, freqs, inverse, table)


def rope_table(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``[T, 2, len(freqs)]`` fp32: ``cos`` then ``sin`` of ``positions [T] * freqs`` (fp64 angles),
    made once for the rotations of a step that share the positions and frequencies."""
    return call("rope_table", ops.get_mode(), "float64", positions.device.type, positions, freqs)


def linear_widened(x: torch.Tensor, w: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
    """``ops.linear(x.to(wide.dtype), wide)``: a narrow projection (the router's logits) of rows
    ``x [M, K]`` widened to ``wide``'s dtype, where ``wide`` is ``w [N, K]`` widened (the caller's
    kept copy). Fast mode on CUDA reads ``x`` and ``w`` as they are (``triton_wide``: no widened
    copy of the rows)."""
    return call("linear_widened", ops.get_mode(), str(x.dtype)[6:], x.device.type, x, w, wide)


def greedy_draw(logits: torch.Tensor):
    """``logits [B, V]`` -> the greedy ids ``[B]`` (int64; the first maximum) and ``[B, 3]`` float64
    rows: id, its log-probability under ``log_softmax(logits.float())``, and that clamped at 0
    (the policy log-probability at temperature 1)."""
    return call("greedy_draw", ops.get_mode(), str(logits.dtype)[6:], logits.device.type, logits)


def moe_gate(logits: torch.Tensor, bias: torch.Tensor | None, table: torch.Tensor | None, token_ids, k: int,
             scale: float):
    """The router from its logits ``[T, E]`` (compute dtype): scores ``sqrt(softplus(logits))``;
    experts = the top ``k`` of ``scores + bias`` (descending), or ``table[token_ids]`` for a hash
    layer (``bias`` None); weights = the chosen unbiased scores over their sum, times ``scale``.
    -> (expert ids ``[T, k]`` int64, weights ``[T, k]`` in the logits' dtype)."""
    return call("moe_gate", ops.get_mode(), str(logits.dtype)[6:], logits.device.type, logits, bias, table, token_ids,
                k, scale)


def router(x: torch.Tensor, w: torch.Tensor, wide: torch.Tensor, bias: torch.Tensor | None,
           table: torch.Tensor | None, token_ids, k: int, scale: float):
    """The router from its rows: ``moe_gate(linear_widened(x, w, wide), bias, table, token_ids, k,
    scale)``. Fast mode on CUDA sums the logits' partials inside the gate's kernel (the same bits:
    the slices added in order), one launch fewer."""
    return call("router", ops.get_mode(), str(x.dtype)[6:], x.device.type, x, w, wide, bias, table, token_ids, k,
                scale)


def moe_route(indices: torch.Tensor, weights: torch.Tensor, n_experts: int, joined: bool = False):
    """``indices [T, k]`` (int64, in ``[0, n_experts)``), ``weights [T, k]`` -> the pairs ``p = t k
    + j`` stably sorted by expert: row offsets ``[n_experts + 1]`` (int64), the order ``[T k]``,
    its inverse ``rank`` (``order[rank[p]] == p``), each sorted pair's token ``order // k`` and
    weight ``weights.flat[order]``. ``joined``: every token has one more pair, expert ``n_experts``
    with weight 1 (the shared expert run as one more expert; no padded copies of the inputs)."""
    return call("moe_route", ops.get_mode(), str(weights.dtype)[6:], indices.device.type, indices, weights,
                n_experts, joined)


def embed_streams(ids: torch.Tensor, weight: torch.Tensor, n: int) -> torch.Tensor:
    """The mHC streams' first copies ``[T, n, d]``: row ``ids[t]`` of the embedding table ``weight``
    in each of token ``t``'s ``n`` streams (on CUDA one launch; inference only - a table that takes
    a gradient runs the composition)."""
    return call("embed_streams", ops.get_mode(), str(weight.dtype)[6:], weight.device.type, ids, weight, n)


def moe_route_rows(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, n_experts: int, joined: bool,
                   dtype):
    """``moe_route(indices, weights, n_experts, joined)`` plus the sorted pairs' rows ``x[tok].to(dtype)``
    (``x [T, d]``): ``(offsets, order, rank, tok, weights, rows)``. A decode step's pairs on CUDA run
    one kernel (the routing kernel's pass, then each expert's rows copied by column blocks); the
    same values as the composition."""
    return call("moe_route_rows", ops.get_mode(), str(weights.dtype)[6:], indices.device.type, x, indices, weights,
                n_experts, joined, dtype)


def moe_unsort_combine(out: torch.Tensor, rank: torch.Tensor, indices: torch.Tensor, shared: torch.Tensor | None,
                       out_dtype, joined: bool = False):
    """The routed experts' sorted outputs ``out [T k, d]`` back per token and combined:
    ``ops.moe_combine(out.to(cd)[rank].view(T, k, d), indices)`` (``cd`` fp32, or fp64), plus
    ``shared [T, d]`` widened to that dtype when given, returned in ``out_dtype``. ``joined``: the
    pairs of ``moe_route(..., joined=True)`` (``k + 1`` a token, the joined expert's added last)."""
    return call("moe_unsort_combine", ops.get_mode(), str(out.dtype)[6:], out.device.type, out, rank, indices, shared,
                out_dtype, joined)


def tail_write(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor, ratio: int,
               ring_kv: torch.Tensor, ring_score: torch.Tensor, dest: torch.Tensor, cd) -> None:
    """A compressor's projections of a decode step's rows into its tail rings, in place: row ``n``
    of ``kv.to(cd)`` and of ``score.to(cd) + ape.to(cd)[positions % ratio]`` (``Compressor.project``)
    into ring row ``dest[n]`` of ``ring_kv`` / ``ring_score [S, R, W]`` (cast to their dtype)."""
    return call("tail_write", ops.get_mode(), str(kv.dtype)[6:], kv.device.type, kv, score, ape, positions, ratio,
                ring_kv, ring_score, dest, cd)


def kv_round(kv: torch.Tensor, rope_dims: int, block: int) -> torch.Tensor:
    """V4's activation rounding of KV rows ``kv [..., D]``: the first ``D - rope_dims`` dims rounded
    to e4m3 on a power-of-two scale a ``block`` dims (``quantized.fp8_round``), the RoPE dims as they
    are; a new tensor (one kernel on CUDA, the same bits)."""
    return call("kv_round", ops.get_mode(), str(kv.dtype)[6:], kv.device.type, kv, rope_dims, block)


def fp4_round(x: torch.Tensor, block: int) -> torch.Tensor:
    """V4's FP4 activation rounding of rows ``x [..., D]`` (``quantized.fp4_round``: e2m1 on a
    power-of-two scale a ``block`` dims); a new tensor (one kernel on CUDA, the same bits)."""
    return call("fp4_round", ops.get_mode(), str(x.dtype)[6:], x.device.type, x, block)


def pack_keys_into(new: torch.Tensor, pool: torch.Tensor, dest: torch.Tensor) -> None:
    """Indexer keys ``new [N, d]`` packed in V4's cache format (``ops/fp8_keys.py``) into rows
    ``dest [N]`` of the flattened uint8 key pool ``pool``, in place (one kernel on CUDA, the same bytes)."""
    return call("pack_keys_into", ops.get_mode(), str(new.dtype)[6:], new.device.type, new, pool, dest)


def rope_pair(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, pool: torch.Tensor,
              dest: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's two rotations of one attention layer: ``rope_(q, ...)`` (the queries, in
    place; returned) and ``rope_into(kv, ..., pool, dest)`` (the window rows into their ring rows) -
    one launch on CUDA (``triton_mhc.rope_pair``), each op's bits."""
    return call("rope_pair", ops.get_mode(), str(q.dtype)[6:], q.device.type, q, kv, positions, freqs, pool, dest,
                table)


def rope_into(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, pool: torch.Tensor,
              dest: torch.Tensor, table: torch.Tensor | None = None) -> None:
    """``rope(x, positions, freqs)`` (``x [T, ...]``) written in place into rows ``dest [T]`` of
    ``pool [P, x.numel() / T]``, cast to the pool's dtype."""
    return call("rope_into", ops.get_mode(), str(x.dtype)[6:], x.device.type, x, positions, freqs, pool, dest, table)
