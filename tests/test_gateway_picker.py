"""Picker mode behind a real Envoy (e2e/gateway.py), in front of upstreams that speak vLLM's wire format
(tests/sse_upstream.py: this tests the picker and the gateway, not vLLM's speed; the real engines behind
Envoy are tests/test_e2e_realnode.py's).

Envoy carries every byte; the router, as the endpoint picker, answers where each request goes and runs
the prefill first where it plans one. What a client of the gateway sees: the OpenAI API (the official
client), the route headers, OpenAI-style errors for what the picker refuses (429 shed, 503 nothing
ready, 400 a bad body), the pool's failure mode when the picker is gone, and 2,000 streams at once.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest
from openai import OpenAI

from disagg.api import metrics as m
from disagg.e2e.gateway import BUFFERED, FAIL_CLOSE, FAIL_OPEN, STREAMED, Envoy
from disagg.e2e.testing import wait_for
from disagg.workers.local import free_port, metric_sum, scrape

CLIENTS = 2000
DEADLINE_S = 600


@pytest.fixture
def gateway(routers, tiny_model, tmp_path):
    """``gateway(decode, prefill, ...)``: a router in picker mode in front of the started upstreams and
    an Envoy using it, yielded as (envoy, router); both stopped afterwards."""

    @contextmanager
    def start(decode, prefill=(), failure_mode=FAIL_CLOSE, body_mode=BUFFERED, spec=None, name="picker",
              **extra):
        grpc_port = free_port()
        with routers.serving(tiny_model, tmp_path, decode, prefill, name=name, spec=spec,
                             args=["--mode", "picker", "--grpc-port", str(grpc_port)], **extra) as r:
            envoy = Envoy(tmp_path / f"envoy-{name}", port=free_port(), admin_port=free_port(),
                          picker=f"127.0.0.1:{grpc_port}", pool=[u.url.removeprefix("http://") for u in decode],
                          failure_mode=failure_mode, body_mode=body_mode)
            with envoy:
                yield envoy, r

    return start


def _post(url: str, body: dict | bytes, headers: dict | None = None, timeout: float = 60):
    """(status, headers, body) of one POST; errors are answers here, not exceptions."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _stats(upstream) -> dict:
    with urllib.request.urlopen(f"{upstream.url}/stats", timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("body_mode", [BUFFERED, STREAMED])
def test_openai_client_through_envoy_takes_the_remote_prefill_path(routers, gateway, tmp_path, body_mode):
    """Chat and completions, streamed and not, through Envoy: the picker ran the prefill, the decode got its
    KV parameters in the body Envoy sent it, and the client sees the route. FULL_DUPLEX_STREAMED is how
    Gateway implementations configure an InferencePool's picker (the response then passes the picker too)."""
    prefill = routers.upstream(tmp_path, "prefill", 4, 0.01)
    decode = routers.upstream(tmp_path, "decode", 4, 0.01)
    with gateway([decode], [prefill], body_mode=body_mode, spec={"disaggregation": "always"}) as (envoy, r):
        client = OpenAI(base_url=f"{envoy.url}/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
        assert chat.headers["x-disagg-path"] == m.PATH_REMOTE_PREFILL
        assert chat.headers["x-disagg-decode"] == decode.url
        assert chat.headers["x-disagg-prefill"] == prefill.url
        # (the test upstream answers every unary request in the completions shape)
        assert chat.http_response.json()["choices"][0]["text"] == "tok " * 4
        text = client.completions.create(model="tiny", prompt="hello", max_tokens=4).choices[0].text
        assert text == "tok " * 4
        streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "tok " * 4
        streamed = client.completions.create(model="tiny", prompt="hi", max_tokens=4, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == "tok " * 4
        served = _stats(decode)
        assert (served["remote_kv_decodes"], served["local_decodes"]) == (4, 0)
        assert _stats(prefill)["prefills"] == 4
        metrics = scrape(r.url)
        assert metric_sum(metrics, m.ROUTER_REQUESTS, outcome=m.OUTCOME_SUCCESS, path=m.PATH_REMOTE_PREFILL) == 4
        assert metric_sum(metrics, f"{m.ROUTER_PICKER_DECISION_SECONDS}_count", kind="plan") == 4
        # every stream given back: no load left on the decode, no admission slot held
        assert metric_sum(metrics, m.ROUTER_IN_FLIGHT) == 0
        assert metric_sum(metrics, m.ROUTER_ACTIVE_REQUESTS, role="decode") == 0


def test_a_failed_prefill_is_a_counted_fallback_and_still_served(routers, gateway, tmp_path):
    """The prefill worker gone: the decode prefills itself, the client is served and told so."""
    prefill = routers.upstream(tmp_path, "prefill", 4, 0.01)
    decode = routers.upstream(tmp_path, "decode", 4, 0.01)
    with gateway([decode], [prefill], spec={"disaggregation": "always"}, health_interval_s=600) as (envoy, r):
        prefill.stop()
        status, headers, body = _post(f"{envoy.url}/v1/completions",
                                      {"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert status == 200, body
        assert headers["x-disagg-path"] == m.PATH_FALLBACK
        assert headers["x-disagg-fallback"] == m.FALLBACK_PREFILL_ERROR
        assert _stats(decode)["local_decodes"] == 1
        assert metric_sum(scrape(r.url), m.ROUTER_FALLBACKS, reason=m.FALLBACK_PREFILL_ERROR) == 1


def test_what_the_picker_refuses_gets_an_openai_error_through_envoy(routers, gateway, tmp_path):
    decode = routers.upstream(tmp_path, "decode", 200, 0.05)
    with gateway([decode], spec={"maxInFlight": 1, "maxQueued": 0}) as (envoy, r):
        url = f"{envoy.url}/v1/completions"
        status, _, body = _post(url, b"{not json")
        assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
        status, _, body = _post(url, {"model": "other", "prompt": "x"})
        assert status == 404 and json.loads(body)["error"]["param"] == "model"
        status, _, body = _post(url, {"model": "tiny", "prompt": "x", "max_tokens": -3})
        assert status == 400 and json.loads(body)["error"]["param"] == "max_tokens"

        # one stream holds the only slot: the next request is shed with 429 and Retry-After
        async def shed():
            loop = asyncio.get_running_loop()
            long = loop.run_in_executor(None, _post, url, {"model": "tiny", "prompt": "x", "max_tokens": 200,
                                                            "stream": True})
            deadline = loop.time() + 60
            while metric_sum(scrape(r.url), m.ROUTER_IN_FLIGHT) < 1:
                assert loop.time() < deadline, "the long stream never got its slot"
                await asyncio.sleep(0.05)
            second = await loop.run_in_executor(None, _post, url, {"model": "tiny", "prompt": "y", "max_tokens": 1})
            return await long, second

        (first_status, _, _), (status, headers, body) = asyncio.run(shed())
        assert first_status == 200
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert json.loads(body)["error"]["code"] == 429
        assert metric_sum(scrape(r.url), m.ROUTER_REJECTED) == 1
        # nothing ready behind the picker: 503 in the same shape
        # (until the picker's health check sees it gone, Envoy's own 503 comes back: a connect failure)
        decode.stop()
        status, _, body = wait_for(
            lambda: (a := _post(url, {"model": "tiny", "prompt": "z", "max_tokens": 1}))[0] == 503
            and a[2].startswith(b"{") and a, 60, "the picker's own 503 once its health check saw the decode gone")
        assert status == 503 and json.loads(body)["error"]["code"] == 503, body


def test_a_client_cannot_pick_the_destination_itself(routers, gateway, tmp_path):
    """The destination header a client sends is dropped before the picker answers: with the picker gone and
    the pool failing open, the request still reaches only a pool endpoint, never the one the client named."""
    decode = routers.upstream(tmp_path, "decode", 4, 0.01)
    elsewhere = routers.upstream(tmp_path, "elsewhere", 4, 0.01)
    elsewhere.wait_ready(timeout=30)
    with gateway([decode], failure_mode=FAIL_OPEN) as (envoy, r):
        forged = {"x-gateway-destination-endpoint": elsewhere.url.removeprefix("http://")}
        status, headers, _ = _post(f"{envoy.url}/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2},
                                   forged)
        assert status == 200 and headers["x-disagg-decode"] == decode.url
        r.stop()
        status, _, body = _post(f"{envoy.url}/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2},
                                forged)
        assert status == 200, (body, envoy.tail())
        assert _stats(elsewhere)["local_decodes"] == 0
    elsewhere.stop()


@pytest.mark.parametrize("failure_mode", [FAIL_OPEN, FAIL_CLOSE])
def test_with_the_picker_stopped_the_pools_failure_mode_holds(routers, gateway, tmp_path, failure_mode):
    decode = routers.upstream(tmp_path, "decode", 4, 0.01)
    with gateway([decode], failure_mode=failure_mode) as (envoy, r):
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4}
        assert _post(f"{envoy.url}/v1/completions", body)[0] == 200
        r.stop()
        # a short client timeout: nothing waits on the gone picker
        status, _, answer = _post(f"{envoy.url}/v1/completions", body, timeout=30)
        if failure_mode == FAIL_OPEN:
            assert status == 200 and json.loads(answer)["choices"][0]["text"] == "tok " * 4
        else:
            assert status == 503, answer


def test_two_thousand_concurrent_streams_through_envoy_and_the_picker(routers, gateway, tmp_path, stream_burst):
    """The deadlines are generous (a loaded 2-core machine); no performance is asserted (bench/ measures it)."""
    decode = routers.upstream(tmp_path, "decode", 8, 0.02)
    with gateway([decode], health_interval_s=DEADLINE_S) as (envoy, r):
        results = stream_burst(f"{envoy.url}/v1", CLIENTS, 8, DEADLINE_S)
        errors = [x for x in results if isinstance(x, BaseException)]
        assert not errors, f"{len(errors)} of {CLIENTS} failed, first: {errors[0]!r}"
        assert all(t == "tok " * 8 for t in results)
        metrics = scrape(r.url)
        assert metric_sum(metrics, m.ROUTER_REQUESTS, outcome=m.OUTCOME_SUCCESS) == CLIENTS
        assert metric_sum(metrics, m.ROUTER_IN_FLIGHT) == 0


def test_through_envoy_the_decode_joins_the_pickers_trace(routers, gateway, jaeger, tmp_path):
    """Picker mode with tracing on: a client's traceparent passes Envoy to the picker and becomes its trace's
    parent; the decode Envoy calls gets a traceparent naming the pick's decode span, in place of the client's
    (the header mutation replaces it); the client gets the trace id in Envoy's response; Jaeger holds the
    pick's spans (admission, tokenize, routing, prefill, decode) under the client's span."""
    from disagg.e2e.jaeger import spans_by_name
    from disagg.e2e.testing import wait_for
    from disagg.router import tracing as t

    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    prefill = routers.upstream(tmp_path, "prefill", 4, 0.01)
    decode = routers.upstream(tmp_path, "decode", 4, 0.01)
    with gateway([decode], [prefill], spec={"disaggregation": "always"},
                 tracing={"otlpEndpoint": jaeger.otlp_endpoint}) as (envoy, r):
        status, headers, body = _post(f"{envoy.url}/v1/completions",
                                      {"model": "tiny", "prompt": "hello " * 20, "max_tokens": 4},
                                      headers={"traceparent": f"00-{client_trace}-{client_span}-01"})
        assert status == 200, body
        assert headers["x-disagg-path"] == m.PATH_REMOTE_PREFILL
        assert headers[t.TRACE_ID_HEADER] == client_trace
        sent = _stats(decode)["traceparents"]["decode"]
        assert len(sent) == 1 and sent[0].split("-")[1] == client_trace and sent[0].split("-")[2] != client_span
        trace = wait_for(lambda: (tr := jaeger.trace(client_trace)) and t.PICK in spans_by_name(tr)
                         and t.DECODE in spans_by_name(tr) and tr, 30, f"trace {client_trace} in Jaeger")
        prefill_sent = _stats(prefill)["traceparents"]["prefill"]
    by = spans_by_name(trace)
    root = by[t.PICK][0]
    assert root["parent"] == client_span
    for name in (t.ADMISSION, t.TOKENIZE, t.ROUTING, t.PREFILL, t.DECODE):
        assert [s["parent"] for s in by[name]] == [root["spanID"]], name
    assert by[t.DECODE][0]["spanID"] == sent[0].split("-")[2]
    assert prefill_sent[0].split("-")[2] == by[t.PREFILL][0]["spanID"]
