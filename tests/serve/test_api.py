"""The OpenAI-compatible server through the official `openai` client, on a real process: every
request field either works or is refused with a 400 naming it."""

import json
import math
import re

import httpx
import openai
import pytest
import torch

from v4stack.chat import encode_chat, parse_completion
from v4stack.serve import tool_calls as tc
from v4stack.serve.chat_template import ChatTemplate
from v4stack.tokenizer import ByteTokenizer

from .conftest import greedy_ref

MODEL = "v4stack-tiny"
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def ids_of(choice):
    return choice.model_extra["token_ids"]


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))


def test_models_version_tokenize(client, server):
    (m,) = client.models.list().data
    assert m.id == MODEL and m.model_extra["max_model_len"] > 1000
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert httpx.get(server + "/health").json()["status"] == "ok"
    assert re.match(r"\d", httpx.get(server + "/version").json()["version"])
    t = httpx.post(server + "/tokenize", json={"prompt": "héllo"}).json()
    assert t["tokens"] == list("héllo".encode()) and t["count"] == 6 and t["max_model_len"] == m.model_extra["max_model_len"]
    assert httpx.post(server + "/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == "héllo"
    msgs = [{"role": "user", "content": "hi"}]
    t = httpx.post(server + "/tokenize", json={"messages": msgs}).json()
    assert TOK.decode(t["tokens"]) == ChatTemplate().render(msgs, None) == encode_chat(msgs)
    assert httpx.post(server + "/detokenize", json={"tokens": [1, 256]}).json()["error"]["param"] == "tokens"


def test_completion_equals_single_request_greedy_decode(client, reference_model):
    r = client.completions.create(model=MODEL, prompt="The cache", max_tokens=10, temperature=0)
    ids = greedy_ref(reference_model, TOK.encode("The cache"), 10)
    assert ids_of(r.choices[0]) == ids and r.choices[0].text == TOK.decode(ids)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 9 and r.usage.completion_tokens == 10


def test_seeded_sampling_is_reproducible_and_unseeded_is_fresh(client):
    kw = dict(model=MODEL, prompt="seed me", max_tokens=8, temperature=0.9, top_p=0.9, seed=7, extra_body={"top_k": 50})
    a, b = (ids_of(client.completions.create(**kw).choices[0]) for _ in range(2))
    c = ids_of(client.completions.create(**{**kw, "seed": 8}).choices[0])
    assert a == b and a != c
    del kw["seed"]
    assert ids_of(client.completions.create(**kw).choices[0]) != ids_of(client.completions.create(**kw).choices[0])


def test_logprobs_completions_and_chat(client):
    r = client.completions.create(model=MODEL, prompt="The cache", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen == max(top.values()) and sum(math.exp(v) for v in top.values()) <= 1
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob for t in content)
    assert [b for t in content for b in t.bytes] == ids_of(c.choices[0])
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], top_logprobs=2)


def test_echo_scores_the_prompt(client, reference_model):
    from v4stack.ops.mode import mode

    r = client.completions.create(model=MODEL, prompt="abcd", max_tokens=2, temperature=0, echo=True, logprobs=1)
    ch = r.choices[0]
    assert ch.text.startswith("abcd") and ch.logprobs.token_logprobs[0] is None and len(ch.logprobs.tokens) == 6
    with torch.no_grad(), mode("invariant"):
        lg = reference_model.step([(torch.tensor(TOK.encode("abcd")), reference_model.new_state())])[0]
    ref = torch.log_softmax(lg.float(), -1)
    for k, t in enumerate(TOK.encode("abcd")[1:]):
        assert ch.logprobs.token_logprobs[k + 1] == pytest.approx(float(ref[k, t]), abs=1e-5)
    plain = client.completions.create(model=MODEL, prompt="abcd", max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text == ch.text and plain.choices[0].logprobs is None


def test_n_and_best_of_share_the_prompt_cache(client, server):
    prompt = [(7 * i) % 251 for i in range(90)]
    hits0 = metric(httpx.get(server + "/metrics").text, "v4stack_prefix_hit_tokens_total")
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0, seed=11, n=3, logprobs=0)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.prompt_tokens == 90
    assert r.usage.completion_tokens == 12 and len({tuple(ids_of(c)) for c in r.choices}) > 1
    hits = metric(httpx.get(server + "/metrics").text, "v4stack_prefix_hit_tokens_total") - hits0
    assert hits >= 2 * 64  # both siblings were admitted onto the first choice's cached blocks
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    best = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0, seed=11, n=1, best_of=3)
    scores = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert len(best.choices) == 1 and ids_of(best.choices[0]) == ids_of(r.choices[scores.index(max(scores))])
    assert best.usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="x", n=3, best_of=2)


