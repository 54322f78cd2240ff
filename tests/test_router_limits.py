"""Admission control and timeouts, against a real upstream that stalls (tests/stall_upstream.py) and the
router as its own process: a burst beyond the bound gets 429s with Retry-After (never a 5xx, never a
hang), a queued request whose wait runs out too; a stream that stops mid-way or never starts is cut
with an OpenAI-style error event; a non-streaming request that never ends gets a 504. Every one counted."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest

from disagg.api import metrics as m
from disagg.e2e.testing import wait_for
from disagg.workers.local import LocalProcess, metric_sum, scrape

@contextmanager
def _stalling(routers, tiny_model: str, logs: Path, name: str, spec: dict):
    """(upstream, router): a router trying one decode worker, a stalling one (tests/stall_upstream.py)."""
    upstream = routers.upstream(logs, f"{name}-upstream", script="stall_upstream.py")
    with routers.serving(tiny_model, logs, [upstream], name=name, spec=spec, decode_attempts=1) as r:
        yield upstream, r


@pytest.fixture(scope="module")
def admission(routers, tiny_model, tmp_path_factory):
    """4 in flight, 2 queued, a queue wait long enough never to run out in the burst test."""
    with _stalling(routers, tiny_model, tmp_path_factory.mktemp("admission"), "router-admission",
                   {"maxInFlight": 4, "maxQueued": 2, "queueTimeoutSeconds": 120}) as served:
        yield served


@pytest.fixture(scope="module")
def strict(routers, tiny_model, tmp_path_factory):
    """One in flight, one queued for at most 0.5 s; short worker timeouts."""
    with _stalling(routers, tiny_model, tmp_path_factory.mktemp("timeouts"), "router-strict",
                   {"maxInFlight": 1, "maxQueued": 1, "queueTimeoutSeconds": 0.5, "idleTimeoutSeconds": 1,
                    "firstTokenTimeoutSeconds": 2, "requestTimeoutSeconds": 1.5}) as served:
        yield served


async def _complete(session: aiohttp.ClientSession, url: str, prompt: str, stream: bool = True):
    """(status, headers, body text) of one completion."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": stream}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        return r.status, r.headers, await r.text()


def _events(text: str) -> list[str]:
    return [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]


def _waiting(upstream: LocalProcess) -> int:
    with urllib.request.urlopen(f"{upstream.url}/gate/waiting", timeout=10) as r:
        return json.loads(r.read())["waiting"]


def test_a_burst_of_three_times_the_bound_gets_429s_never_a_5xx_or_a_hang(admission):
    upstream, r = admission
    burst = 12                                   # 3 x maxInFlight

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            tasks = [asyncio.create_task(_complete(s, r.url, f"request {i}")) for i in range(burst)]
            # 4 admitted (held at the upstream's gate), 2 queued, the other 6 refused at once
            await asyncio.to_thread(wait_for, lambda: _waiting(upstream) == 4, 60, "4 requests at the upstream")
            await asyncio.to_thread(wait_for, lambda: sum(t.done() for t in tasks) == 6, 60, "6 answered 429")
            s_now = await asyncio.to_thread(scrape, r.url)
            assert s_now[m.ROUTER_IN_FLIGHT] == 4 and s_now[m.ROUTER_QUEUE_DEPTH] == 2
            with urllib.request.urlopen(urllib.request.Request(f"{upstream.url}/gate/open", method="POST")):
                pass
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    statuses = sorted(status for status, _, _ in results)
    assert statuses == [200] * 6 + [429] * 6, statuses
    for status, headers, text in results:
        if status == 429:
            assert headers["Retry-After"] == "120"
            err = json.loads(text)["error"]
            assert err["type"] == "rate_limit_exceeded" and err["code"] == 429 and "4 requests" in err["message"]
        else:
            assert _events(text) == [_events(text)[0], _events(text)[1], "[DONE]"]
    s = scrape(r.url)
    assert s[f'{m.ROUTER_REJECTED}{{reason="{m.REJECT_QUEUE_FULL}"}}'] == 6
    assert s[f'{m.ROUTER_REQUESTS}{{outcome="{m.OUTCOME_REJECTED}",path="none"}}'] == 6
    assert s[f'{m.ROUTER_REQUESTS}{{outcome="{m.OUTCOME_SUCCESS}",path="{m.PATH_LOCAL_PREFILL}"}}'] == 6
    assert s[m.ROUTER_IN_FLIGHT] == 0 and s[m.ROUTER_QUEUE_DEPTH] == 0


