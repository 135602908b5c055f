"""Prometheus metrics (prometheus_client): request counters and latency histograms fed as requests end, and
scheduler gauges (queue, running batch, KV usage, cache hit rate) read from the engine at each scrape."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from ..engine.request_state import RequestState

# Latency buckets in seconds: CPU decode steps sit in the tens of milliseconds, whole requests in seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                   80.0, 160.0)


# The `_created` timestamp series double every counter's output and no dashboard reads them.
disable_created_metrics()


class ServerMetrics:
    """One registry per app, so servers in one process (tests) never share counters."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("furcate_requests", "Requests ended, by finish reason", ["finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("furcate_prompt_tokens", "Prompt tokens of ended requests", registry=r)
        self.generation_tokens = Counter("furcate_generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter("furcate_cached_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.ttft = Histogram("furcate_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("furcate_inter_token_latency_seconds", "Time per output token after the first",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("furcate_e2e_request_latency_seconds", "Request latency, arrival to last token",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.queue = Gauge("furcate_num_queue_reqs", "Requests waiting for admission", registry=r)
        self.running = Gauge("furcate_num_running_reqs", "Requests in the running batch", registry=r)
        self.kv_usage = Gauge("furcate_kv_usage", "Share of the KV pool in use (cached prefixes included)",
                              registry=r)
        self.cache_hit_rate = Gauge("furcate_cache_hit_rate", "Share of prompt tokens found in the prefix cache",
                                    registry=r)
        self.spec_accept_rate = Gauge("furcate_spec_accept_rate", "Speculative decoding: accepted / drafted tokens",
                                      registry=r)
        engine.request_observers.append(self.observe)

    def observe(self, state: RequestState) -> None:
        """Called by the engine's receiver thread as each request ends (prometheus_client is thread-safe)."""
        reason = state.finish_reason.kind if state.finish_reason is not None else "abort"
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(state.prompt_tokens)
        self.generation_tokens.inc(len(state.output_ids))
        self.cached_tokens.inc(state.cached_tokens)
        if state.first_token_at is not None:
            self.ttft.observe(state.first_token_at - state.created)
        ended = state.last_token_at if state.output_ids else time.perf_counter()
        self.e2e.observe(ended - state.created)
        for latency in state.inter_token_latencies:
            self.itl.observe(latency)

    async def render(self) -> tuple[bytes, str]:
        stats = self.engine.get_load()  # never waits for a busy scheduler
        self.queue.set(stats["waiting"] + stats["pending"])
        self.running.set(stats["running"])
        total = stats["max_total_tokens"]
        self.kv_usage.set((total - stats["kv_available"]) / total if total else 0.0)
        prompt = stats["prompt_tokens_total"]
        self.cache_hit_rate.set(stats["cached_tokens_total"] / prompt if prompt else 0.0)
        drafted = stats.get("spec_draft_tokens", 0)  # only an engine with speculative decoding counts drafts
        self.spec_accept_rate.set(stats["spec_accepted_tokens"] / drafted if drafted else 0.0)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
