"""Parameter counts and per-token cache bytes, from a model built on the meta device.

Counting rules (also in the README):
- ``total_params``: every parameter of the main stack and the MTP block(s), embedding and output
  head included; the hash-routing tables (integer buffers) are not parameters.
- ``active_params``: the weights one token's forward pass multiplies with in the main stack:
  everything except the routed experts it is not sent to (``n_routed - top_k`` per layer), the
  MTP block(s), and the input embedding (a row lookup, not a matmul; the output head counts).
"""

from __future__ import annotations

import torch

from v4stack.config import ModelConfig
from v4stack.model.model import V4Model

# V4's released cache formats (spec/cache.md): KV entry = 448 B FP8 no-RoPE dims + 128 B BF16
# RoPE dims + 8 B scales/pad; indexer key = 128 B FP8 + 4 B scale.
def _v4_entry_bytes(cfg: ModelConfig) -> int:
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    return nope + 2 * cfg.qk_rope_head_dim + (nope // 64 + 1)


def _v4_index_bytes(cfg: ModelConfig) -> int:
    return cfg.index_head_dim + 4


def count_params(model: V4Model) -> tuple[int, int]:
    cfg = model.cfg
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    per_expert = sum(p.numel() for p in model.layers[0].ffn.experts[0].parameters())
    inactive = cfg.num_hidden_layers * (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert
    embed = model.embed.weight.numel()
    return total, total - mtp - inactive - embed


def cache_bytes(cfg: ModelConfig, bytes_per_elem: int = 2) -> dict:
    """Per-token growth of the block cache and per-request size of the state cache."""
    ratios = cfg.layer_ratios
    csa = [r for r in ratios if cfg.is_csa(r)]
    hca = [r for r in ratios if r and not cfg.is_csa(r)]
    c, dI = cfg.head_dim, cfg.index_head_dim
    per_token = {
        "compressed_kv_csa": sum(c * bytes_per_elem / r for r in csa),
        "compressed_kv_hca": sum(c * bytes_per_elem / r for r in hca),
        "index_keys": sum(dI * bytes_per_elem / r for r in csa),
    }
    e, k = _v4_entry_bytes(cfg), _v4_index_bytes(cfg)
    per_token_v4 = {
        "compressed_kv_csa": sum(e / r for r in csa),
        "compressed_kv_hca": sum(e / r for r in hca),
        "index_keys": sum(k / r for r in csa),
    }
    # fixed-size state per request: SWA window in every layer + compressor tails (fp32 kv + score)
    swa = len(ratios) * cfg.sliding_window * c * bytes_per_elem
    tails = sum((2 if cfg.is_csa(r) else 1) * r * (2 if cfg.is_csa(r) else 1) * c * 4 * 2 for r in ratios if r)
    tails += sum(2 * r * 2 * dI * 4 * 2 for r in csa)
    return {
        "bytes_per_token": per_token,
        "bytes_per_token_v4_format": per_token_v4,
        "state_bytes_per_request": {"swa_kv": swa, "compressor_tail": tails},
        "swa_bytes_per_token_if_stored": len(ratios) * c * bytes_per_elem,
    }


def model_stats(cfg: ModelConfig) -> dict:
    with torch.device("meta"):
        model = V4Model(cfg, seed=None)
    total, active = count_params(model)
    cb = cache_bytes(cfg)
    return {
        "total_params": total,
        "active_params": active,
        "layers": {"swa": cfg.layer_ratios.count(0),
                   "csa": sum(cfg.is_csa(r) for r in cfg.layer_ratios),
                   "hca": sum(bool(r) and not cfg.is_csa(r) for r in cfg.layer_ratios),
                   "mtp": cfg.num_nextn_predict_layers},
        "cache_bytes_per_token": {**cb["bytes_per_token"],
                                  "total": sum(cb["bytes_per_token"].values())},
        "cache_bytes_per_token_v4_format": {**cb["bytes_per_token_v4_format"],
                                            "total": sum(cb["bytes_per_token_v4_format"].values())},
        "state_bytes_per_request": cb["state_bytes_per_request"],
        "swa_bytes_per_token_if_stored": cb["swa_bytes_per_token_if_stored"],
    }
