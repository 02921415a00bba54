"""Logprobs over HTTP: a request's logprobs (chosen and top-5) are the same alone and inside a
batch of concurrent requests in invariant mode - the engine's exactness, visible to a client -
and differ in fast mode, where batching changes the logits (the control that shows the
comparison can fail)."""

import asyncio

import openai
import pytest

from .conftest import Served

MODEL = "v4stack-tiny"
PROMPT = "invariant HTTP"  # shorter than a cache block: the batched copy computes it the same way
OTHERS = [f"another request {i} " * (i + 1) for i in range(7)]


def _lp(r):
    lp = r.choices[0].logprobs
    return lp.token_logprobs, lp.top_logprobs, r.choices[0].model_extra["token_ids"]


async def _alone_and_batched(base: str):
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600) as c:
        kw = dict(model=MODEL, max_tokens=8, temperature=0, logprobs=5)
        alone = await c.completions.create(prompt=PROMPT, **kw)
        batch = await asyncio.gather(*[c.completions.create(prompt=p, **kw) for p in OTHERS + [PROMPT]])
        chat_kw = dict(model=MODEL, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
        chat_alone = await c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **chat_kw)
        chat_batch = await asyncio.gather(*[c.chat.completions.create(messages=[{"role": "user", "content": p}], **chat_kw)
                                            for p in OTHERS[:5] + ["hi"]])
    chat = [[(t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in r.choices[0].logprobs.content]
            for r in (chat_alone, chat_batch[-1])]
    return _lp(alone), _lp(batch[-1]), chat


def test_logprobs_equal_alone_and_in_a_batch_invariant_mode(server):
    alone, batched, (chat_alone, chat_batched) = asyncio.run(_alone_and_batched(server))
    assert alone == batched
    assert chat_alone == chat_batched


@pytest.fixture(scope="module")
def fast_server():
    s = Served("--ops-mode", "fast")
    yield s.base
    s.close()


def test_logprobs_differ_in_fast_mode(fast_server):
    alone, batched, (chat_alone, chat_batched) = asyncio.run(_alone_and_batched(fast_server))
    assert alone[0] != batched[0] or chat_alone != chat_batched  # batching moved the logits
