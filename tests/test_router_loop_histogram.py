"""The router's lock-free histogram (router/metrics.py LoopHistogram) exposes what prometheus_client's
Histogram would for the same observations: the planner and the dashboards read it unchanged."""

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from disagg.api import metrics as m
from disagg.router.metrics import LATENCY_BUCKETS, LoopHistogram, RouterMetrics

# below the first bound, on bounds (le is inclusive), between, above the last
VALUES = [0.0, 0.0004, 0.001, 0.00100001, 0.01, 0.3, 2.5, 59.9, 60, 61, 1e6]


def _lines(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_same_exposition_as_prometheus_client():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    h = LoopHistogram("x_seconds", "Doc.", LATENCY_BUCKETS, ours)
    ref = Histogram("x_seconds", "Doc.", buckets=LATENCY_BUCKETS, registry=theirs)
    assert _lines(ours) == _lines(theirs)          # empty
    for v in VALUES:
        h.observe(v)
        ref.observe(v)
    assert _lines(ours) == _lines(theirs)
    assert ours.get_sample_value("x_seconds_bucket", {"le": "0.001"}) == 3
    assert ours.get_sample_value("x_seconds_count") == len(VALUES)


def test_router_itl_is_read_by_name():
    metrics = RouterMetrics()
    metrics.itl.observe(0.01)
    metrics.itl.observe(0.02)
    assert metrics.registry.get_sample_value(f"{m.ROUTER_ITL_SECONDS}_count") == 2
    assert abs(metrics.registry.get_sample_value(f"{m.ROUTER_ITL_SECONDS}_sum") - 0.03) < 1e-12
