"""The planner against a real Prometheus scraping real /metrics endpoints whose latencies the test sets.

The exporter (disagg.e2e.prometheus.MetricsExporter) serves the router's and vLLM's metric names
from disagg.api.metrics with prometheus_client; a thread plays requests at the rate and latencies
the test chooses.
"""

import time
from dataclasses import replace

import pytest

from disagg.api import metrics as m
from disagg.api.v1alpha1 import SLOSpec
from disagg.e2e.prometheus import LocalPrometheus, MetricsExporter
from disagg.e2e.testing import wait_for
from disagg.perf.model import PerfModel
from disagg.planner import decide as dc
from disagg.planner import reasons, slo
from disagg.planner.endpoints import Allowlist, Endpoint
from disagg.planner.metrics_source import Labels, PrometheusSource, parse_duration, query_window

NS, NAME = "team-a", "llama"
WINDOW = 4.0  # seconds of rate() window: four 1 s scrapes
MODEL = PerfModel.analytic("meta-llama/Llama-3.1-8B-Instruct", "H100-SXM")


@pytest.fixture(scope="module")
def exporter():
    e = MetricsExporter(NS, NAME)
    yield e
    e.close()


@pytest.fixture(scope="module")
def prometheus(exporter, tmp_path_factory):
    p = LocalPrometheus(tmp_path_factory.mktemp("prometheus"), [f"127.0.0.1:{exporter.port}"]).start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def source(prometheus):
    s = PrometheusSource(prometheus.url, timeout=3)
    yield s
    s.close()


def observe(source):
    return source.observe(NS, NAME, 90, WINDOW)


def settle(exporter, source, check, what, **traffic):
    """Change the traffic and wait (on a condition, not a sleep) until Prometheus shows it."""
    exporter.traffic = replace(exporter.traffic, **traffic)
    # generous: rates need two scrapes after the change, and a loaded CI machine scrapes late (60 s was missed
    # at load average 26-38); a passing run returns as soon as Prometheus shows the traffic
    return wait_for(lambda: (lambda o: o if check(o) else None)(observe(source)), 240, what, interval=0.5)


def target(**kw):
    base = dict(prefill=2, decode=2, ttft_target=1.0, itl_target=0.05, cooldown=60.0, interval=5.0, startup=10.0)
    base.update(kw)
    return dc.Target(**base)


def test_observation_reads_every_series(exporter, source):
    o = settle(exporter, source, lambda o: o.request_rate and o.request_rate > 7 and o.ttft and o.ttft < 0.5
               and o.itl and o.itl < 0.03, "steady traffic in Prometheus", rate=10.0, ttft=0.3, itl=0.02)
    assert o.error is None and o.missing == ()
    assert o.request_rate == pytest.approx(10, rel=0.35)
    assert 0.2 < o.ttft <= 0.4 and 0.01 < o.itl <= 0.03  # inside the observed value's bucket
    assert o.input_tokens_mean == pytest.approx(2000, rel=0.01) and o.output_tokens_mean == pytest.approx(200, rel=0.01)
    assert 1024 < o.input_tokens_p <= 2048 and 1024 < o.input_tokens_tail <= 2048  # p90 and p99 alike
    assert o.prefix_hit_ratio == pytest.approx(0.25, abs=0.02)
    assert o.prefill_queue == 0 and o.decode_running == 1 and o.decode_kv_usage == 0.5


def test_ttft_breach_scales_prefill_up(exporter, source):
    o = settle(exporter, source, lambda o: o.ttft and o.ttft > 2.0 and o.prefill_queue == 8,
               "TTFT above target", rate=10.0, ttft=3.0, itl=0.02, prefill_waiting=8, decode_waiting=0)
    # (the exporter is one engine per role: a deployment of one replica each, all serving; with more asked
    # for than engines report, the latency would measure the old size and the breach rule waits)
    d, _ = dc.decide(o, target(prefill=1, decode=1), dc.Memory(), MODEL, now=1000)
    assert d.metrics_ok and d.prefill.replicas > 1 and d.prefill.direction(1) == "up"
    assert d.decode.replicas == 1  # ITL fine: decode untouched
    assert d.inputs["ttft"] > 2.0 and d.reason == dc.SCALED


