"""The serving path (flat steps over paged pools, read by index) against the reference paths:
the same bits as ``V4Model.step`` in invariant mode, the full forward in float64, and a decode
step that writes O(new rows) bytes of cache whatever the context."""

import random

import torch

from v4stack.ops.mode import mode
from v4stack.serve.cache import CacheManager
from v4stack.serve.model_runner import ModelRunner

from .conftest import tokens


def _drive(model, seqs, schedule, n_blocks=48):
    """Feed ``seqs`` through one runner: ``schedule`` lists per step the tokens each request feeds
    (0: sits out). Returns every fed row's logits per request."""
    cm = CacheManager(model.cfg, model.dtype, n_blocks=n_blocks, n_slots=len(seqs))
    runner = ModelRunner(model, cm)
    rcs = [cm.admit(s.tolist()) for s in seqs]
    pos, outs = [0] * len(seqs), [[] for _ in seqs]
    for step in schedule:
        chunks, who = [], []
        for i, n in enumerate(step):
            n = min(n, len(seqs[i]) - pos[i])
            if n > 0:
                assert cm.reserve(rcs[i], n)
                chunks.append((rcs[i], seqs[i][pos[i] : pos[i] + n].tolist()))
                who.append((i, n))
        if not chunks:
            continue
        lg = runner.run(chunks, all_rows=True)
        r = 0
        for i, n in who:
            outs[i].append(lg[r : r + n])
            pos[i] += n
            r += n
    assert pos == [len(s) for s in seqs]
    return [torch.cat(o) for o in outs], cm


@torch.no_grad()
def test_paged_equals_reference_step_bitwise(tiny_cfg):
    from v4stack.model import V4Model

    model = V4Model(tiny_cfg, seed=2).eval()
    seqs = [tokens(n, seed=30 + n)[0] for n in (41, 35, 22)]
    rng = random.Random(1)
    schedule = [[rng.choice([0, 1, 3, 9, 17]) for _ in seqs] for _ in range(6)] + [[1, 1, 1]] * 40
    with mode("invariant"):
        got, cm = _drive(model, seqs, schedule)
        for s, g in zip(seqs, got):
            ref = model.step([(s, model.new_state())])[0]
            assert torch.equal(g, ref)
    assert cm.stats()["snapshots"] > 0  # boundary captures were written along the way


@torch.no_grad()
def test_paged_matches_full_forward_float64(model64):
    seqs = [tokens(n, seed=40 + n)[0] for n in (51, 33)]
    got, _ = _drive(model64, seqs, [[7, 5], [1, 20], [30, 1]] + [[1, 1]] * 13)
    for s, g in zip(seqs, got):
        assert (g - model64(s.unsqueeze(0))[0]).abs().max().item() < 1e-9


@torch.no_grad()
def test_decode_step_writes_new_rows_only(tiny_cfg):
    """Cache bytes written by a decode step: one window row per layer, one tail row per compressor,
    plus the entries that close - the same at context 40 and 40 + 2 blocks."""
    from v4stack.model import V4Model
    from v4stack.serve.engine import Engine, EngineConfig
    from v4stack.serve.sampling import SamplingParams

    model = V4Model(tiny_cfg, seed=2).eval()
    B = tiny_cfg.block_tokens
    eng = Engine(model, EngineConfig(n_blocks=32, n_slots=2, n_snapshots=0, ops_mode="fast"))
    req = eng.add_request(tokens(37, seed=5)[0].tolist(), SamplingParams(max_tokens=2 * B + 6))
    per_pos = {}
    while eng.has_work():
        eng.step()
        if req.status.value == "running" and req.cache.pos > 37:
            per_pos[req.cache.pos - 1] = eng.stats.last_step_cache_bytes
    c, f4 = tiny_cfg.head_dim, 4
    plain = sum(c * f4 + (2 * (2 if tiny_cfg.is_csa(r) else 1) * c * f4 if r else 0)
                + (2 * 2 * tiny_cfg.index_head_dim * f4 if r and tiny_cfg.is_csa(r) else 0)
                for r in tiny_cfg.layer_ratios)
    for p, nbytes in per_pos.items():
        if p + 2 * B in per_pos:
            assert per_pos[p + 2 * B] == nbytes, p  # independent of the context
        if (p + 1) % 4:  # no entry closes: window and tail rows only
            assert nbytes == plain, (p, nbytes, plain)


@torch.no_grad()
def test_static_decode_layout_equals_eager_bitwise(tiny_cfg):
    """Decode steps in the static layout CUDA graphs capture (rows padded to a power of two with
    scratch-slot rows, fixed table width, a closing slot per row) give the eager step's bits."""
    from v4stack.model import V4Model
    from v4stack.serve.engine import Engine, EngineConfig
    from v4stack.serve.graphs import DecodeGraphs
    from v4stack.serve.sampling import SamplingParams

    model = V4Model(tiny_cfg, seed=2).eval()
    prompts = [tokens(n, seed=60 + n)[0].tolist() for n in (21, 9, 30)]
    sp = SamplingParams(max_tokens=20)
    eager = Engine(model, EngineConfig(n_blocks=24, n_slots=4, n_snapshots=0))
    static = Engine(model, EngineConfig(n_blocks=24, n_slots=4, n_snapshots=0))
    static.runner.graphs = DecodeGraphs(model, static.cache, max_rows=4, capture=False)
    want = [r.output for r in eager.generate(prompts, sp)]
    got = [r.output for r in static.generate(prompts, sp)]
    assert got == want
    assert static.runner.graphs.steps >= 15  # the decode steps took the static layout


@torch.no_grad()
def test_queries_handed_over_raw_where_the_attention_normalises_them(model64, monkeypatch):
    """Where ``fused.normalises_queries`` says the attention kernel takes the queries' norm (fast
    mode's many-row launch on CUDA), a serving step rotates the raw queries and calls
    ``normed_sparse_attention``: the same logits as normalising first (float64, to 1e-12), on
    every paged step; the control: handing the raw queries to the plain attention instead is far off."""
    from v4stack import ops
    from v4stack.ops import fused

    seqs = [tokens(n, seed=50 + n)[0] for n in (23, 17)]
    schedule = [[9, 5], [7, 12], [1, 1], [1, 1], [1, 0], [6, 1], [1, 1]]
    want, _ = _drive(model64, seqs, schedule)
    monkeypatch.setattr(fused, "normalises_queries", lambda q: True)
    ops.reset_counters()
    got, _ = _drive(model64, seqs, schedule)
    assert ops.counters().get("normed_sparse_attention", {}).get("torch_composite", 0) > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)
    monkeypatch.setattr(fused, "normed_sparse_attention",
                        lambda q, pools, idx, sink, scale, eps: ops.sparse_attention(q, pools, idx, sink, scale))
    raw, _ = _drive(model64, seqs, schedule)
    assert max(float((r - w).abs().max()) for r, w in zip(raw, want)) > 1e-3
