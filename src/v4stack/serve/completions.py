"""``/v1/completions``, ``/v1/chat/completions`` (both with SSE streaming), ``/tokenize`` and
``/detokenize``."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from pydantic import Field, StrictInt, StrictStr
from starlette.responses import StreamingResponse

from v4stack.chat import EOS
from v4stack.serve import tool_calls as tc
from v4stack.serve.api import Json, error
from v4stack.serve.generation import Generation, Job
from v4stack.serve.limits import EdgeError
from v4stack.serve.protocol import ChatMessage, ChatRequest, CompletionRequest, ToolChoiceNamed, _Strict
from v4stack.serve.render import chat_logprobs, completion_logprobs, error_body


class TokenizeRequest(_Strict):
    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    add_special_tokens: Optional[bool] = None


class DetokenizeRequest(_Strict):
    model: Optional[StrictStr] = None
    tokens: list[StrictInt]


class _Stream(StreamingResponse):
    """SSE that aborts its generation however the response ends, even when the client left
    before the first byte (an async generator never started runs no ``finally``)."""

    def __init__(self, body, gen: Generation):
        super().__init__(body, media_type="text/event-stream", headers={"X-Accel-Buffering": "no"})
        self.gen = gen

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=True, separators=(',', ':'))}\n\n"


async def _disconnected(http: Request) -> None:
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            return


async def _collect(http: Request, gen: Generation) -> bool:
    """Run every job to its end; False (all aborted) as soon as the client disconnects."""
    watch = asyncio.ensure_future(_disconnected(http))
    try:
        while not gen.done:
            nxt = asyncio.ensure_future(gen.next())
            await asyncio.wait({nxt, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                return False
            nxt.result()
        return True
    finally:
        watch.cancel()
        gen.close()


def _failed(jobs: list[Job]) -> EdgeError | None:
    for j in jobs:
        if j.finish == "error":
            return EdgeError(400, j.error or "request failed", "prompt")
        if j.finish == "abort":
            return EdgeError(500, "the engine failed while running this request", None, "server_error")
    return None


def _forced_prefix(body: ChatRequest) -> str:
    if body.tool_choice == "required":
        return tc.forced_prefix(None)
    if isinstance(body.tool_choice, ToolChoiceNamed):
        return tc.forced_prefix(body.tool_choice.function.name)
    return ""


async def _sse_stream(gen: Generation, head: dict, usage_on: bool, first, pieces):
    """The frame both streaming endpoints share: the events ``first()`` makes, then the events ``pieces(job, text,
    draws)`` makes of each engine step; a failed or aborted job ends the stream with an error event;
    the usage chunk when asked for; ``[DONE]``; the generation is closed however the stream ends
    (the client gone included)."""
    try:
        for event in first():
            yield event
        while not gen.done:
            job, text, draws = await gen.next()
            if job.finish in ("error", "abort"):
                yield _sse(error_body(job.error or "the engine failed while running this request",
                                      "server_error" if job.finish == "abort" else "invalid_request_error"))
                break
            for event in pieces(job, text, draws):
                yield event
        else:
            if usage_on:
                yield _sse({**head, "choices": [], "usage": gen.usage()})
        yield "data: [DONE]\n\n"
    finally:
        gen.close()


def _messages(msgs) -> list[dict]:
    """Chat messages as the template renders them."""
    return [{"role": m.role, "content": m.text(), "name": m.name, "tool_call_id": m.tool_call_id,
             "tool_calls": [c.model_dump() for c in m.tool_calls] if m.tool_calls else None} for m in msgs]


def mount(app: FastAPI, edge) -> None:
    tok, runner, name = edge.tok, edge.runner, edge.model_name

    def rid_for(http: Request, prefix: str) -> str:
        rid = http.scope.get("v4_rid") or prefix + uuid.uuid4().hex[:24]
        http.scope["v4_rid"] = rid
        return rid

    def start(http: Request, prompts, params, per_prompt: int, field: str, prefix: str) -> Generation:
        for p in prompts:
            edge.check_prompt(p, params, field)
        edge.admit(len(prompts) * per_prompt)
        gen = Generation(runner, edge.metrics, edge, rid_for(http, prefix), prompts, params, per_prompt)
        gen.start()
        return gen

    @app.post("/v1/completions")
    async def completions(http: Request):
        body: CompletionRequest = await edge.body(http, CompletionRequest)
        prompts = body.prompts(tok.encode)
        n = body.n or 1
        best = body.best_of or n
        if len(prompts) * best > edge.opts.max_choices:
            raise EdgeError(400, f"prompt: {len(prompts)} prompts x {best} choices exceeds "
                                 f"{edge.opts.max_choices} per request", "prompt")
        lp = body.logprobs
        params = body.params(16 if body.max_tokens is None else body.max_tokens, logprobs=lp,
                             prompt_logprobs=lp if body.echo and lp is not None else None)
        gen = start(http, prompts, params, best, "prompt", "cmpl-")
        created = int(time.time())
        head = {"id": gen.rid, "object": "text_completion", "created": created, "model": name}
        so = body.stream_options
        if body.stream:
            return _Stream(_stream_completion(gen, head, bool(body.echo), lp, so), gen)
        if not await _collect(http, gen):
            return error_response(499, "client disconnected")
        err = _failed(gen.jobs)
        if err:
            raise err
        choices = []
        for p in range(len(prompts)):
            jobs = [j for j in gen.jobs if j.prompt_index == p]
            if best > n:
                jobs = sorted(jobs, key=lambda j: -j.cumulative_logprob)[:n]
            for k, j in enumerate(jobs):
                choices.append(_completion_choice(p * n + k, j, bool(body.echo), lp))
        return Json({**head, "choices": choices, "usage": gen.usage()})

    def _completion_choice(index: int, j: Job, echo: bool, lp) -> dict:
        prompt_text = tok.decode(j.prompt) if echo else ""
        logprobs = None
        if lp is not None:
            pd = getattr(j.req, "prompt_draws", None) if echo else None
            logprobs = completion_logprobs(j.ids, j.draws, 0, pd, j.prompt if echo else None)
        return {"index": index, "text": prompt_text + j.text, "logprobs": logprobs, "finish_reason": j.finish,
                "stop_reason": j._stops.stopped, "token_ids": list(j.ids)}

    def _stream_completion(gen: Generation, head: dict, echo: bool, lp, so):
        usage_on = bool(so and so.include_usage)
        every = bool(so and so.continuous_usage_stats)
        sent = {j.index: 0 for j in gen.jobs}  # characters sent per choice (text_offset)
        echoed: set[int] = set()

        def pieces(job: Job, text: str, draws):
            logprobs = None
            if echo and job.index not in echoed and (draws or job.finish):
                echoed.add(job.index)
                pre = tok.decode(job.prompt)
                if lp is not None:
                    pd = getattr(job.req, "prompt_draws", None)
                    logprobs = completion_logprobs(job.ids[: len(draws)], draws, 0, pd, job.prompt)
                text = pre + text
            elif lp is not None and draws:
                first = len(job.ids) - len(draws)
                logprobs = completion_logprobs(job.ids[first:], draws, sent[job.index])
            if not (text or logprobs or job.finish):
                return
            sent[job.index] += len(text)
            chunk = {**head, "choices": [{"index": job.index, "text": text, "logprobs": logprobs,
                                          "finish_reason": job.finish, "stop_reason": job._stops.stopped}]}
            if usage_on:
                chunk["usage"] = gen.usage() if every else None
            yield _sse(chunk)

        return _sse_stream(gen, head, usage_on, list, pieces)

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        body: ChatRequest = await edge.body(http, ChatRequest)
        tools_on = bool(body.tools) and body.tool_choice != "none"
        prefix = _forced_prefix(body) if tools_on else ""
        messages = _messages(body.messages)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if tools_on else None
        try:
            text = edge.template.render(messages, tools, prefix)
        except ValueError as e:
            raise EdgeError(400, str(e), "messages") from None
        prompt = tok.encode(text)
        mt = body.max_completion_tokens or body.max_tokens or max(edge.max_context - len(prompt), 1)
        params = body.params(mt, logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        if not body.ignore_eos:  # the reply's end in the model's format (text, as the byte tokenizer has no id)
            params.stop = params.stop + (EOS,)
        n = body.n or 1
        gen = start(http, [prompt], params, n, "messages", "chatcmpl-")
        head = {"id": gen.rid, "object": "chat.completion", "created": int(time.time()), "model": name}
        if body.stream:
            return _Stream(_stream_chat(gen, {**head, "object": "chat.completion.chunk"}, bool(body.logprobs),
                                        tools_on, prefix, body.stream_options), gen)
        if not await _collect(http, gen):
            return error_response(499, "client disconnected")
        err = _failed(gen.jobs)
        if err:
            raise err
        choices = []
        for j in gen.jobs:
            msg = {"role": "assistant", "content": j.text}
            finish = j.finish
            if tools_on:
                content, calls = tc.parse(prefix + j.text)
                msg = {"role": "assistant", "content": content or None,
                       "tool_calls": [c.to_openai() for c in calls]}
                if calls and finish != "length":
                    finish = "tool_calls"
            choices.append({"index": j.index, "message": msg, "finish_reason": finish,
                            "logprobs": chat_logprobs(j.ids, j.draws) if body.logprobs else None,
                            "stop_reason": j._stops.stopped, "token_ids": list(j.ids)})
        return Json({**head, "choices": choices, "usage": gen.usage()})

    def _stream_chat(gen: Generation, head: dict, want_lp: bool, tools_on: bool, prefix: str, so):
        usage_on = bool(so and so.include_usage)
        every = bool(so and so.continuous_usage_stats)
        streams = {j.index: tc.ToolStream() for j in gen.jobs} if tools_on else {}
        for s in streams.values():
            s.push(prefix)
        calls_sent = {j.index: 0 for j in gen.jobs}

        def chunk(index: int, delta: dict, finish=None, logprobs=None) -> str:
            c = {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if usage_on:
                c["usage"] = gen.usage() if every else None
            return _sse(c)

        def pieces(job: Job, text: str, draws):
            lp = chat_logprobs(job.ids[len(job.ids) - len(draws):], draws) if want_lp and draws else None
            calls = []
            if tools_on:
                text, calls = streams[job.index].push(text, final=job.finish is not None)
            if text or lp:
                yield chunk(job.index, {"content": text}, None, lp)
            for c in calls:
                yield chunk(job.index, {"tool_calls": [c.to_openai(calls_sent[job.index])]})
                calls_sent[job.index] += 1
            if job.finish is not None:
                finish = "tool_calls" if calls_sent[job.index] and job.finish != "length" else job.finish
                yield chunk(job.index, {}, finish)

        def first():
            return [chunk(j.index, {"role": "assistant", "content": ""}) for j in gen.jobs]

        return _sse_stream(gen, head, usage_on, first, pieces)

    @app.post("/tokenize")
    async def tokenize(http: Request):
        body: TokenizeRequest = await edge.body(http, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise EdgeError(400, "send exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            text = edge.template.render(_messages(body.messages), None)
        else:
            text = body.prompt
        ids = tok.encode(text)
        return Json({"count": len(ids), "max_model_len": edge.max_context, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(http: Request):
        body: DetokenizeRequest = await edge.body(http, DetokenizeRequest)
        if any(not 0 <= t < edge.opts.vocab_size for t in body.tokens):
            raise EdgeError(400, f"tokens: ids must lie in [0, {edge.opts.vocab_size})", "tokens")
        return Json({"prompt": tok.decode(body.tokens)})


def error_response(status: int, message: str):
    return error(status, message)
