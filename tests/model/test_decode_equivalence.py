"""The incremental path (explicit per-request state) equals the full-sequence forward."""

import random

import torch

from .conftest import tokens

T = 75  # past the window (16), across m (4), m' (16) and lcm boundaries several times


@torch.no_grad()
def test_token_by_token_matches_full_forward(model64):
    t = tokens(T, seed=3)
    full = model64(t)[0]
    st = model64.new_state()
    inc = torch.cat([model64.step([(t[0, i : i + 1], st)])[0] for i in range(T)])
    assert inc.shape == full.shape
    assert (inc - full).abs().max().item() < 1e-9
    assert st.pos == T


@torch.no_grad()
def test_random_chunkings_match_full_forward(model64):
    t = tokens(T, seed=4)
    full = model64(t)[0]
    rng = random.Random(0)
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, T), 5))
        bounds = [0] + cuts + [T]
        st = model64.new_state()
        inc = torch.cat([model64.step([(t[0, a:b], st)])[0] for a, b in zip(bounds, bounds[1:])])
        assert (inc - full).abs().max().item() < 1e-9, bounds


@torch.no_grad()
def test_batched_requests_at_different_positions(model64):
    """Several requests in one step, each at its own position, equal their own full forwards."""
    seqs = [tokens(n, seed=10 + n)[0] for n in (23, 40, 17)]
    fulls = [model64(s.unsqueeze(0))[0] for s in seqs]
    states = [model64.new_state() for _ in seqs]
    prefill = [9, 20, 1]
    outs = [[o] for o in model64.step([(s[:p], st) for s, p, st in zip(seqs, prefill, states)])]
    pos = list(prefill)
    while any(p < len(s) for p, s in zip(pos, seqs)):
        live = [i for i, s in enumerate(seqs) if pos[i] < len(s)]
        res = model64.step([(seqs[i][pos[i] : pos[i] + 1], states[i]) for i in live])
        for i, r in zip(live, res):
            outs[i].append(r)
            pos[i] += 1
    for full, o in zip(fulls, outs):
        assert (torch.cat(o) - full).abs().max().item() < 1e-9


@torch.no_grad()
def test_state_shapes_follow_cache_spec(model64, tiny_cfg):
    t = tokens(37, seed=5)
    st = model64.new_state()
    model64.step([(t[0], st)])
    for ratio, ls in zip(tiny_cfg.layer_ratios, st.layers):
        assert ls.swa_kv.shape == (tiny_cfg.sliding_window, tiny_cfg.head_dim)
        if ratio:
            assert ls.compressed_kv.shape[0] == 37 // ratio  # only closed blocks
            coff = 2 if tiny_cfg.is_csa(ratio) else 1
            assert ls.tail.kv.shape == (coff * ratio, coff * tiny_cfg.head_dim)
            if tiny_cfg.is_csa(ratio):
                assert ls.index_keys.shape == (37 // ratio, tiny_cfg.index_head_dim)
        else:
            assert ls.compressed_kv is None and ls.tail is None
