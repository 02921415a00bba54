"""ModelConfig: the V4 architecture as data, its presets, and HF-style config.json in and out.

The field names of ``ModelConfig`` are the official ``config.json`` names, so a config read from
disk and one built here are the same object. Validation happens once, in ``validate()``, which
every constructor path calls; inner code trusts the config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from v4stack.atomic import atomic_write

MODEL_TYPE = "deepseek_v4"


class ConfigError(ValueError):
    """A config field is missing, of the wrong type, or out of its allowed range."""


@dataclass
class RopeScaling:
    """YaRN parameters used by compressed layers (and their indexers)."""

    type: str = "yarn"
    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    # one entry per main layer, then one per MTP layer (0 = SWA only, 4 = CSA, 128 = HCA)
    compress_ratios: list[int] = field(default_factory=list)
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    num_hash_layers: int = 3
    routed_scaling_factor: float = 1.5
    scoring_func: str = "sqrtsoftplus"
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 1
    model_type: str = MODEL_TYPE

    # ---- derived views ---------------------------------------------------------------

    @property
    def layer_ratios(self) -> list[int]:
        """Compression ratio of each main layer."""
        return list(self.compress_ratios[: self.num_hidden_layers])

    @property
    def mtp_ratios(self) -> list[int]:
        return list(self.compress_ratios[self.num_hidden_layers :])

    @property
    def csa_ratio(self) -> int:
        """m: the overlapped (CSA) ratio, the smallest nonzero ratio in the stack."""
        ratios = sorted({r for r in self.compress_ratios if r})
        return ratios[0] if ratios else 0

    def is_csa(self, ratio: int) -> bool:
        """A compressed layer is CSA (overlapped compressor + lightning indexer) when its ratio is
        the smallest nonzero ratio and finer than the window; any other nonzero ratio is HCA."""
        return ratio != 0 and ratio == self.csa_ratio and ratio < self.sliding_window

    @property
    def block_tokens(self) -> int:
        """lcm of the nonzero ratios: the token span one cache block must be a multiple of."""
        out = 1
        for r in {r for r in self.compress_ratios if r}:
            out = math.lcm(out, r)
        return out

    # ---- validation ------------------------------------------------------------------

    def validate(self) -> "ModelConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
            "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
            "index_head_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings",
        ):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                 f"config field '{name}' must be a positive integer, got {v!r}")
        for name in ("n_shared_experts", "num_hash_layers", "num_nextn_predict_layers"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 0, f"config field '{name}' must be an integer >= 0, got {v!r}")
        need(self.model_type == MODEL_TYPE,
             f"config field 'model_type' must be '{MODEL_TYPE}', got {self.model_type!r}")
        need(self.num_key_value_heads == 1,
             f"config field 'num_key_value_heads' must be 1 (V4 shares one KV latent), got {self.num_key_value_heads}")
        n_total = self.num_hidden_layers + self.num_nextn_predict_layers
        need(isinstance(self.compress_ratios, list) and len(self.compress_ratios) == n_total,
             f"config field 'compress_ratios' must list {n_total} ratios "
             f"(num_hidden_layers + num_nextn_predict_layers), got {len(self.compress_ratios)}")
        nonzero = sorted({r for r in self.compress_ratios if r})
        need(all(isinstance(r, int) and r >= 0 for r in self.compress_ratios),
             "config field 'compress_ratios' must hold integers >= 0")
        need(len(nonzero) <= 2, f"config field 'compress_ratios' may use at most two nonzero ratios "
             f"(CSA m and HCA m'), got {nonzero}")
        if len(nonzero) == 2:
            need(nonzero[0] < nonzero[1], "compress_ratios: CSA ratio must be below HCA ratio")
        for r in self.mtp_ratios:
            need(r == 0, f"config field 'compress_ratios': MTP layers are SWA-only (0), got {r}")
        need(self.qk_rope_head_dim % 2 == 0 and 0 < self.qk_rope_head_dim <= self.head_dim,
             f"config field 'qk_rope_head_dim' must be even and in (0, head_dim], got {self.qk_rope_head_dim}")
        need(self.index_head_dim >= self.qk_rope_head_dim,
             f"config field 'index_head_dim' must be >= qk_rope_head_dim, got {self.index_head_dim}")
        need(self.num_attention_heads % self.o_groups == 0,
             f"config field 'o_groups' ({self.o_groups}) must divide num_attention_heads ({self.num_attention_heads})")
        need(self.num_experts_per_tok <= self.n_routed_experts,
             f"config field 'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})")
        need(self.num_hash_layers <= self.num_hidden_layers,
             f"config field 'num_hash_layers' ({self.num_hash_layers}) exceeds num_hidden_layers")
        need(self.scoring_func == "sqrtsoftplus",
             f"config field 'scoring_func' must be 'sqrtsoftplus', got {self.scoring_func!r}")
        need(self.routed_scaling_factor > 0, "config field 'routed_scaling_factor' must be > 0")
        need(self.swiglu_limit >= 0, "config field 'swiglu_limit' must be >= 0 (0 disables the clamp)")
        need(self.rope_scaling.type == "yarn",
             f"config field 'rope_scaling.type' must be 'yarn', got {self.rope_scaling.type!r}")
        need(self.rope_scaling.factor >= 1, "config field 'rope_scaling.factor' must be >= 1")
        need(self.rms_norm_eps > 0 and self.hc_eps > 0, "config fields 'rms_norm_eps' and 'hc_eps' must be > 0")
        return self

    # ---- HF config.json --------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        # fields of the official files that v4stack does not model are kept out, not rejected
        kwargs = {k: v for k, v in raw.items() if k in known}
        rs = kwargs.get("rope_scaling")
        if isinstance(rs, dict):
            rs_known = {f.name for f in dataclasses.fields(RopeScaling)}
            kwargs["rope_scaling"] = RopeScaling(**{k: v for k, v in rs.items() if k in rs_known})
        elif rs is not None:
            raise ConfigError("config field 'rope_scaling' must be an object")
        try:
            cfg = cls(**kwargs)
        except TypeError as e:  # pragma: no cover - dataclass signature errors
            raise ConfigError(str(e)) from e
        return cfg.validate()

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``config.json`` atomically (temp file, fsync, rename). ``path`` may be a dir."""
        p = Path(path)
        if p.is_dir() or not p.suffix:
            p.mkdir(parents=True, exist_ok=True)
            p = p / "config.json"
        atomic_write(p, (json.dumps(self.to_dict(), indent=2) + "\n").encode())
        return p

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ModelConfig":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            raise ConfigError(f"no config.json at {p}")
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from e
        return cls.from_dict(raw)