def test_itl_breach_scales_decode_up(exporter, source):
    o = settle(exporter, source, lambda o: o.itl and o.itl > 0.1 and o.ttft and o.ttft < 0.5,
               "ITL above target", rate=10.0, ttft=0.3, itl=0.2, prefill_waiting=0, decode_waiting=0)
    d, _ = dc.decide(o, target(prefill=1, decode=1), dc.Memory(), MODEL, now=1000)
    assert d.decode.replicas > 1 and d.prefill.replicas == 1


def test_both_scale_down_after_load_drops_and_the_cooldown(exporter, source):
    busy = settle(exporter, source, lambda o: o.request_rate and o.request_rate > 30 and o.ttft and o.ttft > 1.0,
                  "a busy deployment", rate=40.0, ttft=1.5, itl=0.06, prefill_waiting=12, decode_waiting=0)
    mem = dc.Memory()
    t = target(prefill=1, decode=1, cooldown=60.0)  # (one engine per role, as the exporter reports)
    up, mem = dc.decide(busy, t, mem, MODEL, now=0)
    assert up.prefill.replicas > 1 and up.decode.replicas > 1
    t = replace(t, prefill=up.prefill.replicas, decode=up.decode.replicas)
    quiet = settle(exporter, source, lambda o: o.request_rate is not None and o.request_rate < 2
                   and o.ttft and o.ttft < 0.5 and o.itl and o.itl < 0.03, "a quiet deployment",
                   rate=1.0, ttft=0.3, itl=0.02, prefill_waiting=0, decode_waiting=0)
    sizes = {}
    for now in range(5, 125, 5):  # the loop, every interval (5 s here), with what Prometheus shows
        d, mem = dc.decide(quiet, t, mem, MODEL, now=now)
        if now < 60:
            assert (d.prefill.replicas, d.decode.replicas) == (t.prefill, t.decode), now
            assert d.reason == dc.COOLDOWN
        sizes[now] = (d.prefill.replicas, d.decode.replicas)
        t = replace(t, prefill=d.prefill.replicas, decode=d.decode.replicas)
    assert t.prefill < up.prefill.replicas and t.decode < up.decode.replicas
    assert min(min(s) for s in sizes.values()) >= 1
    # slowly: never more than a quarter of a role (or one replica) per interval
    steps = list(sizes.values())
    assert all(a[0] - b[0] <= max(1, a[0] // 4) and a[1] - b[1] <= max(1, a[1] // 4) for a, b in zip(steps, steps[1:]))


def test_missing_series_hold_and_name_what_is_missing(source):
    o = source.observe(NS, "no-such-deployment", 90, WINDOW)
    assert o.missing == (m.ROUTER_REQUESTS,)
    d, _ = dc.decide(o, target(prefill=3, decode=4), dc.Memory(), MODEL, now=0)
    assert (d.prefill.replicas, d.decode.replicas) == (3, 4) and d.reason == dc.METRICS_UNAVAILABLE
    assert m.ROUTER_REQUESTS in d.message


def test_hold_when_prometheus_is_stopped(exporter, source, prometheus):
    settle(exporter, source, lambda o: o.ttft and o.ttft > 2.0, "TTFT above target", rate=10.0, ttft=3.0,
           prefill_waiting=8)
    prometheus.stop()
    try:
        started = time.monotonic()
        o = observe(source)
        assert time.monotonic() - started < 10  # no long retry loop inside one interval
        assert o.error and prometheus.url in o.error
        d, mem = dc.decide(o, target(prefill=2, decode=2), dc.Memory(), MODEL, now=0)
        assert (d.prefill.replicas, d.decode.replicas) == (2, 2)  # would have scaled up; holds instead
        assert d.reason == dc.PROMETHEUS_UNREACHABLE and not d.metrics_ok and mem == dc.Memory()
    finally:
        prometheus.start()
    o = wait_for(lambda: (lambda o: o if o.error is None and o.request_rate else None)(observe(source)), 240,
                 "Prometheus back")
    assert o.request_rate > 0


def test_a_refused_query_is_a_query_error_without_prometheus_text(exporter, source, prometheus):
    # a label name PromQL cannot parse unquoted: Prometheus answers, with an error, on every query
    broken = PrometheusSource(prometheus.url, timeout=3, labels=Labels(namespace="1namespace"), name="main")
    try:
        o = broken.observe(NS, NAME, 90, WINDOW)
    finally:
        broken.close()
    assert o.error_reason == reasons.QUERY_ERROR
    # the endpoint's name, the HTTP status, Prometheus' error type and the planner's own query; not the
    # remote end's text (which an endpoint that is not Prometheus could fill with anything)
    assert o.error.startswith("Prometheus endpoint 'main' refused the request_rate query (HTTP 400, bad_data); "
                              "query: "), o.error
    assert "1namespace" in o.error and "parse error" not in o.error
    d, mem = dc.decide(o, target(prefill=3, decode=2), dc.Memory(), MODEL, now=0)
    assert d.reason == reasons.QUERY_ERROR and not d.metrics_ok and (d.prefill.replicas, d.decode.replicas) == (3, 2)
    assert "bad_data" in d.message and mem == dc.Memory()
    v = slo.judge(o, SLOSpec(ttftMs=1000, itlMs=50, percentile=90), WINDOW)
    assert (v.status, v.reason) == ("Unknown", reasons.QUERY_ERROR)
    # the same source with sound queries reads Prometheus as before: it was the query, not Prometheus
    assert observe(source).error is None


def test_windows_span_four_scrapes(exporter, source, prometheus):
    assert query_window(5, 15) == 60 and query_window(120, 15) == 120 and query_window(5, 1) == 5
    assert parse_duration("15s") == 15 and parse_duration("1m30s") == 90 and parse_duration("0.5") == 0.5
    for bad in ("abc", "1x", "0s", "-5"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    # an interval shorter than a scrape (this Prometheus scrapes every second) still reads a rate
    settle(exporter, source, lambda o: o.request_rate and o.request_rate > 7, "steady traffic", rate=10.0,
           ttft=0.3, itl=0.02, prefill_waiting=0, decode_waiting=0)
    o = source.observe(NS, NAME, 90, query_window(0.5, parse_duration(prometheus.scrape_interval)))
    assert o.error is None and o.missing == () and o.request_rate == pytest.approx(10, rel=0.5)


def test_without_streams_ttft_and_itl_come_from_the_engines(exporter, source):
    # non-streaming requests only: the router sees no first token and no gap; vLLM's own histograms do
    o = settle(exporter, source, lambda o: o.request_rate and o.request_rate > 7 and o.ttft and o.ttft > 0.5
               and o.itl and o.itl > 0.03, "the engines' TTFT and ITL", rate=10.0, streamed=0.0, ttft=5.0,
               itl=0.045, prefill_ttft=0.7, decode_ttft=0.15, prefill_waiting=0, decode_waiting=0)
    assert o.error is None and o.missing == ()
    assert 0.5 < o.ttft <= 1.0  # prefill's p90 (0.4-0.8 s bucket) plus decode's (0.1-0.2 s)
    assert 0.04 < o.itl <= 0.05
    # one stream in the window and the router's first-token times are back in charge
    o = settle(exporter, source, lambda o: o.ttft and o.ttft > 2.0, "the router's TTFT", streamed=0.5)
    assert 4.0 < o.ttft <= 8.0
    exporter.traffic = replace(exporter.traffic, streamed=1.0, ttft=0.3, itl=0.02)


def test_nothing_an_endpoint_answers_reaches_status(exporter):
    """An allowed endpoint that is not Prometheus (here the exporter: every path answers its metrics page):
    the planner says so in its own words and copies none of the page."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/api/v1/query?query=up", timeout=5) as r:
        page = r.read().decode()
    assert m.ROUTER_REQUESTS in page
    wrong = PrometheusSource.for_endpoint(Endpoint("wrong", f"http://127.0.0.1:{exporter.port}"), timeout=3)
    try:
        o = wrong.observe(NS, NAME, 90, WINDOW)
    finally:
        wrong.close()
    assert o.error == "Prometheus endpoint 'wrong' unreachable: not Prometheus' API answering (HTTP 200)"
    assert o.error_reason == reasons.PROMETHEUS_UNREACHABLE and m.ROUTER_REQUESTS not in o.error


@pytest.fixture(scope="module")
def tls_prometheus(exporter, tmp_path_factory):
    """The same Prometheus, serving HTTPS with a certificate of a CA of the test's own."""
    from disagg.e2e.localcluster.pki import PKI

    pki = PKI(tmp_path_factory.mktemp("pki"))
    pki.ensure(["localhost"], ["127.0.0.1"])  # the CA (and a server certificate for 127.0.0.1)
    cert, key = pki.issue("prometheus", "prometheus", server=True, dns_names=["localhost"], ips=["127.0.0.1"])
    p = LocalPrometheus(tmp_path_factory.mktemp("prometheus-tls"), [f"127.0.0.1:{exporter.port}"],
                        tls=(cert, key, pki.ca_cert)).start()
    yield p, pki.ca_cert
    p.stop()


def test_tls_is_verified_against_the_endpoints_ca(exporter, tls_prometheus):
    prom, ca = tls_prometheus
    assert prom.url.startswith("https://")
    allowlist = Allowlist.from_dict({"endpoints": [
        {"name": "with-ca", "url": prom.url, "caFile": str(ca)},
        {"name": "system-trust", "url": prom.url},
        {"name": "skip", "url": prom.url, "insecureSkipVerify": True}]})

    def observe_with(name):
        s = PrometheusSource.for_endpoint(allowlist.endpoints[name], timeout=3)
        try:
            return s.observe(NS, NAME, 90, WINDOW)
        finally:
            s.close()

    # with its CA: read, and what it reads is the exporter's traffic (once Prometheus has scraped enough of it
    # for a rate), the same figures the plain-HTTP Prometheus gives
    exporter.traffic = replace(exporter.traffic, rate=10.0, ttft=0.3, itl=0.02, streamed=1.0)
    o = wait_for(lambda: (lambda o: o if o.error is None and o.request_rate and o.request_rate > 7 else None)(
        observe_with("with-ca")), 240, "the HTTPS Prometheus read with its CA", interval=0.5)
    assert o.missing == () and o.request_rate == pytest.approx(10, rel=0.35)
    assert 0.2 < o.ttft <= 0.4 and 0.01 < o.itl <= 0.03
    assert o.input_tokens_mean == pytest.approx(2000, rel=0.01)
    # without it, the certificate is refused: verification is the default, and the class is all it says
    o = observe_with("system-trust")
    assert o.error == "Prometheus endpoint 'system-trust' unreachable (SSLError)"
    assert o.error_reason == reasons.PROMETHEUS_UNREACHABLE
    # only an endpoint that says so skips verification
    assert observe_with("skip").error is None


def test_the_allowlist_file_is_checked():
    ok = Allowlist.from_dict({"default": "a", "endpoints": [{"name": "a", "url": "http://a:9090/"}]})
    assert ok.resolve(None).url == "http://a:9090" and ok.resolve("a").verify is True
    assert ok.resolve("b") == "spec.planner.prometheus: 'b' is not an allowed Prometheus endpoint (allowed: a)"
    assert Allowlist.from_dict(None).resolve(None) == ("spec.planner.prometheus is unset and the operator has no "
                                                       "default Prometheus endpoint (allowed: none configured)")
    for bad in ({"endpoints": [{"name": "A", "url": "http://a"}]}, {"endpoints": [{"name": "a", "url": "file:///x"}]},
                {"endpoints": [{"name": "a", "url": "http://a"}] * 2}, {"default": "b", "endpoints": []},
                {"endpoints": [{"name": "a", "url": "http://a", "headers": {}}]}):
        with pytest.raises(ValueError):
            Allowlist.from_dict(bad)


def test_capacity_of_saturated_workers_and_the_fast_paths_queue_growth(exporter, source, prometheus):
    # prefill's queue never empties over the window: its worker's uncached prompt tokens/s is its capacity
    o = settle(exporter, source, lambda o: o.prefill_saturated_tokens and o.prefill_ready == 1
               and o.decode_saturated_tokens is None and o.request_rate and o.request_rate > 7,
               "a saturated prefill worker", rate=10.0, ttft=0.3, itl=0.02, prefill_waiting=8, decode_waiting=0)
    assert o.prefill_saturated_tokens == pytest.approx(10 * 2000 * 0.75, rel=0.35)
    assert o.decode_ready == 1
    # and decode's: generated tokens/s and the requests it runs
    o = settle(exporter, source, lambda o: o.decode_saturated_tokens and o.prefill_saturated_tokens is None,
               "a saturated decode worker", rate=10.0, ttft=0.3, itl=0.02, prefill_waiting=0, decode_waiting=5)
    assert o.decode_saturated_tokens == pytest.approx(10 * 200, rel=0.35) and o.decode_saturated_batch == 1
    # the fast path: a queue growing over a few scrapes reads as a positive growth, a steady one as none
    window = 3 * parse_duration(prometheus.scrape_interval)
    exporter.traffic = replace(exporter.traffic, prefill_waiting=0, decode_waiting=0)
    wait_for(lambda: source.observe_queues(NS, NAME, window).prefill_queue == 0, 240, "an empty queue", interval=0.5)

    def grow():
        exporter.traffic = replace(exporter.traffic, prefill_waiting=exporter.traffic.prefill_waiting + 5)
        q = source.observe_queues(NS, NAME, window)
        return q if q.prefill_queue_growth and q.prefill_queue_growth > 0 else None

    q = wait_for(grow, 240, "a growing prefill queue", interval=0.5)
    assert q.error is None and q.prefill_queue > 0 and q.prefill_ready == 1
    assert q.decode_queue == 0 and (q.decode_queue_growth or 0.0) <= 0  # emptied, never grew


def test_a_queue_is_the_requests_waiting_for_a_slot_not_those_whose_kv_is_still_loading(exporter, source,
                                                                                        prometheus):
    # a decode engine counts among its waiting requests those whose KV it still pulls from the prefill; where
    # it says why (vLLM's waiting by reason), those are no queue: the decode has room (real engines on a busy
    # CPU: one or two at any time made the planner take a prefill flex worker for a queue that was not there)
    window = 3 * parse_duration(prometheus.scrape_interval)
    o = settle(exporter, source, lambda o: o.decode_queue == 0 and o.prefill_queue == 0 and o.decode_running == 1,
               "KV loads only", by_reason=True, prefill_waiting=0, decode_waiting=0, waiting_deferred={"decode": 3})
    assert o.error is None and source.observe_queues(NS, NAME, window).decode_queue == 0
    # requests waiting for a slot are the queue, those loading their KV still not
    o = settle(exporter, source, lambda o: o.decode_queue == 4, "a queue beside the KV loads", decode_waiting=4)
    # engines that do not say why: every waiting request counts
    o = settle(exporter, source, lambda o: o.decode_queue == 7, "engines that do not say why", by_reason=False)
    exporter.traffic = replace(exporter.traffic, decode_waiting=0, waiting_deferred={})


def test_a_decision_is_a_span_with_the_promql_it_read_and_the_values(exporter, source):
    """A traced decision (planner/tracing.py, SDK's in-memory exporter): one span naming the deployment, the
    reason and the sizes before and after, and one event per query the observation ran, with its exact
    PromQL and the value Prometheus gave, the same figures the decision read."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from disagg.planner import tracing as pt
    from disagg.planner.metrics_source import queries

    spans = InMemorySpanExporter()
    tracer = pt.DecisionTracer(exporter=spans)
    started = time.time_ns()
    o = settle(exporter, source, lambda o: o.ttft and o.ttft > 2.0 and o.prefill_queue == 8,
               "a TTFT breach in Prometheus", rate=10.0, ttft=3.0, itl=0.02, prefill_waiting=8, decode_waiting=0)
    t = target(prefill=1, decode=1)    # (one engine per role reports: see the breach test above)
    d, _ = dc.decide(o, t, dc.Memory(), MODEL, now=1000)
    assert d.reason == dc.SCALED
    tracer.record({"namespace": NS, "name": NAME}, o, d, t, started, prometheus="main", window_seconds=WINDOW)
    (span,) = spans.get_finished_spans()
    a = span.attributes
    assert span.name == pt.DECISION and span.resource.attributes["service.name"] == pt.SERVICE_NAME
    assert (a[pt.A_NAMESPACE], a[pt.A_DEPLOYMENT], a[pt.A_REASON], a[pt.A_PROMETHEUS]) == (NS, NAME, dc.SCALED, "main")
    assert a["disagg.planner.prefill.replicas"] == 1 and a["disagg.planner.prefill.decided"] == d.prefill.replicas > 1
    assert a["disagg.planner.input.ttft"] == d.inputs["ttft"] and a[pt.A_MESSAGE] == d.message
    reads = {e.attributes[pt.A_QUERY_NAME]: e.attributes for e in span.events if e.name == pt.READ}
    assert {k: r[pt.A_QUERY] for k, r in reads.items()} == queries(NS, NAME, 90, WINDOW)
    assert reads["request_rate"][pt.A_VALUE] == o.request_rate and reads["prefill_queue"][pt.A_VALUE] == 8
    assert reads["ttft"][pt.A_VALUE] == o.ttft
    assert span.start_time == started <= span.end_time
    tracer.shutdown()
