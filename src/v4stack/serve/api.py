"""The OpenAI-compatible HTTP API: completions, chat (both with SSE streaming), models, health,
and Prometheus metrics. Every bad request gets a 4xx with an error naming the field."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from v4stack.serve import metrics
from v4stack.serve.protocol import ChatRequest, CompletionRequest
from v4stack.serve.runner import EngineRunner
from v4stack.tokenizer import ByteTokenizer


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind,
                                                               "param": param, "code": None}})


def _stable(text: str, finished: bool) -> str:
    """Hold back a trailing replacement char: it may be a multi-byte character still arriving."""
    return text if finished else text.rstrip("\ufffd")


def build_app(runner: EngineRunner, model_name: str) -> FastAPI:
    app = FastAPI(title="v4stack", version="0.1.0")
    tok = ByteTokenizer()
    app.state.runner = runner

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        field = ".".join(loc) or "body"
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            field, msg = "body", f"request body is not valid JSON ({first.get('ctx', {}).get('error', msg)})"
        return _error(422, f"{field}: {msg}", field)

    @app.get("/health")
    async def health():
        return {"status": "ok", "engine_error": runner.last_error}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "v4stack"}]}

    @app.get("/metrics")
    async def prom():
        return PlainTextResponse(metrics.render(runner), media_type="text/plain; version=0.0.4")

    async def _run(http: Request, body, prompt_ids: list[int], chat: bool):
        if body.model != model_name:
            return _error(400, f"model '{body.model}' is not served here (serving '{model_name}')", "model")
        params = body.sampling()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            events = runner.submit(prompt_ids, params, rid)
        except ValueError as err:  # the engine's own checks (Engine.validate)
            param = "max_tokens" if "max_tokens" in str(err) and "exceeds" not in str(err) else "prompt"
            return _error(400, str(err), param)
        created = int(time.time())
        usage_prompt = len(prompt_ids)
        if body.stream:
            return StreamingResponse(_stream(events, rid, created, chat, usage_prompt),
                                     media_type="text/event-stream")
        try:
            ev = None
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        runner.abort(rid)
                        return _error(499, "client disconnected", None)
                    continue
                if ev.error:
                    return _error(400, ev.error, "prompt")
                if ev.finished:
                    break
        except asyncio.CancelledError:
            runner.abort(rid)
            raise
        usage = {"prompt_tokens": usage_prompt, "completion_tokens": ev.n_tokens,
                 "total_tokens": usage_prompt + ev.n_tokens}
        # token_ids: an extension (as vLLM's return_token_ids) so clients can compare exact tokens
        choice = {"index": 0, "finish_reason": ev.finish_reason, "logprobs": None, "token_ids": list(ev.ids)}
        if chat:
            choice["message"] = {"role": "assistant", "content": ev.text}
            return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": [choice], "usage": usage}
        choice["text"] = ev.text
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [choice], "usage": usage}

    async def _stream(events: asyncio.Queue, rid: str, created: int, chat: bool, n_prompt: int):
        sent = ""
        obj = "chat.completion.chunk" if chat else "text_completion"
        first = True
        try:
            while True:
                ev = await events.get()
                if ev.error:
                    yield f"data: {json.dumps({'error': {'message': ev.error, 'type': 'invalid_request_error'}})}\n\n"
                    break
                text = _stable(ev.text, ev.finished)
                delta = ""
                if text.startswith(sent):
                    delta, sent = text[len(sent):], text
                if delta or ev.finished or (chat and first):
                    choice = {"index": 0, "finish_reason": ev.finish_reason if ev.finished else None, "logprobs": None}
                    if chat:
                        choice["delta"] = {"content": delta} if delta else {}
                        if first:
                            choice["delta"]["role"] = "assistant"
                    else:
                        choice["text"] = delta
                    first = False
                    yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': model_name, 'choices': [choice]})}\n\n"
                if ev.finished:
                    break
            yield "data: [DONE]\n\n"
        finally:
            runner.abort(rid)  # no-op when finished; frees everything when the client went away

    @app.post("/v1/completions")
    async def completions(http: Request, body: CompletionRequest):
        ids = tok.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        return await _run(http, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(http: Request, body: ChatRequest):
        return await _run(http, body, tok.encode(body.prompt_text()), chat=True)

    return app
