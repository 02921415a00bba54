"""Prometheus text exposition: the engine's gauges and counters, latency histograms, requests by
finish reason, and the ``vllm:``-named series dashboards built for vLLM expect.

Histograms have fixed buckets: an observation is one bisect and two additions, a scrape is
linear in the number of buckets, whatever the number of requests served.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter

from v4stack.serve.runner import EngineRunner

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.n = 0
        self._lock = threading.Lock()

    def observe(self, v: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, v)] += 1
            self.sum += v
            self.n += 1

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding quantile ``q`` (0 when empty)."""
        if not self.n:
            return 0.0
        target, acc = q * self.n, 0
        for b, c in zip(self.bounds + (float("inf"),), self.counts):
            acc += c
            if acc >= target:
                return b
        return float("inf")

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.sum:.6g}", f"{name}_count {self.n}"]
        return out


class ApiMetrics:
    """What the HTTP edge observes per request (times measured at the edge)."""

    def __init__(self):
        self.ttft, self.itl, self.e2e, self.queue = Histogram(), Histogram(), Histogram(), Histogram()
        self.finished: Counter = Counter()  # finish reason -> requests
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.rejected: Counter = Counter()  # HTTP status -> responses refused before any work

    def record(self, *, arrival: float, first: float | None, last: float, token_gaps: list[float],
               queue_s: float | None, reason: str, prompt_tokens: int, cached_tokens: int) -> None:
        if first is not None:
            self.ttft.observe(first - arrival)
        for g in token_gaps:
            self.itl.observe(g)
        self.e2e.observe(last - arrival)
        if queue_s is not None:
            self.queue.observe(queue_s)
        self.finished[reason] += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens


_HIST = (("time_to_first_token_seconds", "ttft", "time from arrival to the first token"),
         ("inter_token_latency_seconds", "itl", "time between consecutive tokens of a request"),
         ("e2e_request_latency_seconds", "e2e", "time from arrival to the last token"),
         ("request_queue_time_seconds", "queue", "time from arrival to first admission"))


def render(runner: EngineRunner, api: ApiMetrics, model_name: str, inflight: int = 0) -> str:
    e = runner.engine
    st, cs = e.stats, e.cache.stats()
    up = max(time.perf_counter() - st.started, 1e-9)
    waiting, running = len(e.scheduler.waiting), len(e.scheduler.running)
    used_frac = cs["blocks_used"] / max(cs["blocks_total"], 1)
    rows = [
        ("v4stack_queue_depth", "gauge", "requests waiting for admission", waiting),
        ("v4stack_running", "gauge", "requests holding cache", running),
        ("v4stack_cache_blocks_used", "gauge", "blocks referenced by running requests", cs["blocks_used"]),
        ("v4stack_cache_blocks_cached", "gauge", "unreferenced blocks kept for prefix reuse", cs["blocks_cached"]),
        ("v4stack_cache_blocks_free", "gauge", "blocks never used or evicted", cs["blocks_free"]),
        ("v4stack_state_slots_free", "gauge", "free per-request state slots", cs["slots_free"]),
        ("v4stack_prefix_hit_rate", "gauge", "prompt tokens served from the prefix cache / prompt tokens", cs["prefix_hit_rate"]),
        ("v4stack_prefix_hit_tokens_total", "counter", "prompt tokens served from the prefix cache", e.cache.prefix_hit_tokens),
        ("v4stack_preemptions_total", "counter", "requests preempted for cache space", e.scheduler.preemptions),
        ("v4stack_tokens_generated_total", "counter", "sampled tokens", st.tokens_generated),
        ("v4stack_tokens_computed_total", "counter", "tokens fed through the model", st.tokens_computed),
        ("v4stack_generation_tokens_per_second", "gauge", "sampled tokens per second since start", st.tokens_generated / up),
        ("v4stack_time_to_first_token_seconds_p50", "gauge", "median time to first token (bucket bound)", api.ttft.quantile(0.5)),
        ("v4stack_time_to_first_token_seconds_p99", "gauge", "p99 time to first token (bucket bound)", api.ttft.quantile(0.99)),
        ("v4stack_requests_finished_total", "counter", "requests finished (stop or length)", st.finished),
        ("v4stack_requests_aborted_total", "counter", "requests aborted (client gone, stop string or error)", st.aborted),
        ("v4stack_api_requests_in_flight", "gauge", "engine requests the HTTP API submitted and not yet finished", inflight),
    ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(value):.6g}"]
    for name, attr, help_ in _HIST:
        h = getattr(api, attr)
        out += [f"# HELP v4stack_{name} {help_}", f"# TYPE v4stack_{name} histogram"] + h.lines(f"v4stack_{name}")
    out += ["# HELP v4stack_requests_total requests answered, by finish reason", "# TYPE v4stack_requests_total counter"]
    out += [f'v4stack_requests_total{{finish_reason="{r}"}} {n}' for r, n in sorted(api.finished.items())]
    out += ["# HELP v4stack_requests_rejected_total requests refused before any work, by HTTP status",
            "# TYPE v4stack_requests_rejected_total counter"]
    out += [f'v4stack_requests_rejected_total{{status="{s}"}} {n}' for s, n in sorted(api.rejected.items())]
    # vLLM-named series (one label set: the served model)
    esc = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    lab = f'model_name="{esc}"'
    vrows = [
        ("vllm:num_requests_running", "gauge", "requests in the running batch", running),
        ("vllm:num_requests_waiting", "gauge", "requests waiting to be admitted", waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "fraction of cache blocks in use (1 = full)", used_frac),
        ("vllm:prompt_tokens_total", "counter", "prompt tokens of finished requests", api.prompt_tokens),
        ("vllm:generation_tokens_total", "counter", "generated tokens", st.tokens_generated),
        ("vllm:num_preemptions_total", "counter", "preemptions", e.scheduler.preemptions),
        ("vllm:prefix_cache_queries_total", "counter", "prompt tokens looked up in the prefix cache", e.cache.prefix_query_tokens),
        ("vllm:prefix_cache_hits_total", "counter", "prompt tokens found in the prefix cache", e.cache.prefix_hit_tokens),
    ]
    for name, kind, help_, value in vrows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{lab}}} {float(value):.6g}"]
    for name, attr, help_ in _HIST:
        h = getattr(api, attr)
        vname = f"vllm:{name}"
        out += [f"# HELP {vname} {help_}", f"# TYPE {vname} histogram"]
        out += [ln.replace("_bucket{", f"_bucket{{{lab},", 1) if "_bucket{" in ln else ln.replace(" ", f"{{{lab}}} ", 1)
                for ln in h.lines(vname)]
    out += ["# HELP vllm:request_success_total finished requests, by finish reason",
            "# TYPE vllm:request_success_total counter"]
    out += [f'vllm:request_success_total{{{lab},finished_reason="{r}"}} {n}' for r, n in sorted(api.finished.items())]
    return "\n".join(out) + "\n"
