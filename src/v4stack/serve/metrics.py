"""Prometheus text exposition of the engine's numbers."""

from __future__ import annotations

import time

from v4stack.serve.runner import EngineRunner


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def render(runner: EngineRunner) -> str:
    e = runner.engine
    st, cs = e.stats, e.cache.stats()
    up = max(time.perf_counter() - st.started, 1e-9)
    rows = [
        ("v4stack_queue_depth", "gauge", "requests waiting for admission", len(e.scheduler.waiting)),
        ("v4stack_running", "gauge", "requests holding cache", len(e.scheduler.running)),
        ("v4stack_cache_blocks_used", "gauge", "blocks referenced by running requests", cs["blocks_used"]),
        ("v4stack_cache_blocks_cached", "gauge", "unreferenced blocks kept for prefix reuse", cs["blocks_cached"]),
        ("v4stack_cache_blocks_free", "gauge", "blocks never used or evicted", cs["blocks_free"]),
        ("v4stack_state_slots_free", "gauge", "free per-request state slots", cs["slots_free"]),
        ("v4stack_prefix_hit_rate", "gauge", "prompt tokens served from the prefix cache / prompt tokens", cs["prefix_hit_rate"]),
        ("v4stack_preemptions_total", "counter", "requests preempted for cache space", e.scheduler.preemptions),
        ("v4stack_tokens_generated_total", "counter", "sampled tokens", st.tokens_generated),
        ("v4stack_tokens_computed_total", "counter", "tokens fed through the model", st.tokens_computed),
        ("v4stack_generation_tokens_per_second", "gauge", "sampled tokens per second since start", st.tokens_generated / up),
        ("v4stack_time_to_first_token_seconds_p50", "gauge", "median time to first token", _quantile(st.ttft, 0.5)),
        ("v4stack_time_to_first_token_seconds_p99", "gauge", "p99 time to first token", _quantile(st.ttft, 0.99)),
        ("v4stack_requests_finished_total", "counter", "requests finished (stop or length)", st.finished),
        ("v4stack_requests_aborted_total", "counter", "requests aborted (client gone or error)", st.aborted),
    ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(value):.6g}"]
    return "\n".join(out) + "\n"
