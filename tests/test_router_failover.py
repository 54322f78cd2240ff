"""A decode worker that dies: before its first token the request is retried on another decode
worker (counted, and named in the x-disagg-decode header); after output has started the client gets
a clean OpenAI-shaped error in the stream, never a hang or a truncated success. The upstreams are
tests/sse_upstream.py (real HTTP servers, killed for real), so the test is about the router."""

from __future__ import annotations

import signal

import openai
import pytest
from openai import OpenAI

from disagg.api import metrics as m
from disagg.workers.local import scrape

TOKENS = 20


@pytest.fixture
def two_decoders(routers, tiny_model, tmp_path):
    ups = [routers.upstream(tmp_path, f"decode-{i}", TOKENS, 0.01) for i in range(2)]
    # health checks once a minute: the dead worker is found by the requests, not by a probe
    with routers.serving(tiny_model, tmp_path, ups, spec={"policy": "round-robin"}, health_interval_s=60) as r:
        yield r, ups


def test_a_decode_worker_dead_before_output_is_retried_elsewhere(two_decoders):
    r, (dead, alive) = two_decoders
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait(10)
    client = OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)
    for i in range(4):                        # round-robin: at least two of these go to the dead one first
        raw = client.completions.with_raw_response.create(model="tiny", prompt=f"p{i}", max_tokens=TOKENS)
        assert raw.headers["x-disagg-decode"] == alive.url
        assert raw.parse().choices[0].text == "tok " * TOKENS
        chunks = list(client.completions.create(model="tiny", prompt=f"s{i}", max_tokens=TOKENS, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == "tok " * TOKENS
    s = scrape(r.url)
    assert s[f'{m.ROUTER_FALLBACKS}{{reason="{m.FALLBACK_DECODE_RETRY}"}}'] >= 1
    assert s[f'{m.ROUTER_REQUESTS}{{outcome="success",path="{m.PATH_LOCAL_PREFILL}"}}'] == 8


@pytest.fixture
def one_slow_decoder(routers, tiny_model, tmp_path):
    up = routers.upstream(tmp_path, "decode", TOKENS, 0.2)    # 20 tokens over 4 s: time to kill it mid-stream
    with routers.serving(tiny_model, tmp_path, [up]) as r:
        yield r, up


def test_a_decode_worker_dying_mid_stream_gives_a_clean_error(one_slow_decoder):
    r, up = one_slow_decoder
    client = OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)
    stream = iter(client.completions.create(model="tiny", prompt="x", max_tokens=TOKENS, stream=True))
    first = next(stream)
    assert first.choices[0].text == "tok "
    up.proc.send_signal(signal.SIGKILL)
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    assert "decode worker" in str(err.value) and up.url in str(err.value)
    s = scrape(r.url)
    assert s[f'{m.ROUTER_REQUESTS}{{outcome="{m.OUTCOME_UPSTREAM_ERROR}",path="{m.PATH_LOCAL_PREFILL}"}}'] == 1
