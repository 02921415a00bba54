"""Fuzz every request field of completions and chat with hostile JSON (wrong types, NaN and
infinities, huge and tiny numbers, lone surrogates, NUL, deep nesting, long strings): no answer is
a 5xx, every 200 is a well-formed response, and the engine is idle afterwards."""

import asyncio
import json
import random

import httpx
import pytest

from .test_api_bugs import wait_idle

MODEL = "v4stack-tiny"
COMPLETION = {"model": MODEL, "prompt": "fuzz", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 2, "max_completion_tokens": 2}
COMMON = ["model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
          "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
          "stream", "stream_options", "n", "user", "response_format", "return_token_ids", "no_such_field"]
FIELDS = [("/v1/completions", COMPLETION, f) for f in COMMON + ["prompt", "echo", "logprobs", "best_of", "suffix"]] + \
         [("/v1/chat/completions", CHAT, f) for f in COMMON + ["messages", "max_completion_tokens", "logprobs",
                                                            "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"]]
CORE = ["null", "true", "-1", "1e308", "18446744073709551616", "NaN", '"\\ud800"', '"a\\u0000b"', "[" * 30 + "]" * 30,
        '{"a": 1}']
VALUES = CORE + ["false", "0", "1", "2", "0.5", "-0.0", "-1e308", "1e-320", "9223372036854775808", "-" + "9" * 30,
                 "Infinity", "-Infinity", '""', '"x"', '"\\u0000"', '"5"', "[]", "[1, 2]", '["a", "b"]',
                 "[[1], [2]]", "{}", '{"type": "text"}', '"' + "a" * 5000 + '"', "[null]", '{"include_usage": "yes"}',
                 '[{"role": "user", "content": "\\ud800"}]', '[{"role": "tool", "content": "x"}]',
                 '[{"type": "function", "function": {"name": "f"}}]', '{"65": 100}', '{"-1": 1}', "[" * 5000 + "]" * 5000]


def _body(base: dict, field: str, raw: str) -> str:
    rest = {k: v for k, v in base.items() if k != field}
    return json.dumps(rest)[:-1] + f', "{field}": {raw}}}'


async def _send(cases):
    sem = asyncio.Semaphore(8)
    bad = []

    async def one(c, path, body):
        async with sem:
            r = await c.post(path, content=body.encode(), headers={"content-type": "application/json"})
            text = r.text
            if r.status_code >= 500:
                bad.append((r.status_code, body[-200:], text[:300]))
            elif r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
                if not text.rstrip().endswith("data: [DONE]"):
                    bad.append(("stream", body[:300], text[-300:]))
            elif r.status_code == 200:
                if "choices" not in r.json():
                    bad.append(("shape", body[:300], text[:300]))
            elif set(r.json().get("error", {})) != {"message", "type", "param", "code"}:
                bad.append(("error shape", body[:300], text[:300]))

    async with httpx.AsyncClient(base_url=_send.base, timeout=120) as c:
        await asyncio.gather(*(one(c, path, body) for path, body in cases))
    return bad


def _run(server, cases):
    _send.base = server
    bad = asyncio.run(_send(cases))
    assert not bad, bad[:5]
    assert httpx.get(server + "/health").status_code == 200
    wait_idle(server, 60)


def test_fuzz_every_field(server):
    cases = [(path, _body(base, f, v)) for path, base, f in FIELDS for v in CORE]
    rng = random.Random(17)
    cases += [(path, _body(base, f, rng.choice(VALUES))) for path, base, f in rng.sample(FIELDS * 4, 100)]
    _run(server, cases)


@pytest.mark.slow
def test_fuzz_every_field_every_value(server):
    _run(server, [(path, _body(base, f, v)) for path, base, f in FIELDS for v in VALUES])