def test_stream_usage_and_batch_prompts(client):
    chunks = list(client.completions.create(model=MODEL, prompt="stream", max_tokens=7, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 7 and chunks[-1].usage.prompt_tokens == 6
    full = client.completions.create(model=MODEL, prompt="stream", max_tokens=7, temperature=0).choices[0].text
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full
    r = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == 4
    for c, p in zip(r.choices, ["ab", "cd"]):
        assert ids_of(c) == ids_of(client.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0).choices[0])
    r2 = client.completions.create(model=MODEL, prompt=[[97, 98], [99, 100]], max_tokens=3, temperature=0)
    assert [ids_of(c) for c in r2.choices] == [ids_of(c) for c in r.choices]
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model=MODEL, prompt="x", stream_options={"include_usage": True})
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "u"}], max_tokens=4,
                                               temperature=0, n=2, stream=True, stream_options={"include_usage": True}))
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 8
    assert {c.choices[0].index for c in chat[:-1]} == {0, 1}
    echoed = list(client.completions.create(model=MODEL, prompt="echo", max_tokens=3, temperature=0, stream=True,
                                            echo=True, logprobs=1))
    first = echoed[0].choices[0]
    assert first.text.startswith("echo") and first.logprobs.token_logprobs[0] is None
    assert sum(len(c.choices[0].logprobs.tokens) for c in echoed if c.choices[0].logprobs) == 4 + 3


def test_chat_token_limits(client):
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    ctx = client.models.retrieve(MODEL).model_extra["max_model_len"]
    overhead = len(TOK.encode(encode_chat([{"role": "user", "content": ""}])))
    long = [{"role": "user", "content": "z" * (ctx - overhead - 24)}]  # leaves 24 tokens of context
    r = client.chat.completions.create(model=MODEL, messages=long, temperature=0)
    assert r.usage.completion_tokens == ctx - r.usage.prompt_tokens > 16  # default: the rest of the context


def test_stop_ids_min_tokens_penalties_bias_min_p(client):
    from concurrent.futures import ThreadPoolExecutor

    def run(max_tokens=16, temperature=0, **kw):
        return client.completions.create(model=MODEL, prompt="penalty", max_tokens=max_tokens,
                                         temperature=temperature, **kw).choices[0]

    g = ids_of(run())
    k = g.index(g[3])
    cases = {  # sent at once (the engine batches them; in invariant mode each equals its run alone)
        "stop_ids": dict(extra_body={"stop_token_ids": [g[3]]}),
        "min_tokens": dict(extra_body={"stop_token_ids": [g[3]], "min_tokens": k + 1}),
        "ignore_eos": dict(extra_body={"ignore_eos": True}),  # no EOS configured: no change
        # greedy g repeats nothing, so penalties show by encouraging repeats (negative) or against a bias
        "freq": dict(frequency_penalty=-2.0), "pres": dict(presence_penalty=-2.0),
        "rep": dict(extra_body={"repetition_penalty": 3.0}),  # counts the prompt's tokens too
        "bias": dict(logit_bias={"65": 10}), "bias_freq": dict(logit_bias={"65": 10}, frequency_penalty=2.0),
        "bias_sampled": dict(max_tokens=5, temperature=1.0, logit_bias={"65": 100}),
        "min_p": dict(temperature=1.5, seed=3, extra_body={"min_p": 1.0}),
    }
    with ThreadPoolExecutor(len(cases)) as pool:
        got = dict(zip(cases, pool.map(lambda kw: run(**kw), cases.values())))
    assert ids_of(got["stop_ids"]) == g[: k + 1] and got["stop_ids"].finish_reason == "stop"
    out = ids_of(got["min_tokens"])
    assert len(out) > k + 1 and g[3] not in out[: k + 1]
    assert ids_of(got["ignore_eos"]) == g
    assert ids_of(got["freq"]) != g and ids_of(got["pres"]) != g and ids_of(got["rep"]) != g
    assert ids_of(got["bias"]) == [65] * 16
    bf = ids_of(got["bias_freq"])
    assert bf[:4] == [65] * 4 != bf[4:8]
    assert ids_of(got["bias_sampled"]) == [65] * 5
    assert ids_of(got["min_p"]) == g
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="x", logit_bias={"256": 1})


