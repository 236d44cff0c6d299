"""Prometheus metrics, one ``CollectorRegistry`` per app (no process-global state).

Latencies are measured here, per engine request (one choice of an OpenAI
request): time to first token, the gap between token-bearing deltas divided by
the tokens they carry, and end to end. Gauges that belong to other actors
(running and queued requests, KV pages, prefix hit rate) are read from
``EngineClient.stats()`` when ``/metrics`` is scraped, so they are never stale.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..messages.generate import FinishReason, TextDelta

__all__ = ["CONTENT_TYPE_LATEST", "GatewayMetrics", "RequestTrace"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r = self.registry
        self.http_requests = Counter(
            "actorlm_http_requests",
            "HTTP requests by route and status code",
            ["route", "status"],
            registry=r,
        )
        self.requests_finished = Counter(
            "actorlm_requests_finished",
            "Engine requests (one per choice) by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("actorlm_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(
            "actorlm_generation_tokens", "Tokens generated", registry=r
        )
        self.cached_tokens = Counter(
            "actorlm_cached_prompt_tokens", "Prompt tokens found in the prefix cache", registry=r
        )
        self.ttft = Histogram(
            "actorlm_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "actorlm_inter_token_latency_seconds",
            "Time between output tokens",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "actorlm_e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.actor_downs = Counter(
            "actorlm_actor_down",
            "Times a pipeline actor went down (died, hung, or restarted) as the gateway saw it",
            ["role"],
            registry=r,
        )
        self.actor_restarts = Counter(
            "actorlm_actor_restarts",
            "Times a pipeline actor came back after being down",
            ["role"],
            registry=r,
        )
        self.in_flight = Gauge(
            "actorlm_gateway_in_flight_requests",
            "Engine requests the gateway is streaming",
            registry=r,
        )
        self.running = Gauge(
            "actorlm_num_requests_running", "Requests in the running batch", registry=r
        )
        self.queued = Gauge(
            "actorlm_num_requests_waiting", "Requests waiting to be scheduled", registry=r
        )
        self.pages_used = Gauge("actorlm_kv_pages_used", "KV cache pages in use", registry=r)
        self.pages_total = Gauge("actorlm_kv_pages_total", "KV cache pages in the pool", registry=r)
        self.kv_usage = Gauge(
            "actorlm_kv_cache_usage_ratio", "Fraction of KV pages in use", registry=r
        )
        self.prefix_hit_rate = Gauge(
            "actorlm_prefix_cache_hit_rate", "Prefix cache hit rate", registry=r
        )
        self.ready = Gauge("actorlm_ready", "1 when every actor is ready", registry=r)
        # Prefill/decode disaggregation (--prefill-replicas), summed over decode replicas.
        self.pd = {
            key: Gauge(f"actorlm_{key}", doc, registry=r)
            for key, doc in (
                ("pd_remote_prefills", "Prompts prefilled on a prefill replica, KV shipped"),
                ("pd_local_prefills", "Prompts short enough to prefill on the decode replica"),
                (
                    "pd_local_busy",
                    "Long prompts prefilled on the decode replica: prefill queues full",
                ),
                ("pd_transfer_failures", "Remote prefills that failed (lost transfer or replica)"),
                ("pd_remote_in_flight", "Remote prefills not back yet"),
            )
        }
        # The lora_loader's counts (read from its stats, like the gauges above).
        self.lora = {
            key: Gauge(f"actorlm_lora_{key}", doc, registry=r)
            for key, doc in (
                ("adapters_loaded", "LoRA adapters requests can name"),
                ("slots_used", "Worker LoRA slots holding an adapter"),
                ("slot_hits", "Requests whose adapter was in a worker slot already"),
                ("slot_misses", "Requests whose adapter had to be loaded into a slot"),
                ("slot_loads", "Adapters loaded into a worker slot"),
                ("slot_evictions", "Adapters evicted from a worker slot for another"),
                ("adapter_loads", "Adapters read from disk and registered"),
                ("adapter_unloads", "Adapters unloaded"),
            )
        }

    def trace(self) -> RequestTrace:
        return RequestTrace(self)

    def fill_stats(self, stats: dict[str, dict[str, Any]], in_flight: int, ready: bool) -> None:
        """Set the gauges from actor stats; a missing or odd value leaves its gauge alone."""
        self.in_flight.set(in_flight)
        self.ready.set(1 if ready else 0)
        sched = _replicas_summed(stats, "scheduler")
        cache = _replicas_summed(stats, "cache_manager")
        for gauge, source, key in (
            (self.running, sched, "running"),
            (self.queued, sched, "queued"),
            (self.pages_used, cache, "pages_used"),
            (self.pages_total, cache, "pages_total"),
            (self.prefix_hit_rate, cache, "prefix_hit_rate"),
        ):
            value = _number(source.get(key))
            if value is not None:
                gauge.set(value)
        for key, gauge in self.pd.items():
            value = _number(sched.get(key))
            if value is not None:
                gauge.set(value)
        lora = stats.get("lora_loader", {})
        for key, gauge in self.lora.items():
            value = _number(lora.get(key))
            if value is not None:
                gauge.set(value)
        used, total = _number(cache.get("pages_used")), _number(cache.get("pages_total"))
        if used is not None and total:
            self.kv_usage.set(used / total)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _replicas_summed(stats: dict[str, dict[str, Any]], role: str) -> dict[str, Any]:
    """``role``'s stats, summed over its data-parallel replicas (``role.1``, ...): counts
    add up; the prefix hit rate is recomputed from the summed tokens."""
    parts = [v for r, v in stats.items() if r == role or r.startswith(f"{role}.")]
    if len(parts) <= 1:
        return parts[0] if parts else {}
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if _number(value) is not None:
                out[key] = out.get(key, 0) + value
    asked = _number(out.get("prefix_requested_tokens"))
    if asked:
        out["prefix_hit_rate"] = out.get("prefix_matched_tokens", 0) / asked
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class RequestTrace:
    """Timing of one engine request; feed it every delta, in order."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.last_token: float | None = None
        self.done = False

    def on_delta(self, delta: TextDelta) -> None:
        now = time.monotonic()
        tokens = len(delta.token_ids)
        if tokens:
            if self.last_token is None:
                self.metrics.ttft.observe(now - self.start)
            else:
                gap = (now - self.last_token) / tokens
                for _ in range(tokens):
                    self.metrics.itl.observe(gap)
            self.last_token = now
        if delta.finish_reason is not None:
            self.finish(delta.finish_reason, now)
            if delta.usage is not None:
                self.metrics.prompt_tokens.inc(delta.usage.prompt_tokens)
                self.metrics.generation_tokens.inc(delta.usage.completion_tokens)
                self.metrics.cached_tokens.inc(delta.usage.cached_tokens)

    def finish(self, reason: FinishReason, now: float | None = None) -> None:
        """Record the end once; a request cut short (disconnect) ends as ``abort``."""
        if self.done:
            return
        self.done = True
        self.metrics.requests_finished.labels(finish_reason=reason).inc()
        self.metrics.e2e.observe((now or time.monotonic()) - self.start)