# ---- presets ---------------------------------------------------------------------------


def _flash() -> ModelConfig:
    return ModelConfig(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        sliding_window=128, compress_ratios=[0, 0] + [4, 128] * 20 + [4] + [0],
        index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=6, moe_intermediate_size=2048, num_hash_layers=3,
        routed_scaling_factor=1.5, num_nextn_predict_layers=1,
    )


def _pro() -> ModelConfig:
    return ModelConfig(
        vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=1536, o_groups=16, o_lora_rank=1024,
        sliding_window=128, compress_ratios=[128, 128] + [4, 128] * 29 + [4] + [0],
        index_n_heads=64, index_head_dim=128, index_topk=1024, n_routed_experts=384,
        n_shared_experts=1, num_experts_per_tok=6, moe_intermediate_size=3072, num_hash_layers=3,
        routed_scaling_factor=2.5, num_nextn_predict_layers=1,
    )


def _tiny() -> ModelConfig:
    # Every mechanism alive at CPU size: window 16, m 4, m' 16 (lcm 16), two SWA layers,
    # CSA and HCA layers, hash-routed first layers, a shared expert, one MTP block.
    return ModelConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        sliding_window=16, compress_ratios=[0, 0, 4, 16, 4, 16, 0],
        index_n_heads=4, index_head_dim=16, index_topk=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=3,
        routed_scaling_factor=1.5, num_nextn_predict_layers=1, max_position_embeddings=4096,
        rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=256),
    )


PRESETS = {"tiny": _tiny, "flash": _flash, "pro": _pro}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]().validate()
