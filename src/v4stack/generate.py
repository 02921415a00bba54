"""`v4stack generate`: one prompt through the serving engine (prefill in one step, then decode)."""

from __future__ import annotations

import time

import torch

from v4stack.config import ModelConfig
from v4stack.model import V4Model
from v4stack.model.weights import load_model
from v4stack.ops.mode import get_mode
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams
from v4stack.tokenizer import ByteTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@torch.no_grad()
def generate_ids(model: V4Model, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """One prompt through the serving engine (the project's one generation loop), in the ops
    mode in effect; the whole prompt is fed in one step."""
    if not prompt_ids:
        raise ValueError("prompt must not be empty")
    limit = model.cfg.max_position_embeddings
    if len(prompt_ids) + params.max_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds "
                         f"max_position_embeddings ({limit})")
    n = len(prompt_ids) + params.max_tokens + 1
    cfg = EngineConfig(n_blocks=-(-n // model.cfg.block_tokens) + 1, n_slots=1, n_snapshots=0,
                       token_budget=len(prompt_ids), max_running=1, ops_mode=get_mode())
    return Engine(model, cfg).generate([list(prompt_ids)], params)[0].output


def run_generate(cfg: ModelConfig, model_dir: str | None, prompt: str, *, max_tokens: int,
                 temperature: float, top_p: float, top_k: int, seed: int, dtype: str) -> dict:
    dt = parse_dtype(dtype)
    if model_dir:
        model = load_model(model_dir, dtype=dt)
    else:
        model = V4Model(cfg, seed=seed).cast(dt)
    model.eval()
    tok = ByteTokenizer()
    ids = tok.encode(prompt)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed)
    t0 = time.perf_counter()
    out = generate_ids(model, ids, params)
    dt_s = time.perf_counter() - t0
    return {"text": tok.decode(out), "prompt_tokens": len(ids), "new_tokens": len(out),
            "token_ids": out, "seconds": round(dt_s, 4), "weights": model_dir or f"random(seed={seed})"}
