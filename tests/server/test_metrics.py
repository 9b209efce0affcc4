"""The latency histograms resolve a fast GPU's token gaps and an overloaded server's waits."""

from __future__ import annotations

from asyncspec.server.metrics import RequestTimer, ServerMetrics


def _bucket(metrics: ServerMetrics, name: str, le: str) -> float:
    value = metrics.registry.get_sample_value(f"asyncspec:{name}_bucket", {"le": le})
    assert value is not None, (name, le)
    return value


def test_sub_millisecond_token_gaps_and_long_waits_land_in_their_own_buckets():
    metrics = ServerMetrics(dict)
    timer = RequestTimer(metrics, arrival=0.0)
    timer.on_delta(300.0, 1)  # five minutes queued under overload
    timer.on_delta(300.0002, 1)  # a graphed batch-1 step of a small model
    timer.on_delta(300.0008, 2)  # a two-token delta: two gaps of 0.3 ms
    timer.on_finish(300.0008, "length")
    # The 0.2 ms gap is told from the 0.3 ms ones, and none of them reads as 1 ms.
    assert _bucket(metrics, "inter_token_latency_seconds", "0.0001") == 0
    assert _bucket(metrics, "inter_token_latency_seconds", "0.00025") == 1
    assert _bucket(metrics, "inter_token_latency_seconds", "0.0005") == 3
    # A 300 s first token is not clamped into the last finite bucket.
    assert _bucket(metrics, "time_to_first_token_seconds", "160.0") == 0
    assert _bucket(metrics, "time_to_first_token_seconds", "640.0") == 1
    assert _bucket(metrics, "e2e_request_latency_seconds", "240.0") == 0
    assert _bucket(metrics, "e2e_request_latency_seconds", "480.0") == 1


def test_every_refusal_reason_is_exported_from_the_start():
    metrics = ServerMetrics(dict)
    for reason in ("queue_full", "invalid_request", "unavailable"):
        assert metrics.registry.get_sample_value("asyncspec:request_refused_total", {"reason": reason}) == 0