def _tool_request(client, stream=False, **kw):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    return tools, msgs, client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=6,
                                                       temperature=0, stream=stream, **kw)


def test_tool_calls(client):
    tools, msgs, r = _tool_request(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    prefix = tc.forced_prefix("get_weather")
    prompt = encode_chat(msgs, tools=tools) + prefix
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
    (want,) = parse_completion(prefix + plain)["tool_calls"]
    assert call.function.name == "get_weather" and call.function.arguments == want["function"]["arguments"]
    assert call.id.startswith("call_") and r.choices[0].message.content is None
    _, _, s = _tool_request(client, stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas = [d for ch in s for d in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [(0, "get_weather", call.function.arguments)]
    _, _, none = _tool_request(client, tool_choice="none")
    assert not none.choices[0].message.tool_calls and isinstance(none.choices[0].message.content, str)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        _tool_request(client, tool_choice={"type": "function", "function": {"name": "other"}})
    # a conversation that already called a tool and got its result renders and runs
    r = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, tools=tools, messages=[
        *msgs, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert r.choices[0].finish_reason == "length"


def test_errors_are_openai_shaped_and_name_the_field(client, server):
    with pytest.raises(openai.NotFoundError, match="model"):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    for kw, field in ((dict(max_tokens=-1), "max_tokens"), (dict(temperature=5), "temperature"),
                      (dict(suffix="tail"), "suffix"), (dict(extra_body={"bogus": 1}), "bogus"),
                      (dict(max_tokens=5000), "prompt"), (dict(stop=["x"] * 65), "stop")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", **kw)
        assert e.value.body["param"] == field, (kw, e.value.body)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_object"})
    for prompt, msg in (([], "at least one token"), ([5, 300], "token ids must lie in")):
        r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and msg in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": 5}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"


def test_request_id_is_echoed_and_used(server):
    r = httpx.post(server + "/v1/completions", headers={"X-Request-Id": "job-42.a"},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert r.headers["x-request-id"] == "job-42.a" and r.json()["id"] == "job-42.a"
    assert httpx.get(server + "/health", headers={"X-Request-Id": "h1"}).headers["x-request-id"] == "h1"
    r = httpx.post(server + "/v1/completions", headers={"X-Request-Id": "no spaces"}, json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert r.headers["x-request-id"] == r.json()["id"]


def test_metrics(client, server):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)
    text = httpx.get(server + "/metrics").text
    for name in ("v4stack_queue_depth", "v4stack_running", "v4stack_cache_blocks_used", "v4stack_prefix_hit_rate",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert re.search(rf"^{re.escape(name)}(\{{[^}}]*\}})? ", text, re.M), name
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"):
        for prefix in ("v4stack_", "vllm:"):
            assert f"# TYPE {prefix}{h} histogram" in text and metric(text, f"{prefix}{h}_count") >= 1
    assert metric(text, "v4stack_inter_token_latency_seconds_count") >= 2
    assert re.search(r'^v4stack_requests_total\{finish_reason="length"\} [1-9]', text, re.M)
    assert re.search(r'^vllm:request_success_total\{model_name="v4stack-tiny",finished_reason="length"\} [1-9]', text, re.M)
    json.dumps(text)  # plain text
