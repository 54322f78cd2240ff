"""A decode worker whose stream ends before its first token (``[DONE]`` with no token, as a draining vLLM
answers a request it will not run) is a failure before output: the router serves the request from another
decode worker, counts the retry, and the client sees one complete stream, never an empty "success". The
upstreams are tests/sse_upstream.py (a real HTTP server speaking vLLM's wire format): one with no tokens
to give, one healthy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from disagg.api import metrics as m
from disagg.workers.local import LocalProcess, free_port, metric_sum, router, scrape

TOKENS = 8


def _upstream(name: str, tokens: int, tmp_path: Path) -> LocalProcess:
    port = free_port()
    return LocalProcess(name, [sys.executable, str(Path(__file__).with_name("sse_upstream.py")), str(port),
                               str(tokens), "0.01"], {}, f"http://127.0.0.1:{port}", tmp_path).start()


@pytest.fixture
def routed(tiny_model, tmp_path):
    empty, healthy = _upstream("empty", 0, tmp_path), _upstream("healthy", TOKENS, tmp_path)
    rport = free_port()
    cfg = {"model": "tiny", "tokenizer": tiny_model, "block_size": 16, "port": rport, "host": "127.0.0.1",
           "spec": {"disaggregation": "never", "policy": "round-robin"},
           "decode": [{"url": empty.url}, {"url": healthy.url}]}
    (tmp_path / "router.json").write_text(json.dumps(cfg))
    r = router(tmp_path / "router.json", rport, tmp_path).start()
    try:
        empty.wait_ready(timeout=30)
        healthy.wait_ready(timeout=30)
        r.wait_ready(timeout=60)
        yield r, empty.url
    finally:
        r.stop()
        empty.stop()
        healthy.stop()


def test_a_stream_ended_before_its_first_token_is_served_by_another_decode(routed):
    r, empty_url = routed
    client = OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)
    decodes = []
    for i in range(4):   # round-robin: half of them go to the empty worker first
        with client.completions.with_streaming_response.create(model="tiny", prompt=f"p{i}", max_tokens=TOKENS,
                                                               stream=True) as resp:
            chunks = [c for c in resp.parse() if c.choices]
            decodes.append(resp.headers.get("x-disagg-decode"))
        assert "".join(c.choices[0].text for c in chunks) == "tok " * TOKENS
        assert chunks[-1].choices[0].finish_reason == "length"
    assert empty_url not in decodes, decodes      # the route names the worker that served it
    s = scrape(r.url)
    assert s.get(f'{m.ROUTER_FALLBACKS}{{reason="{m.FALLBACK_DECODE_RETRY}"}}', 0) >= 1, s
    assert metric_sum(s, m.ROUTER_REQUESTS) == 4
    assert s.get(f'{m.ROUTER_REQUESTS}{{outcome="{m.OUTCOME_SUCCESS}",path="{m.PATH_LOCAL_PREFILL}"}}') == 4, s
