"""The `v4stack serve` command's options (typer only; torch and the model load when it runs)."""

from __future__ import annotations

from typing import Optional

import typer


def _csv(v: str) -> list[str]:
    return [x.strip() for x in v.split(",") if x.strip()]


def serve_command(
    preset: str = typer.Option("tiny", help="Preset when no --model is given (random weights)."),
    model: Optional[str] = typer.Option(None, help="Model directory with config.json + model.safetensors."),
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    port: int = typer.Option(8000, min=1, max=65535),
    served_name: Optional[str] = typer.Option(None, help="Model id clients send (default: v4stack-<preset> or the dir name)."),
    n_blocks: int = typer.Option(512, min=1, help="Paged block-cache size, in blocks of lcm(m, m') tokens."),
    n_slots: int = typer.Option(64, min=1, help="State-cache slots (max concurrent running requests)."),
    token_budget: int = typer.Option(256, min=1, help="Tokens fed per engine step."),
    ops_mode: str = typer.Option("invariant", help="invariant (bit-identical per request) or fast."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float64."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    seed: int = typer.Option(0, help="Seed for random weights."),
    eos_token_id: Optional[int] = typer.Option(None, help="Token id that ends a request (unless ignore_eos)."),
    api_key: Optional[str] = typer.Option(None, envvar="V4STACK_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize."),
    allowed_origins: str = typer.Option("", help="CORS: comma-separated origins ('*' for any); empty: no CORS."),
    allowed_methods: str = typer.Option("GET,POST,OPTIONS", help="CORS: allowed methods."),
    allowed_headers: str = typer.Option("Authorization,Content-Type,X-Request-Id", help="CORS: allowed headers."),
    allow_credentials: bool = typer.Option(False, help="CORS: allow credentials."),
    chat_template: Optional[str] = typer.Option(None, help="Jinja chat template: a file or an inline template."),
    max_body_bytes: int = typer.Option(1 << 20, min=1, help="Largest request body (413 above)."),
    max_stops: int = typer.Option(64, min=1, help="Most stop strings (and stop_token_ids) per request."),
    max_stop_chars: int = typer.Option(256, min=1, help="Longest stop string."),
    max_n: int = typer.Option(16, min=1, help="Largest n / best_of."),
    max_queue: int = typer.Option(256, min=0, help="Requests held beyond the running batch before 429."),
    drain_timeout: float = typer.Option(30.0, min=0, help="Seconds requests in flight may finish after SIGTERM."),
    overlap: Optional[bool] = typer.Option(None, "--overlap/--no-overlap",
                                           help="Launch each decode step before reading the last one's tokens "
                                                "(default: on with --device cuda)."),
    index_keys: str = typer.Option("auto", help="The cache's indexer keys: auto (V4's packed e4m3 keys where the model "
                                                "runs V4's activation rounding, as a released checkpoint does; else the "
                                                "model dtype), model, or fp8 (packed always; rounds unrounded keys)."),
):
    """Start the OpenAI-compatible HTTP server (completions, chat, tools, SSE, /metrics)."""
    from pathlib import Path

    from v4stack.config import ConfigError, ModelConfig, preset as get_preset
    from v4stack.generate import parse_dtype
    from v4stack.serve.engine import EngineConfig
    from v4stack.serve.limits import ServerOptions
    from v4stack.serve.server import serve

    try:
        cfg = ModelConfig.load(model) if model else get_preset(preset or "tiny")
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    name = served_name or (Path(model).name if model else f"v4stack-{preset}")
    ecfg = EngineConfig(n_blocks=n_blocks, n_slots=n_slots, token_budget=token_budget,
                        max_running=n_slots, ops_mode=ops_mode, eos_token_id=eos_token_id,
                        overlap=device.startswith("cuda") if overlap is None else overlap, index_keys=index_keys)
    opts = ServerOptions(api_key=api_key, allowed_origins=_csv(allowed_origins), allowed_methods=_csv(allowed_methods),
                         allowed_headers=_csv(allowed_headers), allow_credentials=allow_credentials,
                         max_body_bytes=max_body_bytes, max_stops=max_stops, max_stop_chars=max_stop_chars,
                         max_n=max_n, max_queue=max_queue, drain_timeout=drain_timeout, chat_template=chat_template)
    try:
        ecfg.validate()
        opts.validate()
        dt = parse_dtype(dtype)
        if chat_template:
            from v4stack.serve.chat_template import ChatTemplate

            ChatTemplate(chat_template)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"serving {name} on http://{host}:{port}/v1 (ops mode {ops_mode})", err=True)
    serve(cfg, model, name, host, port, ecfg, seed=seed, dtype=dt, device=device, options=opts)
