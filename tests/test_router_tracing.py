"""Request tracing (router/tracing.py): the router's span tree of a request, the W3C traceparent it sends
both workers, the trace id it returns, sampling, and picker mode.

The router runs in this process (its app on a real port) with the OpenTelemetry SDK's in-memory exporter in
place of the OTLP one, so the spans can be read as they end; its workers are real HTTP servers speaking
vLLM's wire format (tests/sse_upstream.py), which record the traceparent each request came with.
The export to a real trace store (Jaeger, queried through its API) is tests/test_tracing_jaeger.py's.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from disagg.api import metrics as m
from disagg.router import tracing as t
from disagg.router.app import ROUTER_KEY, make_app
from disagg.router.config import RouterConfig, WorkerEndpoint
from disagg.router.tracing import TRACE_ID_HEADER, Tracing
from disagg.workers.local import free_port

TOKENS = 6
CLIENT_TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


@asynccontextmanager
async def _router(tiny_model: str, decode, prefill=(), ratio: float | None = 1.0, **config):
    """A router in this event loop over started upstreams, tracing into an in-memory exporter (``ratio``
    None: tracing off). Yields (base URL, exporter, the router)."""
    spec = config.pop("spec", {"disaggregation": "always" if prefill else "never"})
    cfg = RouterConfig(model="tiny", tokenizer=tiny_model, block_size=16, max_model_len=1024, host="127.0.0.1",
                       port=free_port(), health_interval_s=0.3, spec=spec,
                       prefill=[WorkerEndpoint(url=u.url) for u in prefill],
                       decode=[WorkerEndpoint(url=u.url) for u in decode], **config)
    app = make_app(cfg)
    router = app[ROUTER_KEY]
    exporter = InMemorySpanExporter()
    if ratio is not None:
        router.tracing = Tracing(None, ratio, exporter=exporter, batch=False)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5)
    await runner.setup()
    try:
        await web.TCPSite(runner, cfg.host, cfg.port).start()
        yield f"http://{cfg.host}:{cfg.port}", exporter, router
    finally:
        await runner.cleanup()


async def _complete(url: str, stream: bool = True, headers: dict | None = None, prompt: str = "hello " * 40):
    """One completion: (status, response headers, body text, seconds to the first body bytes)."""
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(f"{url}/v1/completions", headers=headers,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "stream": stream}) as r:
            first = await r.content.readany()
            ttft = time.monotonic() - t0
            rest = await r.read()
            return r.status, dict(r.headers), (first + rest).decode(), ttft


def _stats(upstream) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"{upstream.url}/stats", timeout=10) as r:
        return json.loads(r.read())


def _tree(spans) -> dict[str, list]:
    """Spans by name."""
    out: dict[str, list] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def _parent_of(traceparent: str) -> tuple[str, str]:
    """(trace id, span id) a traceparent names."""
    _, trace_id, span_id, _ = traceparent.split("-")
    return trace_id, span_id


def _sampled(traceparent: str) -> bool:
    """The traceparent's sampled flag (the SDK also sets W3C's random-trace-id flag, 0x02)."""
    return bool(int(traceparent.rsplit("-", 1)[1], 16) & 1)


def _hex(span_id: int) -> str:
    return format(span_id, "016x")


async def _wait_root(exporter, timeout: float = 10):
    """The spans once the root has ended (it ends after the client's last byte, in the router's handler
    on this event loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = exporter.get_finished_spans()
        if any(s.name in (t.REQUEST, t.PICK) for s in spans):
            return spans
        await asyncio.sleep(0.02)
    raise AssertionError(f"no root span after {timeout}s: {[s.name for s in exporter.get_finished_spans()]}")


def test_a_disaggregated_stream_is_one_trace_across_router_prefill_and_decode(routers, tiny_model, tmp_path):
    """One streamed request, prefilled remotely: the root (from arrival to the last byte) holds the
    admission wait, tokenizing, the routing decision (its candidates, choice and reason), the prefill leg
    and the decode attempt with its wait for the first token; each worker got a traceparent naming its
    leg's span, so vLLM's llm_request spans join under them; the client got the trace id; a client's own
    traceparent is the root's parent."""
    with routers.running(routers.upstream(tmp_path, "prefill", TOKENS, 0.01),
                         routers.upstream(tmp_path, "decode", TOKENS, 0.05)) as (prefill, decode):
        async def main():
            async with _router(tiny_model, [decode], [prefill]) as (url, exporter, router):
                status, headers, text, ttft = await _complete(url, headers={"traceparent": CLIENT_TRACE})
                spans = await _wait_root(exporter)
                async with aiohttp.ClientSession() as s:
                    async with s.get(f"{url}/metrics", headers={"Accept": OPENMETRICS}) as r:
                        scraped = r.headers["Content-Type"], await r.text()
                return status, headers, text, ttft, spans, scraped

        status, headers, text, ttft, spans, (content_type, scraped) = asyncio.run(main())
        assert status == 200 and text.count("tok ") == TOKENS, text
        assert headers["x-disagg-path"] == m.PATH_REMOTE_PREFILL
        by = _tree(spans)
        root = by[t.REQUEST][0]
        trace_id = format(root.context.trace_id, "032x")
        assert headers[TRACE_ID_HEADER] == trace_id == CLIENT_TRACE.split("-")[1]
        assert _hex(root.parent.span_id) == CLIENT_TRACE.split("-")[2]      # the client's span is its parent
        assert {s.context.trace_id for s in spans} == {root.context.trace_id}
        for name in (t.ADMISSION, t.TOKENIZE, t.ROUTING, t.PREFILL, t.DECODE):
            assert len(by[name]) == 1 and by[name][0].parent.span_id == root.context.span_id, name
        wait = by[t.FIRST_TOKEN][0]
        dec = by[t.DECODE][0]
        assert wait.parent.span_id == dec.context.span_id
        assert t.FALLBACK not in by and t.MIGRATION not in by
        # in order, and inside the root
        order = [by[n][0] for n in (t.ADMISSION, t.TOKENIZE, t.ROUTING, t.PREFILL)] + [wait]
        assert all(a.end_time <= b.start_time + 1_000_000 for a, b in zip(order, order[1:])), \
            [(s.name, s.start_time, s.end_time) for s in order]
        assert root.start_time <= order[0].start_time and dec.end_time <= root.end_time
        # the router's own spans up to the first token account for the client's TTFT (the client's clock
        # also has its connection and the first bytes' way back)
        router_ttft = (wait.end_time - root.start_time) / 1e9
        assert 0 < router_ttft <= ttft + 0.01 and ttft - router_ttft < 0.15, (router_ttft, ttft)
        assert dec.end_time - dec.start_time >= (TOKENS - 1) * 0.05e9 * 0.9     # the whole stream
        # the decision
        routing = by[t.ROUTING][0].attributes
        assert routing["disagg.routing.decode"] == decode.url and routing["disagg.routing.prefill"] == prefill.url
        assert routing["disagg.routing.reason"] == m.REASON_REMOTE
        assert routing["disagg.routing.prompt_tokens"] > 40
        assert list(routing["disagg.routing.decode.candidates"]) == [f"{decode.url} active=0 overlap_blocks=0"]
        assert list(routing["disagg.routing.prefill.candidates"]) == [f"{prefill.url} active=0 overlap_blocks=0"]
        assert root.attributes[t.A_OUTCOME] == m.OUTCOME_SUCCESS
        assert root.attributes[t.A_PATH] == m.PATH_REMOTE_PREFILL
        assert root.attributes[t.A_STATUS] == 200
        assert dec.attributes[t.A_KV] is True and dec.attributes[t.A_OUTPUT_TOKENS] == TOKENS
        # both legs carried the trace, each naming its own span as the parent
        p_tp = _stats(prefill)["traceparents"]["prefill"]
        d_tp = _stats(decode)["traceparents"]["decode"]
        assert [_parent_of(x) for x in p_tp] == [(trace_id, _hex(by[t.PREFILL][0].context.span_id))]
        assert [_parent_of(x) for x in d_tp] == [(trace_id, _hex(dec.context.span_id))]
        assert _sampled(p_tp[0]) and _sampled(d_tp[0])
        # the TTFT histogram's exemplar links its bucket to the trace (OpenMetrics, as Prometheus asks for it)
        assert content_type.startswith("application/openmetrics-text")
        assert [line for line in scraped.splitlines() if line.startswith(f"{m.ROUTER_TTFT_SECONDS}_bucket")
                and f'# {{trace_id="{trace_id}"}}' in line], scraped


def test_a_non_streamed_request_and_the_second_turns_prefix_overlap(routers, tiny_model, tmp_path):
    """Non-streamed: a decode span per attempt (no first-token span: the first token comes inside the
    answer), the decode's traceparent naming it. The same prompt again: the routing span shows the prefix
    the first one left on the chosen workers (the router's prediction of it)."""
    with routers.running(routers.upstream(tmp_path, "prefill", TOKENS, 0.01),
                         routers.upstream(tmp_path, "decode", TOKENS, 0.01)) as (prefill, decode):
        async def main():
            async with _router(tiny_model, [decode], [prefill]) as (url, exporter, router):
                first = await _complete(url, stream=False)
                spans_first = await _wait_root(exporter)
                exporter.clear()
                second = await _complete(url, stream=False)
                return first, spans_first, second, await _wait_root(exporter)

        (status, headers, text, _), spans, second, spans2 = asyncio.run(main())
        assert status == 200 and json.loads(text)["choices"][0]["text"] == "tok " * TOKENS
        by = _tree(spans)
        assert t.FIRST_TOKEN not in by and len(by[t.DECODE]) == 1
        assert by[t.REQUEST][0].attributes[t.A_OUTCOME] == m.OUTCOME_SUCCESS
        d_tp = _stats(decode)["traceparents"]["decode"]
        assert _parent_of(d_tp[0])[1] == _hex(by[t.DECODE][0].context.span_id)
        routing = _tree(spans2)[t.ROUTING][0].attributes
        assert routing["disagg.routing.decode.overlap_blocks"] > 0
        assert f"{decode.url} active=0 overlap_blocks={routing['disagg.routing.decode.overlap_blocks']}" in \
            routing["disagg.routing.decode.candidates"]
        assert routing["disagg.routing.cached_tokens"] > 0
        assert second[1][TRACE_ID_HEADER] != headers[TRACE_ID_HEADER]


def test_a_fallback_shows_in_the_trace(routers, tiny_model, tmp_path):
    """The prefill answers and dies; the decode waits for its KV until the router's probe finds it gone,
    then prefills locally: the first decode attempt failed, a fallback marker names the reason, and the
    second attempt (without KV) served the stream."""
    with routers.running(
            routers.upstream(tmp_path, "prefill", TOKENS, 0.005, env={"SSE_EXIT_AFTER_PREFILL": "1"}),
            routers.upstream(tmp_path, "decode", TOKENS, 0.005, env={"SSE_KV_WAIT": "1"})) as (prefill, decode):
        async def main():
            async with _router(tiny_model, [decode], [prefill]) as (url, exporter, router):
                out = await _complete(url)
                return out, await _wait_root(exporter)

        (status, headers, text, _), spans = asyncio.run(main())
        assert status == 200 and text.count("tok ") == TOKENS
        assert (headers["x-disagg-path"], headers["x-disagg-fallback"]) == (m.PATH_FALLBACK, m.FALLBACK_PREFILL_LOST)
        by = _tree(spans)
        root = by[t.REQUEST][0]
        attempts = sorted(by[t.DECODE], key=lambda s: s.start_time)
        assert [s.attributes[t.A_KV] for s in attempts] == [True, False]
        assert not attempts[0].status.is_ok and attempts[1].status.is_ok
        reasons = [s.attributes[t.A_REASON] for s in by[t.FALLBACK]]
        assert m.FALLBACK_PREFILL_LOST in reasons, reasons
        assert all(s.parent.span_id == root.context.span_id for s in by[t.FALLBACK])
        assert root.attributes[t.A_PATH] == m.PATH_FALLBACK
        assert root.attributes[t.A_OUTCOME] == m.OUTCOME_SUCCESS
        assert len(by[t.FIRST_TOKEN]) == 2 and not min(by[t.FIRST_TOKEN], key=lambda s: s.start_time).status.is_ok


def test_a_migration_shows_in_the_trace(routers, tiny_model, tmp_path):
    """A stream cut mid-way is continued on the decode worker again (there is no other): the trace holds
    the first attempt (failed), the migration span, and the continuation's decode attempt under it."""
    from disagg.router.tokenizer import Tokenizer

    # the upstream's "tok " as the tiny model's id, so the continuation's text is whole (as in
    # tests/test_router_migration.py)
    tok_id = Tokenizer(tiny_model)._encode("tok ", add_special_tokens=False)[0]
    with routers.running(
            routers.upstream(tmp_path, "decode", TOKENS, 0.01, 3, env={"SSE_TOKEN_ID": str(tok_id)})) as (decode,):
        async def main():
            async with _router(tiny_model, [decode]) as (url, exporter, router):
                out = await _complete(url)
                return out, await _wait_root(exporter)

        (status, headers, text, _), spans = asyncio.run(main())
        assert status == 200 and text.count("tok ") == TOKENS and "[DONE]" in text, text
        by = _tree(spans)
        root, mig = by[t.REQUEST][0], by[t.MIGRATION][0]
        assert mig.parent.span_id == root.context.span_id
        assert mig.attributes[t.A_WORKER] == decode.url and mig.attributes[t.A_GENERATED] == 3
        first, cont = sorted(by[t.DECODE], key=lambda s: s.start_time)
        assert first.parent.span_id == root.context.span_id and not first.status.is_ok
        assert cont.parent.span_id == mig.context.span_id and cont.status.is_ok
        # the continuation went to the decode with its own traceparent
        d_tp = _stats(decode)["traceparents"]["decode"]
        assert [_parent_of(x)[1] for x in d_tp] == [_hex(first.context.span_id), _hex(cont.context.span_id)]
        assert root.attributes[t.A_OUTCOME] == m.OUTCOME_SUCCESS


def test_unsampled_and_untraced_requests(routers, tiny_model, tmp_path):
    """Sampling ratio 0: nothing exported and no trace id for the client, but the workers get the decision
    (a traceparent flagged not sampled), so they do not trace the request on their own. Tracing off: no
    tracer at all, and nothing added to the workers' requests or the client's response."""
    with routers.running(routers.upstream(tmp_path, "decode", TOKENS, 0.005)) as (decode,):
        async def main(ratio):
            async with _router(tiny_model, [decode], ratio=ratio) as (url, exporter, router):
                assert (router.tracing is None) == (ratio is None)
                out = await _complete(url)
                await asyncio.sleep(0.2)
                async with aiohttp.ClientSession() as s:
                    async with s.get(f"{url}/metrics", headers={"Accept": OPENMETRICS}) as r:
                        metrics_type = r.headers["Content-Type"]
                return out, exporter.get_finished_spans(), metrics_type

        (status, headers, _, _), spans, _ = asyncio.run(main(0.0))
        assert status == 200 and TRACE_ID_HEADER not in headers and spans == ()
        (status, headers, _, _), spans, metrics_type = asyncio.run(main(None))
        assert status == 200 and TRACE_ID_HEADER not in headers and spans == ()
        assert metrics_type.startswith("text/plain")         # the exposition as it always was
        tps = _stats(decode)["traceparents"]["decode"]
        assert len(tps) == 2 and not _sampled(tps[0]) and tps[1] is None, tps


def test_an_error_answered_by_the_router_carries_its_trace(routers, tiny_model, tmp_path):
    """A request the router refuses (an unknown model: 404) is traced too, its id in the error's headers."""
    with routers.running(routers.upstream(tmp_path, "decode", TOKENS, 0.005)) as (decode,):
        async def main():
            async with _router(tiny_model, [decode]) as (url, exporter, router):
                async with aiohttp.ClientSession() as s:
                    async with s.post(f"{url}/v1/completions", json={"model": "other", "prompt": "x"}) as r:
                        return r.status, dict(r.headers), await _wait_root(exporter)

        status, headers, spans = asyncio.run(main())
        by = _tree(spans)
        root = by[t.REQUEST][0]
        assert status == 404 and headers[TRACE_ID_HEADER] == format(root.context.trace_id, "032x")
        assert root.attributes[t.A_STATUS] == 404 and not root.status.is_ok
        assert not by[t.TOKENIZE][0].status.is_ok and t.ROUTING not in by


def test_the_pickers_decision_and_prefill_are_traced(routers, tiny_model, tmp_path):
    """Picker mode (the gateway carries the decode): the pick's trace holds admission, tokenizing, the
    decision and the prefill leg; the header mutation the gateway applies to the decode's request carries
    a traceparent naming the pick's decode span, which ends when the gateway's stream does; the gateway's
    own traceparent is the root's parent."""
    from disagg.router.picker import Picker

    with routers.running(routers.upstream(tmp_path, "prefill", TOKENS, 0.005),
                         routers.upstream(tmp_path, "decode", TOKENS, 0.005)) as (prefill, decode):
        async def main():
            async with _router(tiny_model, [decode], [prefill]) as (url, exporter, router):
                picker = Picker(router)
                raw = json.dumps({"model": "tiny", "prompt": "hello " * 40, "max_tokens": TOKENS}).encode()
                pick = await picker.pick("POST", "/v1/completions", raw, None, {"traceparent": CLIENT_TRACE})
                await picker.handoff(pick)
                sent = pick.request_headers()
                response = pick.response_headers()
                picker.answered(pick, 200)
                picker.done(pick)
                return pick, sent, response, exporter.get_finished_spans()

        pick, sent, response, spans = asyncio.run(main())
        by = _tree(spans)
        root = by[t.PICK][0]
        assert _hex(root.parent.span_id) == CLIENT_TRACE.split("-")[2]
        for name in (t.ADMISSION, t.TOKENIZE, t.ROUTING, t.PREFILL, t.DECODE):
            assert by[name][0].parent.span_id == root.context.span_id, name
        assert _parent_of(sent["traceparent"]) == (CLIENT_TRACE.split("-")[1], _hex(by[t.DECODE][0].context.span_id))
        assert response[TRACE_ID_HEADER] == CLIENT_TRACE.split("-")[1]
        assert response["x-disagg-path"] == m.PATH_REMOTE_PREFILL
        assert root.attributes[t.A_OUTCOME] == m.OUTCOME_SUCCESS and root.attributes[t.A_STATUS] == 200
        p_tp = _stats(prefill)["traceparents"]["prefill"]
        assert _parent_of(p_tp[0])[1] == _hex(by[t.PREFILL][0].context.span_id)
