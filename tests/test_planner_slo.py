"""status.latency and SLOMet from a real Prometheus scraping an exporter whose latencies the test sets:
True or False on numbers (in the message), Unknown with a reason when there are none to judge."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disagg.api.v1alpha1 import SLOSpec
from disagg.e2e.prometheus import LocalPrometheus, MetricsExporter
from disagg.e2e.testing import wait_for
from disagg.planner import reasons, slo
from disagg.planner.metrics_source import PrometheusSource

NS, NAME = "team-slo", "llama"
WINDOW = 4.0
SLO = SLOSpec(ttftMs=1000, itlMs=50, percentile=90)


@pytest.fixture(scope="module")
def exporter():
    e = MetricsExporter(NS, NAME)
    yield e
    e.close()


@pytest.fixture(scope="module")
def source(exporter, tmp_path_factory):
    p = LocalPrometheus(tmp_path_factory.mktemp("prometheus"), [f"127.0.0.1:{exporter.port}"]).start()
    s = PrometheusSource(p.url, timeout=3)
    yield s
    s.close()
    p.stop()


def judged_until(exporter, source, reason, what, **traffic):
    """Set the traffic, then wait (on the condition) until the verdict from Prometheus has ``reason``."""
    exporter.traffic = replace(exporter.traffic, **traffic)

    def judged():
        v = slo.judge(source.observe(NS, NAME, SLO.percentile, WINDOW), SLO, WINDOW)
        return v if v.reason == reason else None
    return wait_for(judged, 60, what, interval=0.5)


def test_targets_met_with_the_numbers(exporter, source):
    v = judged_until(exporter, source, reasons.TARGETS_MET, "fast traffic judged", rate=10.0, ttft=0.3, itl=0.02)
    assert v.status == "True"
    assert 200 < v.latency["ttftMs"] <= 400 and 10 < v.latency["itlMs"] <= 30 and v.latency["percentile"] == 90
    assert "p90 TTFT" in v.message and "target 1000 ms" in v.message and "target 50 ms" in v.message


def test_a_ttft_breach_is_false_and_says_which(exporter, source):
    v = judged_until(exporter, source, reasons.TTFT_ABOVE, "slow first tokens judged", rate=10.0, ttft=3.0, itl=0.02)
    assert v.status == "False" and v.latency["ttftMs"] > 1000
    assert f"TTFT {v.latency['ttftMs']:g} ms > target 1000 ms" in v.message
    v = judged_until(exporter, source, reasons.BOTH_ABOVE, "both targets missed", rate=10.0, ttft=3.0, itl=0.2)
    assert v.status == "False" and v.latency["itlMs"] > 50


def test_no_traffic_is_unknown(exporter, source):
    v = judged_until(exporter, source, reasons.NO_TRAFFIC, "an idle deployment", rate=0.0)
    assert v.status == "Unknown" and "ttftMs" not in v.latency
    exporter.traffic = replace(exporter.traffic, rate=10.0, ttft=0.3, itl=0.02)


def test_unknown_without_metrics_or_prometheus(source):
    v = slo.judge(source.observe(NS, "no-such-deployment", 90, WINDOW), SLO, WINDOW)
    assert (v.status, v.reason) == ("Unknown", reasons.NO_METRICS) and "disagg_router_requests_total" in v.message
    gone = PrometheusSource("http://127.0.0.1:9", timeout=1)
    v = slo.judge(gone.observe(NS, NAME, 90, WINDOW), SLO, WINDOW)
    assert (v.status, v.reason) == ("Unknown", reasons.PROMETHEUS_UNREACHABLE) and "127.0.0.1:9" in v.message
    gone.close()
