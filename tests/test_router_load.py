"""The router holds 2,000 concurrent streaming clients (the official async openai client) with no
errors. The upstream is tests/sse_upstream.py, not vLLM: this tests the router, not vLLM's speed
on two CPU cores (see that file).

The deadlines here are generous on purpose; they are no performance assertion (bench/ measures speed).
With the router's defaults, a run on a loaded 2-core machine (the test suite niced beside other work)
failed about 1 in 2: the router opens 2,000 connections to the one upstream in a burst, the upstream
(one Python process as starved as everything else) accepts them slowly, its accept queue fills with
connections the router had already given up on, SYNs are dropped and retried after 1, 3, 7 s, and the
router's 5 s connect timeout (connectTimeoutSeconds) cut 600 of the 2,000 requests (502s, each counted in
disagg_router_upstream_timeouts_total{kind="connect"}). Those are the router's documented behaviour for
an unreachable worker, not a fault under test."""

from __future__ import annotations

import pytest

from disagg.api import metrics as m
from disagg.workers.local import metric_sum, scrape

CLIENTS = 2000
TOKENS = 8
# a deadline for the whole burst, client and router alike: minutes, not the seconds a quiet machine needs
DEADLINE_S = 600


@pytest.fixture
def routed(routers, tiny_model, tmp_path, open_files):
    upstream = routers.upstream(tmp_path, "upstream", TOKENS, 0.02)
    # connect and stream deadlines far above any wait a starved machine makes (see the module's doc);
    # health probes rarer than the burst lasts, so the busy upstream's slow /health answers (2 s each,
    # 3 in a row) cannot take the only worker out mid-test (tests/test_router_health.py covers that logic)
    with routers.serving(tiny_model, tmp_path, [upstream], max_model_len=None, health_interval_s=DEADLINE_S,
                         spec={"connectTimeoutSeconds": DEADLINE_S, "firstTokenTimeoutSeconds": DEADLINE_S,
                               "idleTimeoutSeconds": DEADLINE_S}) as r:
        yield r


def test_two_thousand_concurrent_streaming_clients(routed, stream_burst):
    results = stream_burst(f"{routed.url}/v1", CLIENTS, TOKENS, DEADLINE_S)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} clients failed, first: {errors[0]!r}"
    assert all(r == "tok " * TOKENS for r in results)
    s = scrape(routed.url)
    assert s[f'{m.ROUTER_REQUESTS}{{outcome="success",path="{m.PATH_LOCAL_PREFILL}"}}'] == CLIENTS
    assert metric_sum(s, m.ROUTER_REQUESTS) == CLIENTS
    assert metric_sum(s, m.ROUTER_ITL_SECONDS + "_count") == CLIENTS * (TOKENS - 1)
