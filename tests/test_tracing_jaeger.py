"""Traces into a real trace store: a router (its own process, ``python -m disagg.router`` with
``--otlp-traces-endpoint``) exports each request's spans over OTLP/gRPC to a real Jaeger (built from its Go
module, e2e/jaeger.py), and the trace is read back through Jaeger's query API by the id the client got in
``x-disagg-trace-id``. The workers are tests/sse_upstream.py (vLLM's wire format; they record the traceparent
they were sent): the router's side of the trace. vLLM's own llm_request spans joining it are
tests/test_router_pd.py's (real engines).
"""

from __future__ import annotations

import json
import time
import urllib.request

from disagg.api import metrics as m
from disagg.e2e.dashboards import DASHBOARDS, panels, substitute
from disagg.e2e.jaeger import spans_by_name
from disagg.e2e.prometheus import LocalPrometheus
from disagg.e2e.testing import wait_for
from disagg.router import tracing as t

TOKENS = 6


def _stream(url: str, prompt: str) -> tuple[dict, float, str]:
    """One streamed completion: (response headers, seconds to its first chunk, its body)."""
    req = urllib.request.Request(f"{url}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": TOKENS,
                                                  "stream": True}).encode())
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=60) as r:
        first = r.read1()
        ttft = time.monotonic() - t0
        return dict(r.headers), ttft, (first + r.read()).decode()


def _stats(upstream) -> dict:
    with urllib.request.urlopen(f"{upstream.url}/stats", timeout=10) as r:
        return json.loads(r.read())


def test_a_requests_trace_is_in_jaeger_by_the_id_the_client_got(routers, jaeger, tiny_model, tmp_path):
    """One streamed request, prefilled remotely: Jaeger holds its trace under the id the client got, with
    the router's spans correctly parented (service disagg-router), the routing decision's attributes,
    and the workers were sent traceparents naming the prefill and decode spans stored there. The router's
    spans up to the first token add up to the client's TTFT within 0.15 s."""
    prefill = routers.upstream(tmp_path, "prefill", TOKENS, 0.01)
    decode = routers.upstream(tmp_path, "decode", TOKENS, 0.1)
    with routers.serving(tiny_model, tmp_path, [decode], prefill=[prefill], spec={"disaggregation": "always"},
                         tracing={"otlpEndpoint": jaeger.otlp_endpoint, "samplingRatio": 1.0}) as r:
        headers, ttft, text = _stream(r.url, "hello " * 40)
        assert text.count("tok ") == TOKENS and headers["x-disagg-path"] == m.PATH_REMOTE_PREFILL
        trace_id = headers[t.TRACE_ID_HEADER]
        # exported in batches (the SDK's default: every 5 s)
        trace = wait_for(lambda: (tr := jaeger.trace(trace_id)) and len(tr["spans"]) >= 7 and tr, 30,
                         f"trace {trace_id} in Jaeger")
        p_tp = _stats(prefill)["traceparents"]["prefill"][-1].split("-")
        d_tp = _stats(decode)["traceparents"]["decode"][-1].split("-")
    by = spans_by_name(trace)
    assert "disagg-router" in jaeger.services()
    root = by[t.REQUEST][0]
    assert root["service"] == "disagg-router" and root["parent"] is None
    for name in (t.ADMISSION, t.TOKENIZE, t.ROUTING, t.PREFILL, t.DECODE):
        assert [s["parent"] for s in by[name]] == [root["spanID"]], name
    assert by[t.FIRST_TOKEN][0]["parent"] == by[t.DECODE][0]["spanID"]
    tags = {tag["key"]: tag["value"] for tag in by[t.ROUTING][0]["tags"]}
    assert tags["disagg.routing.decode"] == decode.url and tags["disagg.routing.prefill"] == prefill.url
    assert tags["disagg.routing.reason"] == m.REASON_REMOTE
    root_tags = {tag["key"]: tag["value"] for tag in root["tags"]}
    assert root_tags[t.A_OUTCOME] == m.OUTCOME_SUCCESS and root_tags[t.A_PATH] == m.PATH_REMOTE_PREFILL
    # Jaeger's times are microseconds: the router's time to the first token against the client's
    router_ttft = (by[t.FIRST_TOKEN][0]["startTime"] + by[t.FIRST_TOKEN][0]["duration"] - root["startTime"]) / 1e6
    assert 0 < router_ttft <= ttft + 0.01 and ttft - router_ttft < 0.15, (router_ttft, ttft)
    # the spans the workers were told to join under are the stored ones
    assert (p_tp[1], p_tp[2]) == (trace_id, by[t.PREFILL][0]["spanID"])
    assert (d_tp[1], d_tp[2]) == (trace_id, by[t.DECODE][0]["spanID"])


def test_the_ttft_panels_exemplar_opens_the_requests_trace(routers, jaeger, tiny_model, tmp_path):
    """What a click on an exemplar of the Overview's "Time to first token" panel does, without Grafana: a
    real Prometheus (exemplar storage on) scrapes the traced router; the exemplars of the panel's own
    queries (as Grafana asks for them) carry, under the label the chart's data source links on, the id of
    the request's trace, and Jaeger holds that trace."""
    (overview,) = [p for p in DASHBOARDS if p.stem == "overview"]
    (panel,) = [p for p in panels(json.loads(overview.read_text())) if p["title"] == "Time to first token"]
    # the chart's monitors add namespace and deployment; this router's series have neither, which .* matches
    variables = {"namespace": ".*", "deployment": ".*", "ttft_target": "1", "__rate_interval": "1m"}
    queries = [substitute(q["expr"], variables) for q in panel["targets"] if q.get("exemplar")]
    assert queries
    decode = routers.upstream(tmp_path, "decode", TOKENS, 0.01)
    with routers.serving(tiny_model, tmp_path, [decode],
                         tracing={"otlpEndpoint": jaeger.otlp_endpoint, "samplingRatio": 1.0}) as r:
        prom = LocalPrometheus(tmp_path / "prometheus", [r.url.split("//", 1)[1]], exemplars=True).start()
        try:
            start = time.time() - 5
            headers, _, text = _stream(r.url, "hello " * 10)
            assert text.count("tok ") == TOKENS
            trace_id = headers[t.TRACE_ID_HEADER]

            def exemplar_ids() -> set[str] | None:
                ids = {e["labels"].get(m.EXEMPLAR_TRACE_ID) for q in queries
                       for s in prom.exemplars(q, start, time.time() + 5) for e in s["exemplars"]}
                return ids if trace_id in ids else None
            assert wait_for(exemplar_ids, 30, f"an exemplar naming trace {trace_id}") == {trace_id}
        finally:
            prom.stop()
    assert wait_for(lambda: jaeger.trace(trace_id), 30, f"trace {trace_id} in Jaeger")["traceID"] == trace_id
