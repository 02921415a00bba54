"""The OpenAI-compatible server through the official `openai` client, on a real process."""

import httpx
import openai
import pytest

from v4stack.tokenizer import ByteTokenizer

from .conftest import greedy_ref

MODEL = "v4stack-tiny"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_completion_equals_single_request_greedy_decode(client, reference_model):
    r = client.completions.create(model=MODEL, prompt="The cache", max_tokens=10, temperature=0)
    ids = greedy_ref(reference_model, ByteTokenizer().encode("The cache"), 10)
    assert r.choices[0].model_extra["token_ids"] == ids
    assert r.choices[0].text == ByteTokenizer().decode(ids)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 9 and r.usage.completion_tokens == 10


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt="seed me", max_tokens=8, temperature=0.9, top_p=0.9, seed=7, extra_body={"top_k": 50})
    a = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    b = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    c = client.completions.create(**{**kw, "seed": 8}).choices[0].model_extra["token_ids"]
    assert a == b and a != c


def test_chat_and_stop_string(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=6, temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    full = client.completions.create(model=MODEL, prompt="stop test", max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text[3:5]
    if stop and "\ufffd" not in stop:
        cut = client.completions.create(model=MODEL, prompt="stop test", max_tokens=12, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == text[: text.find(stop)]


def test_streaming_completion_and_chat(client):
    full = client.completions.create(model=MODEL, prompt="stream", max_tokens=12, temperature=0).choices[0].text
    parts, reasons = [], []
    for chunk in client.completions.create(model=MODEL, prompt="stream", max_tokens=12, temperature=0, stream=True):
        parts.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(parts) == full and reasons[-1] == "length"
    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "s"}], max_tokens=5, temperature=0, stream=True)]
    assert deltas[0].role == "assistant"


def test_errors_name_the_field(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert e.value.status_code == 400 and "model" in str(e.value)
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=5)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x" * 5000, max_tokens=2)
    assert "exceeds" in str(e.value)
    for prompt, msg in (([], "at least one token"), ([5, 300], "token ids must lie in")):
        r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and msg in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "prompt"
    r = httpx.post(server + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 422 and r.json()["error"]["param"] == "messages"
    # the server is still fine
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1, temperature=0).choices[0].finish_reason == "length"


def test_metrics(server):
    text = httpx.get(server + "/metrics").text
    for name in ("v4stack_queue_depth", "v4stack_running", "v4stack_cache_blocks_used", "v4stack_cache_blocks_free",
                 "v4stack_prefix_hit_rate", "v4stack_generation_tokens_per_second",
                 "v4stack_time_to_first_token_seconds_p50"):
        assert f"\n{name} " in "\n" + text, name
