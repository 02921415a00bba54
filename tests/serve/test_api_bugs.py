"""Regression tests for the API bugs of issue 17, on a real server (each failed on the old code;
bugs 4, 5 and most of 6 are covered in test_api.py)."""

import codecs
import json
import re
import time

import httpx
import openai
import pytest

from v4stack.tokenizer import ByteTokenizer

MODEL = "v4stack-tiny"
TOK = ByteTokenizer()


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def wait_idle(server: str, within: float) -> str:
    deadline = time.time() + within
    while True:
        m = httpx.get(server + "/metrics").text
        if metric(m, "v4stack_running") == 0 and metric(m, "v4stack_queue_depth") == 0 \
                and metric(m, "v4stack_cache_blocks_used") == 0:
            return m
        assert time.time() < deadline, "requests still hold the engine"
        time.sleep(0.1)


def raw_post(server: str, body: str, path="/v1/completions") -> httpx.Response:
    return httpx.post(server + path, content=body.encode(), headers={"content-type": "application/json"}, timeout=60)


def test_nonstream_request_is_aborted_when_the_client_leaves(server):  # bug 1
    body = {"model": MODEL, "prompt": "leave early", "max_tokens": 2000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, timeout=httpx.Timeout(1.5, connect=10))
    wait_idle(server, 10)  # 2000 tokens would take minutes on this model


def _stop_inside(text: str, start: int = 3):
    for i in range(start, len(text) - 2):
        s = text[i : i + 3]
        if "\ufffd" not in s and text.find(s) == i:
            return i, s
    return None, None


def test_stream_never_shows_part_of_a_stop_string(server):  # bug 2
    c = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=120)
    full = c.completions.create(model=MODEL, prompt="stop test", max_tokens=32, temperature=0).choices[0].text
    i, stop = _stop_inside(full)
    assert stop, full
    parts = [ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt="stop test", max_tokens=32,
                                                               temperature=0, stop=[stop], stream=True)]
    assert "".join(parts) == full[:i]
    msgs = [{"role": "user", "content": "stop test"}]
    full = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, temperature=0).choices[0].message.content
    i, stop = _stop_inside(full)
    assert stop, full
    parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=32, temperature=0, stop=[stop], stream=True)]
    assert "".join(parts) == full[:i]


def test_lone_surrogates_are_400(server):  # bug 3
    for path, body, field in (
            ("/v1/completions", '{"model": "%s", "prompt": "a\\ud800b"}' % MODEL, "prompt"),
            ("/v1/completions", '{"model": "x\\udfff", "prompt": "a"}', "model"),
            ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL,
             "messages[0].content")):
        r = raw_post(server, body, path)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_tiny_temperature_is_greedy(server):  # bug 7
    c = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=120)
    greedy = c.completions.create(model=MODEL, prompt="tiny t", max_tokens=6, temperature=0).choices[0]
    r = raw_post(server, json.dumps({"model": MODEL, "prompt": "tiny t", "max_tokens": 6, "temperature": 1e-309}))
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy.model_extra["token_ids"]


def test_seed_out_of_range_is_400_naming_seed(server):  # bug 8
    for stream in (False, True):
        r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", "seed": 2**70, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


def test_parse_errors_404_405_are_openai_shaped(server):  # bug 9
    for r, status in ((raw_post(server, "{not json"), 400), (raw_post(server, '{"a": NaN}'), 400),
                      (httpx.get(server + "/v1/nowhere"), 404), (httpx.delete(server + "/v1/completions"), 405),
                      (httpx.get(server + "/v1/completions"), 405), (raw_post(server, "[1, 2]"), 400)):
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text


def test_stop_strings_are_limited(server):  # bug 10
    t0 = time.perf_counter()
    r = httpx.post(server + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 50, "stop": [f"s{i}" for i in range(100_000)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", "stop": ["y" * 257]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert time.perf_counter() - t0 < 30


def test_large_body_is_413_and_health_stays_fast(server):  # bug 11
    big = b'{"model": "%s", "prompt": "' % MODEL.encode() + b"a" * (10 << 20) + b'"}'
    r = httpx.post(server + "/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"

    def chunks():  # no Content-Length: the limit applies to what arrives
        for _ in range(40):
            yield b"a" * (256 << 10)

    r = httpx.post(server + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413


def test_stream_releases_text_as_soon_as_its_bytes_are_complete(server):  # bug 12
    from concurrent.futures import ThreadPoolExecutor

    c = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(model=MODEL, prompt="bytes", max_tokens=40, temperature=0)
    with ThreadPoolExecutor(2) as pool:  # both at once: the engine batches them
        whole = pool.submit(lambda: c.completions.create(**kw).choices[0].model_extra["token_ids"])
        got = [ch.choices[0].text for ch in c.completions.create(**kw, stream=True)]
        ids = whole.result()
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    want = [dec.decode(bytes([t])) for t in ids]
    want[-1] += dec.decode(b"", final=True)
    assert [w for w in want if w] == [g for g in got if g]
    assert sum(w.count("\ufffd") for w in want) > 0  # the output does hold invalid bytes


def test_metrics_are_histograms(server):  # bug 13
    httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "m", "max_tokens": 2})
    m = httpx.get(server + "/metrics").text
    assert "# TYPE v4stack_time_to_first_token_seconds histogram" in m
    assert metric(m, "v4stack_time_to_first_token_seconds_count") >= 1
    from v4stack.serve.metrics import Histogram

    h = Histogram()
    for i in range(100_000):
        h.observe((i % 1000) / 1000)
    assert h.n == 100_000 and len(h.counts) == len(h.bounds) + 1  # fixed size, whatever was observed
    assert h.quantile(0.5) == 0.5 and h.quantile(0.99) == 1.0


def test_no_lax_coercion(server):  # bug 14
    for field, value in (("max_tokens", "5"), ("max_tokens", True), ("max_tokens", 2.0), ("stream", "yes"),
                         ("temperature", "0.5"), ("n", 1.0), ("echo", 1), ("logprobs", False)):
        r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value, r.text)
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": ["5", "6"], "max_tokens": 1,
                                                     "temperature": 0}).json()
    assert len(r["choices"]) == 2 and r["usage"]["prompt_tokens"] == 2  # two string prompts, not ids [5, 6]


def test_unimplemented_fields_are_refused(server):  # bug 6 (the rest is in test_api.py)
    for extra, field in (({"suffix": "end"}, "suffix"), ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"guided_json": {}}, "guided_json"), ({"functions": []}, "functions")):
        r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
