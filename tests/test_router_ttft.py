"""TTFT is only ever a first-token time: a slow non-streaming request moves the router's request duration,
never its TTFT histogram (which the planner, the SLO recording rules and the alerts read); a stream's first
token does. The upstream is tests/sse_upstream.py (a real HTTP server speaking vLLM's wire format, taking
DELAY per token for streamed and non-streamed answers alike). Streams one after another share one pooled
connection to the worker, rather than a new TCP connection each before its first token. TTFT counts from
the request's arrival at the router, its wait for admission included."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from disagg.api import metrics as m
from disagg.e2e.testing import wait_for
from disagg.workers.local import scrape

TOKENS, DELAY = 20, 0.1  # a 2 s answer whose first token exists after 0.1 s
PATH = m.PATH_LOCAL_PREFILL


@pytest.fixture
def routed(routers, tiny_model, tmp_path):
    up = routers.upstream(tmp_path, "decode", TOKENS, DELAY)
    with routers.serving(tiny_model, tmp_path, [up]) as r:
        yield r


def _series(samples: dict[str, float], name: str, suffix: str) -> float:
    return samples.get(f'{name}_{suffix}{{path="{PATH}"}}', 0.0)


def test_a_slow_non_streaming_request_does_not_move_ttft(routed):
    client = OpenAI(base_url=f"{routed.url}/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(model="tiny", prompt="slow", max_tokens=TOKENS)
    assert answer.choices[0].text == "tok " * TOKENS
    s = scrape(routed.url)
    assert s[f'{m.ROUTER_REQUESTS}{{outcome="success",path="{PATH}"}}'] == 1
    assert _series(s, m.ROUTER_E2E_SECONDS, "count") == 1
    assert _series(s, m.ROUTER_E2E_SECONDS, "sum") >= TOKENS * DELAY  # the whole answer, where it belongs
    assert _series(s, m.ROUTER_TTFT_SECONDS, "count") == 0 and _series(s, m.ROUTER_TTFT_SECONDS, "sum") == 0
    # every TTFT bucket is still empty: no histogram_quantile over it can see the 2 s
    assert all(v == 0 for k, v in s.items() if k.startswith(f"{m.ROUTER_TTFT_SECONDS}_bucket"))

    unary_e2e = _series(s, m.ROUTER_E2E_SECONDS, "sum")
    # a stream of the same length: its first token is a TTFT, well short of its duration
    chunks = list(client.completions.create(model="tiny", prompt="fast", max_tokens=TOKENS, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "tok " * TOKENS
    s = scrape(routed.url)
    assert _series(s, m.ROUTER_TTFT_SECONDS, "count") == 1
    stream_e2e = _series(s, m.ROUTER_E2E_SECONDS, "sum") - unary_e2e
    ttft = _series(s, m.ROUTER_TTFT_SECONDS, "sum")
    assert DELAY <= ttft < TOKENS * DELAY / 2 < stream_e2e


def _stream(url: str, i: int) -> str:
    body = {"model": "tiny", "prompt": f"s{i}", "max_tokens": 4, "stream": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read().decode()     # to the end of the response, not only to [DONE]


def test_streams_one_after_another_reuse_the_connection_to_the_worker(routers, tiny_model, tmp_path):
    """A worker writes [DONE] and the end of its chunked body apart (here 50 ms apart); a router that
    released the connection in between had aiohttp close it, and every stream connected anew before its
    first token (router/relay.py). The router ends the client's response once the worker's has ended, so
    a client that reads its response to the end finds the connection back in the router's pool."""
    streams = 8
    up = routers.upstream(tmp_path, "decode", 4, 0.005, env={"SSE_END_DELAY": "0.05"})
    with routers.serving(tiny_model, tmp_path, [up]) as r:
        for i in range(streams):
            text = _stream(r.url, i)
            assert text.count("tok ") == 4 and text.rstrip().endswith("data: [DONE]"), text
        with urllib.request.urlopen(f"{up.url}/stats", timeout=30) as resp:
            connections = json.load(resp)["stream_connections"]
    # one, unless a health probe held the pooled connection just as a stream started (they share the pool)
    assert 1 <= connections < streams / 2, connections


def _first_token_after(url: str, prompt: str) -> float:
    """Seconds from sending a stream until its first token event arrived (the stream then read to its end)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.monotonic()
    first = None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic() - start
    assert first is not None, "no token event"
    return first


def _above(samples: dict[str, float], name: str, bound: str, labels: str = "") -> float:
    """Observations of histogram ``name`` above the bucket bound ``bound``."""
    sep = "," if labels else ""
    return samples[f"{name}_count{{{labels}}}" if labels else f"{name}_count"] - \
        samples[f'{name}_bucket{{le="{bound}"{sep}{labels}}}']


def test_ttft_counts_the_wait_for_admission(routers, tiny_model, tmp_path):
    """One request in flight at most: a stream queued behind a 3.2 s one (tests/stall_upstream.py, `slow 8`)
    waits about 3 s for admission, and its client's first token comes after that wait. The router's TTFT
    (what the planner, the SLO rules and the alerts read) must show it too, from the request's arrival, not
    from its admission; the wait is also in the queue-wait histogram."""
    up = routers.upstream(tmp_path, "decode", script="stall_upstream.py")
    with routers.serving(tiny_model, tmp_path, [up], spec={"maxInFlight": 1, "maxQueued": 4,
                                                           "queueTimeoutSeconds": 60}) as r:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(_first_token_after, r.url, "slow 8")
            wait_for(lambda: scrape(r.url)[m.ROUTER_IN_FLIGHT] == 1, 30, "the first stream admitted", interval=0.05)
            second = pool.submit(_first_token_after, r.url, "slow 1")
            wait_for(lambda: scrape(r.url)[m.ROUTER_QUEUE_DEPTH] == 1, 30, "the second stream queued", interval=0.05)
            first_ttft, second_ttft = first.result(timeout=120), second.result(timeout=120)
        s = scrape(r.url)
    assert first_ttft < 2.5 < second_ttft, (first_ttft, second_ttft)     # the client's view
    assert s[f'{m.ROUTER_TTFT_SECONDS}_count{{path="{PATH}"}}'] == 2
    assert _above(s, m.ROUTER_TTFT_SECONDS, "2.5", f'path="{PATH}"') == 1, s
    assert s[f"{m.ROUTER_QUEUE_WAIT_SECONDS}_count"] == 2
    assert _above(s, m.ROUTER_QUEUE_WAIT_SECONDS, "1.0") == 1, s            # the second waited, the first not
