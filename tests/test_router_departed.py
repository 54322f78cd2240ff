"""A worker that leaves discovery leaves nothing behind in the router: its metric series (in-flight gauge,
routing decisions), its probe-timeout count and its prefill-lost mark go with it. Workers come and go for
as long as a router runs (rollouts, scaling, pods restarted under new IPs), so anything kept per worker
that ever left grows without bound, and /metrics would list every worker the router ever knew.

The router runs in this process (its app on a real port, in an event loop of its own) so that its state
can be read; its workers are real HTTP servers: tests/sse_upstream.py as a prefill and as a decode that
waits forever for the prefill's KV (SSE_KV_WAIT), and a socket that accepts and never answers (its health
probes time out)."""

from __future__ import annotations

import asyncio
import socket
import threading

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from disagg.api import metrics as m
from disagg.api.names import ROLE_DECODE, ROLE_PREFILL
from disagg.e2e.testing import wait_for
from disagg.router.app import ROUTER_KEY, make_app
from disagg.router.config import RouterConfig, WorkerEndpoint
from disagg.workers.local import free_port, stop_all


class Loop:
    """An event loop in a thread: the router runs there, the test waits with the project's wait_for and
    reads the router's state through the loop (never while the loop writes it)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    def call(self, fn, *args):
        async def run():
            return fn(*args)
        return self.run(run())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


def _series_of(router, worker: str) -> list[str]:
    """The router's /metrics lines that name ``worker``."""
    text = generate_latest(router.metrics.registry).decode()
    return [line for line in text.splitlines() if not line.startswith("#") and f'worker="{worker}"' in line]


def test_a_departed_workers_state_is_freed(routers, tiny_model, tmp_path):
    prefill = routers.upstream(tmp_path, "prefill", 4, 0.01)
    decode = routers.upstream(tmp_path, "decode", 4, 0.01, env={"SSE_KV_WAIT": "1"})
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    loop, runner, waiting = Loop(), None, None
    try:
        for u in (prefill, decode):
            u.wait_ready(timeout=30)
        config = RouterConfig(model="tiny", tokenizer=tiny_model, block_size=16, max_model_len=1024,
                              host="127.0.0.1", port=free_port(), health_interval_s=0.2,
                              spec={"disaggregation": "always", "firstTokenTimeoutSeconds": 600},
                              prefill=[WorkerEndpoint(url=prefill.url)], decode=[WorkerEndpoint(url=decode.url)])
        app = make_app(config)
        router = app[ROUTER_KEY]

        async def serve() -> web.AppRunner:
            r = web.AppRunner(app, access_log=None, shutdown_timeout=5)
            await r.setup()
            await web.TCPSite(r, config.host, config.port).start()
            return r
        runner = loop.run(serve())

        async def stream() -> None:
            # prefilled remotely, then the decode waits for the prefill's KV: the router marks that wait
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://{config.host}:{config.port}/v1/completions",
                                  json={"model": "tiny", "prompt": "hello " * 40, "max_tokens": 4,
                                        "stream": True}) as r:
                    await r.read()
        waiting = asyncio.run_coroutine_threadsafe(stream(), loop.loop)
        wait_for(lambda: loop.call(lambda: prefill.url in router.fleet.prefill_lost), 30,
                 "the decode to wait for the prefill's KV", interval=0.1)
        # a decode worker whose /health never answers joins: its probes time out
        loop.call(router.update_workers, ROLE_DECODE,
                  [WorkerEndpoint(url=decode.url), WorkerEndpoint(url=silent_url)])
        wait_for(lambda: loop.call(lambda: router.fleet.probe_timeouts.get(silent_url, 0) >= 1), 30,
                 "a probe of the silent worker to time out", interval=0.1)
        for worker in (prefill.url, decode.url, silent_url):
            assert loop.call(_series_of, router, worker), worker
        assert loop.call(lambda: router.metrics.registry.get_sample_value(
            m.ROUTER_ROUTING_DECISIONS,
            {"policy": "kv-aware", "role": ROLE_PREFILL, "worker": prefill.url})) == 1

        # the prefill and the silent decode leave discovery
        loop.call(router.update_workers, ROLE_PREFILL, [])
        loop.call(router.update_workers, ROLE_DECODE, [WorkerEndpoint(url=decode.url)])
        for worker in (prefill.url, silent_url):
            assert loop.call(_series_of, router, worker) == [], worker
        assert loop.call(lambda: silent_url not in router.fleet.probe_timeouts)
        assert loop.call(lambda: prefill.url not in router.fleet.prefill_lost)
        # the decode that stays keeps its series
        assert any(f'role="{ROLE_DECODE}"' in line for line in loop.call(_series_of, router, decode.url))
    finally:
        if waiting is not None:
            waiting.cancel()
        # the waiting stream's worker gone (it would drain that stream for its whole grace), the router's
        # handler ends
        stop_all([prefill, decode], grace=1)
        if runner is not None:
            loop.run(runner.cleanup())
        loop.close()
        silent.close()