def test_a_queued_request_whose_wait_runs_out_gets_a_429(strict):
    upstream, r = strict

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            long = asyncio.create_task(_complete(s, r.url, "slow 8"))      # 3.2 s, chunks 0.4 s apart
            await asyncio.to_thread(wait_for, lambda: scrape(r.url)[m.ROUTER_IN_FLIGHT] == 1, 30, "one in flight")
            queued = await _complete(s, r.url, "slow 1")
            return queued, await long

    (status, headers, text), (long_status, _, long_text) = asyncio.run(main())
    assert status == 429 and headers["Retry-After"] == "1"
    assert "queue wait ran out" in json.loads(text)["error"]["message"]
    assert long_status == 200 and _events(long_text)[-1] == "[DONE]" and len(_events(long_text)) == 9
    s = scrape(r.url)
    assert s[f'{m.ROUTER_REJECTED}{{reason="{m.REJECT_QUEUE_TIMEOUT}"}}'] == 1


@pytest.mark.parametrize("prompt,kind,tokens,words", [
    ("stall-mid", m.TIMEOUT_IDLE, 2, "idle timeout (1 s)"),
    ("stall-first", m.TIMEOUT_FIRST_TOKEN, 0, "first-token timeout (2 s)"),
], ids=["mid-stream", "before-the-first-token"])
def test_a_stalled_stream_is_cut_with_an_error_event(strict, prompt, kind, tokens, words):
    upstream, r = strict
    before = metric_sum(scrape(r.url), m.ROUTER_TIMEOUTS)

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            return await _complete(s, r.url, prompt)

    status, _, text = asyncio.run(main())
    events = _events(text)
    assert status == 200 and events[-1] == "[DONE]" and len(events) == tokens + 2, events
    err = json.loads(events[-2])["error"]
    assert err["type"] == "timeout_error" and err["code"] == 504 and words in err["message"], err
    s = scrape(r.url)
    assert s[f'{m.ROUTER_TIMEOUTS}{{kind="{kind}"}}'] >= 1
    assert metric_sum(s, m.ROUTER_TIMEOUTS) == before + 1
    assert s[m.ROUTER_IN_FLIGHT] == 0, "a cut stream gives its admission slot back"


def test_a_worker_closing_mid_event_ends_the_stream_with_an_error_event(strict):
    """The worker's connection closes inside an event (and inside its chunked body): the client gets the
    whole events before it, never the half one, then an OpenAI error event and [DONE]. The worker sends no
    token ids, so the stream cannot be continued elsewhere (router/migration.py)."""
    upstream, r = strict
    failed = f'{m.ROUTER_REQUESTS}{{outcome="{m.OUTCOME_UPSTREAM_ERROR}",path="{m.PATH_LOCAL_PREFILL}"}}'
    before = scrape(r.url).get(failed, 0)

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            return await _complete(s, r.url, "cut-mid-event")

    status, _, text = asyncio.run(main())
    events = _events(text)
    assert status == 200 and events[-1] == "[DONE]" and len(events) == 4, events
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["tok ", "tok "]
    err = json.loads(events[2])["error"]
    assert err["type"] == "upstream_error" and err["code"] == 502 and "mid-stream" in err["message"], err
    assert text.count("text_completion") == 2, "the half event reached the client"
    s = scrape(r.url)
    assert s[failed] == before + 1
    assert s[m.ROUTER_IN_FLIGHT] == 0


def test_a_non_streaming_request_that_never_ends_gets_a_504(strict):
    upstream, r = strict
    timed_out = f'{m.ROUTER_REQUESTS}{{outcome="{m.OUTCOME_TIMEOUT}",path="{m.PATH_LOCAL_PREFILL}"}}'
    before = scrape(r.url).get(timed_out, 0)

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            return await _complete(s, r.url, "anything", stream=False)

    status, _, text = asyncio.run(main())
    assert status == 504
    err = json.loads(text)["error"]
    assert err["type"] == "timeout_error" and "request timeout (1.5 s)" in err["message"]
    s = scrape(r.url)
    assert s[f'{m.ROUTER_TIMEOUTS}{{kind="{m.TIMEOUT_REQUEST}"}}'] == 1
    assert s[timed_out] == before + 1
