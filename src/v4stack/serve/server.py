"""`v4stack serve`: load or build the model, start the engine thread, serve HTTP with uvicorn."""

from __future__ import annotations

import torch

from v4stack.config import ModelConfig
from v4stack.model import V4Model
from v4stack.model.weights import load_model
from v4stack.serve.api import build_app
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.runner import EngineRunner


def make_runner(cfg: ModelConfig, model_dir: str | None, engine_cfg: EngineConfig, seed: int = 0,
                dtype: torch.dtype = torch.float32, device: str = "cpu") -> EngineRunner:
    model = load_model(model_dir, dtype=dtype) if model_dir else V4Model(cfg, seed=seed).cast(dtype)
    return EngineRunner(Engine(model.to(device), engine_cfg)).start()


def serve(cfg: ModelConfig, model_dir: str | None, model_name: str, host: str, port: int,
          engine_cfg: EngineConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
    import uvicorn

    runner = make_runner(cfg, model_dir, engine_cfg, seed, dtype, device)
    app = build_app(runner, model_name)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        runner.stop()
