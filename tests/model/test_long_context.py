"""A long prompt serves on the tiny preset, and the paged cache it holds matches V4's per-token
formula: per CSA layer (c + d_I) bytes-per-element / m, per HCA layer c bytes-per-element / m'
(the window and compressor tails are a fixed-size state per request, not per token)."""

import pytest
import torch

from v4stack.config import ModelConfig, preset
from v4stack.model import V4Model
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams


def formula_bytes_per_token(cfg: ModelConfig, es: int) -> float:
    out = 0.0
    for r in cfg.layer_ratios:
        if r and cfg.is_csa(r):
            out += (cfg.head_dim + cfg.index_head_dim) * es / r
        elif r:
            out += cfg.head_dim * es / r
    return out


@torch.no_grad()
@pytest.mark.parametrize("n", [2048, pytest.param(65536, marks=pytest.mark.slow)])
def test_long_prompt_serves_and_cache_bytes_match_formula(n, capsys):
    cfg = ModelConfig.from_dict({**preset("tiny").to_dict(), "max_position_embeddings": n + 64})
    model = V4Model(cfg, seed=0).eval()
    B = cfg.block_tokens
    eng = Engine(model, EngineConfig(n_blocks=n // B + 4, n_slots=1, n_snapshots=0, token_budget=4096,
                                     ops_mode="fast"))
    prompt = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    req = eng.add_request(prompt, SamplingParams(max_tokens=8))
    while len(req.output) < 3:
        eng.step()
    rc = req.cache
    assert rc.pos == n + 2 and all(0 <= t < cfg.vocab_size for t in req.output)
    spec = eng.cache.spec
    measured = len(rc.blocks) * spec.block_bytes() / rc.pos
    formula = formula_bytes_per_token(cfg, torch.empty((), dtype=model.dtype).element_size())
    with capsys.disabled():
        print(f"\n{n}-token prompt: paged cache {measured:.2f} B/token measured "
              f"({len(rc.blocks)} blocks x {spec.block_bytes()} B / {rc.pos} tokens), formula {formula:.2f} B/token")
    assert formula <= measured <= formula + spec.block_bytes() / rc.pos  # at most one open block
    # the closed entries are really there: the last full block's compressed rows were written
    last = rc.blocks[n // B - 1]
    for g in spec.paged:
        assert eng.cache.blocks.storage[(g.kind, g.layer)][last].abs().sum() > 0, g
