"""/metrics with data-parallel replicas: each gauge is the sum over the replicas, and
the prefix hit rate comes from the summed tokens (pure: no server)."""

from __future__ import annotations

from actorlm.gateway.metrics import GatewayMetrics


def gauge(m: GatewayMetrics, name: str) -> float:
    value = m.registry.get_sample_value(name)
    assert value is not None, name
    return value


def test_gauges_add_up_over_replicas() -> None:
    m = GatewayMetrics("tiny")
    stats = {
        "scheduler": {"running": 2, "queued": 1},
        "scheduler.1": {"running": 3, "queued": 0},
        "cache_manager": {"pages_used": 10, "pages_total": 100, "prefix_matched_tokens": 30,
                          "prefix_requested_tokens": 100, "prefix_hit_rate": 0.3},
        "cache_manager.1": {"pages_used": 30, "pages_total": 100, "prefix_matched_tokens": 270,
                            "prefix_requested_tokens": 300, "prefix_hit_rate": 0.9},
    }  # fmt: skip
    m.fill_stats(stats, in_flight=5, ready=True)
    assert gauge(m, "actorlm_num_requests_running") == 5
    assert gauge(m, "actorlm_kv_pages_used") == 40
    assert gauge(m, "actorlm_prefix_cache_hit_rate") == 0.75  # 300 of 400, not 0.3 + 0.9
    one = GatewayMetrics("tiny")
    one.fill_stats({k: v for k, v in stats.items() if "." not in k}, in_flight=0, ready=True)
    assert gauge(one, "actorlm_prefix_cache_hit_rate") == 0.3
