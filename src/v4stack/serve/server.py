"""`v4stack serve`: load or build the model, start the engine thread, serve HTTP with uvicorn.

On SIGTERM / SIGINT the server drains: new requests get 503, requests in flight may finish for
up to ``--drain-timeout`` seconds, then whatever is left is aborted and the engine stops.
"""

from __future__ import annotations

import torch

from v4stack.config import ModelConfig
from v4stack.model import V4Model
from v4stack.model.weights import load_model
from v4stack.serve import heap
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.limits import ServerOptions
from v4stack.serve.runner import EngineRunner


def make_runner(cfg: ModelConfig, model_dir: str | None, engine_cfg: EngineConfig, seed: int = 0,
                dtype: torch.dtype = torch.float32, device: str = "cpu") -> EngineRunner:
    model = load_model(model_dir, dtype=dtype) if model_dir else V4Model(cfg, seed=seed).cast(dtype)
    return EngineRunner(Engine(model.to(device), engine_cfg)).start()


def serve(cfg: ModelConfig, model_dir: str | None, model_name: str, host: str, port: int,
          engine_cfg: EngineConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu",
          options: ServerOptions | None = None) -> None:
    import uvicorn

    from v4stack.serve.api import build_app

    opts = (options or ServerOptions()).validate()
    runner = make_runner(cfg, model_dir, engine_cfg, seed, dtype, device)
    app = build_app(runner, model_name, opts)
    edge = app.state.edge
    heap.settle()  # the model, engine and app are built: keep them out of every later full collection

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame):
            edge.draining = True  # refuse new requests while the ones in flight finish
            super().handle_exit(sig, frame)

    server = Draining(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                     timeout_graceful_shutdown=opts.drain_timeout))
    try:
        server.run()
    finally:
        for rid in list(runner.engine.requests):
            runner.abort(rid)
        runner.stop()
