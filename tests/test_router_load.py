"""The router holds 1,000 concurrent streaming clients (the official async openai client) with no
errors. The upstream is tests/sse_upstream.py, not vLLM: this tests the router, not vLLM's speed
on two CPU cores (see that file)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx2
import pytest
from openai import AsyncOpenAI, DefaultAsyncHttpx2Client

from disagg.api import metrics as m
from disagg.workers.local import LocalProcess, free_port, metric_sum, router, scrape
from disagg.workers.testing import tiny_model, worker_python  # noqa: F401  (fixtures)

CLIENTS = 1000
TOKENS = 8


@pytest.fixture
def routed(tiny_model, tmp_path):
    up_port, port = free_port(), free_port()
    upstream = LocalProcess("upstream", [sys.executable, str(Path(__file__).with_name("sse_upstream.py")),
                                         str(up_port), str(TOKENS), "0.02"], {},
                            f"http://127.0.0.1:{up_port}", tmp_path).start()
    cfg = {"model": "tiny", "tokenizer": tiny_model, "block_size": 16, "port": port, "host": "127.0.0.1",
           "spec": {"disaggregation": "never"}, "decode": [{"url": upstream.url}]}
    (tmp_path / "router.json").write_text(json.dumps(cfg))
    r = router(tmp_path / "router.json", port, tmp_path).start()
    try:
        upstream.wait_ready(timeout=30)
        r.wait_ready(timeout=60)
        yield r
    finally:
        r.stop()
        upstream.stop()


def test_thousand_concurrent_streaming_clients(routed):
    async def main():
        http = DefaultAsyncHttpx2Client(limits=httpx2.Limits(max_connections=CLIENTS + 10), timeout=120)
        client = AsyncOpenAI(base_url=f"{routed.url}/v1", api_key="unused", http_client=http, max_retries=0)
        started = asyncio.Event()

        async def one(i: int) -> str:
            await started.wait()
            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"client {i}"}], stream=True,
                max_tokens=TOKENS)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        tasks = [asyncio.create_task(one(i)) for i in range(CLIENTS)]
        started.set()
        try:
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await http.aclose()

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} clients failed, first: {errors[0]!r}"
    assert all(r == "tok " * TOKENS for r in results)
    s = scrape(routed.url)
    assert s[f'{m.ROUTER_REQUESTS}{{outcome="success",path="{m.PATH_LOCAL_PREFILL}"}}'] == CLIENTS
    assert metric_sum(s, m.ROUTER_REQUESTS) == CLIENTS
    assert metric_sum(s, m.ROUTER_ITL_SECONDS + "_count") == CLIENTS * (TOKENS - 1)
