"""Flex workers in the router (spec.flex): each serves the role it is given, and a role change drains it first.

The router runs in this process (its app on a real port, in an event loop of its own: disagg.e2e.testing.LoopThread)
so that its state can be read; its workers are real HTTP servers speaking vLLM's wire format
(tests/sse_upstream.py): one serves either role, as a vLLM engine with kv_role kv_both does. The switch is
given the way discovery gives it (Router.update_workers with role "flex", what the pods' serving-role label
or a local roles file become). Real engines: tests/test_router_pd.py's flex tests.
"""

from __future__ import annotations

import json

import aiohttp
from aiohttp import web

from disagg.api import metrics as m
from disagg.api.names import ROLE_DECODE, ROLE_FLEX, ROLE_PREFILL
from disagg.e2e.testing import LoopThread, wait_for
from disagg.router.app import ROUTER_KEY, make_app
from disagg.router.config import FlexEndpoint, RouterConfig, WorkerEndpoint
from disagg.workers.local import free_port, stop_all


class FlexRouter:
    def __init__(self, tiny_model: str, prefill: list[str], decode: list[str], flex: dict[str, str], **extra):
        self.loop = LoopThread()
        spec = {"disaggregation": "always", "firstTokenTimeoutSeconds": 600}
        self.config = RouterConfig(model="tiny", tokenizer=tiny_model, block_size=16, max_model_len=1024,
                                   host="127.0.0.1", port=free_port(), health_interval_s=0.2, spec=spec,
                                   prefill=[WorkerEndpoint(url=u) for u in prefill],
                                   decode=[WorkerEndpoint(url=u) for u in decode],
                                   flex=[FlexEndpoint(url=u, role=r) for u, r in flex.items()], **extra)
        app = make_app(self.config)
        self.router = app[ROUTER_KEY]

        async def serve() -> web.AppRunner:
            r = web.AppRunner(app, access_log=None, shutdown_timeout=5)
            await r.setup()
            await web.TCPSite(r, self.config.host, self.config.port).start()
            return r
        self.runner = self.loop.run(serve())
        self.url = f"http://{self.config.host}:{self.config.port}"

    def switch(self, url: str, role: str) -> None:
        self.loop.call(self.router.update_workers, ROLE_FLEX, [FlexEndpoint(url=url, role=role)])

    def worker(self, url: str):
        return self.loop.call(lambda: self.router.pool.flex[url])

    def serves(self, url: str) -> str | None:
        """The role ``url`` takes new work of now (None while it drains)."""
        return self.loop.call(lambda: (lambda w: None if w.switching_to else w.role)(self.router.pool.flex[url]))

    def sample(self, name: str, **labels) -> float:
        return self.loop.call(lambda: self.router.metrics.registry.get_sample_value(name, labels) or 0.0)

    def stream(self, prompt: str, max_tokens: int = 4):
        """A streamed completion, in the router's loop: (route headers, text), or its exception."""
        async def one():
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{self.url}/v1/completions", json={
                        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True}) as r:
                    body = (await r.read()).decode()
                    assert r.status == 200, body
                    assert "\"error\"" not in body, body
                    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in body.splitlines()
                                   if line.startswith("data: {") and json.loads(line[6:])["choices"])
                    return dict(r.headers), text
        return self.loop.submit(one())

    def complete(self, prompt: str, max_tokens: int = 4):
        """A completion, not streamed, in the router's loop: (route headers, text), or its exception."""
        async def one():
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{self.url}/v1/completions", json={
                        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens}) as r:
                    body = await r.json()
                    assert r.status == 200, body
                    return dict(r.headers), body["choices"][0]["text"]
        return self.loop.submit(one())

    def close(self) -> None:
        self.loop.run(self.runner.cleanup())
        self.loop.close()


def test_a_prefill_holding_kv_for_a_decode_switches_only_when_the_lease_runs_out(routers, tiny_model, tmp_path):
    """The flex worker prefilled a request whose decode waits for its KV (and never pulls it): told to
    serve decode, it takes no new prefill at once, and does not flip while the decode waits (the decode's
    heartbeats keep the blocks). Once that decode is gone, the request is served by the other decode (which
    prefills it itself: no failed request), the held blocks' lease (2 s here) runs out, and it flips."""
    flex = routers.upstream(tmp_path, "flex", 4, 0.01)
    waiting_decode = routers.upstream(tmp_path, "waiting-decode", 4, 0.01, env={"SSE_KV_WAIT": "1"})
    decode = routers.upstream(tmp_path, "decode", 4, 0.01)
    prefill = routers.upstream(tmp_path, "prefill", 4, 0.01)
    r = None
    try:
        for u in (flex, waiting_decode, decode, prefill):
            u.wait_ready(timeout=30)
        r = FlexRouter(tiny_model, [prefill.url], [waiting_decode.url, decode.url], {flex.url: ROLE_PREFILL},
                       kv_lease_seconds=2, flex_drain_seconds=120)
        # the least loaded prefill is the flex worker, the least loaded decode the one that waits
        busy = {ROLE_PREFILL: prefill.url, ROLE_DECODE: decode.url}
        for role, url in busy.items():
            r.loop.call(lambda role=role, url=url: setattr(r.router.pool.workers[role][url], "active", 100))
        held = r.complete("hello " * 40)
        wait_for(lambda: r.sample(m.ROUTER_KV_HELD, role=ROLE_PREFILL, worker=flex.url) == 1, 30,
                 "the flex worker to hold KV for the waiting decode", interval=0.05)
        r.switch(flex.url, ROLE_DECODE)
        assert r.serves(flex.url) is None                       # no new prefill from now on
        assert flex.url not in r.loop.call(lambda: [w.name for w in r.router.pool.healthy(ROLE_PREFILL)])
        assert flex.url not in r.loop.call(lambda: [w.name for w in r.router.pool.healthy(ROLE_DECODE)])
        # while the decode waits for them the blocks have no lease deadline (its heartbeats extend it): the
        # drain has nothing to wait out but the decode
        assert r.loop.call(lambda: r.router.fleet._drain_left(r.router.pool.flex[flex.url])) == float("inf")
        assert r.worker(flex.url).switching_to == ROLE_DECODE and r.worker(flex.url).role == ROLE_PREFILL
        assert r.sample(m.ROUTER_FLEX_WORKERS, role=ROLE_PREFILL, state="draining") == 1
        assert r.sample(m.ROUTER_KV_HELD, role=ROLE_PREFILL, worker=flex.url) == 1
        assert not held.done()
        stop_all([waiting_decode], grace=1)     # the decode goes without pulling: the blocks wait for the lease
        headers, text = held.result(timeout=30)
        # served all the same, by the other decode, which prefilled it itself (counted)
        assert headers["x-disagg-decode"] == decode.url and text == "tok " * 4
        assert headers["x-disagg-fallback"] == m.FALLBACK_KV_TRANSFER
        wait_for(lambda: r.serves(flex.url) == ROLE_DECODE, 30, "the flip once the lease ran out", interval=0.05)
        assert r.sample(m.ROUTER_ROLE_SWITCHES, from_role=ROLE_PREFILL, to_role=ROLE_DECODE,
                        outcome=m.SWITCH_SWITCHED) == 1
        drained = r.sample(m.ROUTER_SWITCH_DRAIN_SECONDS + "_sum", outcome=m.SWITCH_SWITCHED)
        assert drained >= 2, drained            # the decode's wait, then the whole lease
        assert r.sample(m.ROUTER_KV_HELD, role=ROLE_DECODE, worker=flex.url) == 0
        # it serves decode now: a request goes to it (the dedicated decode is as loaded as can be)
        r.loop.call(lambda: setattr(r.router.pool.workers[ROLE_PREFILL][prefill.url], "active", 0))
        headers, text = r.stream("a decode on the flex worker " * 4).result(timeout=30)
        assert headers["x-disagg-decode"] == flex.url and headers["x-disagg-prefill"] == prefill.url
        assert text == "tok " * 4
    finally:
        if r is not None:
            r.close()
        stop_all([flex, waiting_decode, decode, prefill], grace=1)


def test_a_decode_switches_after_its_streams_end_and_a_stuck_drain_is_given_up(routers, tiny_model, tmp_path):
    """A flex decode with a stream in flight, told to serve prefill: new decodes go to the dedicated one, the
    stream finishes whole, and then it flips. A second switch whose stream outlasts flex_drain_seconds is
    given up at the bound (counted abandoned), and that stream still finishes whole."""
    flex = routers.upstream(tmp_path, "flex", 40, 0.05)         # 2 s streams
    decode = routers.upstream(tmp_path, "decode", 4, 0.01)
    prefill = routers.upstream(tmp_path, "prefill", 4, 0.01)
    r = None
    try:
        for u in (flex, decode, prefill):
            u.wait_ready(timeout=30)
        r = FlexRouter(tiny_model, [prefill.url], [decode.url], {flex.url: ROLE_DECODE}, flex_drain_seconds=30)
        r.loop.call(lambda: setattr(r.router.pool.workers[ROLE_DECODE][decode.url], "active", 100))
        long = r.stream("a long answer " * 4, max_tokens=40)
        wait_for(lambda: r.sample(m.ROUTER_ACTIVE_REQUESTS, role=ROLE_DECODE, worker=flex.url) == 1, 30,
                 "the stream on the flex worker", interval=0.05)
        r.switch(flex.url, ROLE_PREFILL)
        r.loop.call(lambda: setattr(r.router.pool.workers[ROLE_DECODE][decode.url], "active", 0))
        headers, _ = r.stream("while it drains").result(timeout=30)
        assert headers["x-disagg-decode"] == decode.url            # not to the draining worker
        assert r.serves(flex.url) is None
        headers, text = long.result(timeout=60)
        assert headers["x-disagg-decode"] == flex.url and text == "tok " * 40
        wait_for(lambda: r.serves(flex.url) == ROLE_PREFILL, 10, "the flip after the stream ended", interval=0.05)
        assert r.sample(m.ROUTER_ROLE_SWITCHES, from_role=ROLE_DECODE, to_role=ROLE_PREFILL,
                        outcome=m.SWITCH_SWITCHED) == 1

        # asked to switch and back before the drain ended: cancelled, it keeps serving prefill
        r.loop.call(lambda: setattr(r.router.pool.workers[ROLE_PREFILL][prefill.url], "active", 100))
        r.loop.call(lambda: setattr(r.router.fleet, "config", r.config.model_copy(update={"flex_drain_seconds": 0.5})))
        r.loop.call(lambda: setattr(r.router.pool.flex[flex.url], "active", 1))   # a prefill in flight
        r.switch(flex.url, ROLE_DECODE)
        r.switch(flex.url, ROLE_PREFILL)
        wait_for(lambda: r.sample(m.ROUTER_ROLE_SWITCHES, from_role=ROLE_PREFILL, to_role=ROLE_DECODE,
                                  outcome=m.SWITCH_CANCELLED) == 1, 10, "the cancelled switch", interval=0.05)
        assert r.serves(flex.url) == ROLE_PREFILL
        r.loop.call(lambda: setattr(r.router.pool.flex[flex.url], "active", 0))

        # back to decode with a stream that outlasts the bound (0.5 s): given up, it finishes all the same
        r.switch(flex.url, ROLE_DECODE)
        wait_for(lambda: r.serves(flex.url) == ROLE_DECODE, 10, "the flip", interval=0.05)
        r.loop.call(lambda: setattr(r.router.pool.workers[ROLE_DECODE][decode.url], "active", 100))
        long = r.stream("another long answer " * 4, max_tokens=40)
        wait_for(lambda: r.sample(m.ROUTER_ACTIVE_REQUESTS, role=ROLE_DECODE, worker=flex.url) == 1, 30,
                 "the second stream on the flex worker", interval=0.05)
        r.switch(flex.url, ROLE_PREFILL)
        wait_for(lambda: r.sample(m.ROUTER_ROLE_SWITCHES, from_role=ROLE_DECODE, to_role=ROLE_PREFILL,
                                  outcome=m.SWITCH_ABANDONED) == 1, 10, "the drain given up", interval=0.05)
        assert r.serves(flex.url) == ROLE_PREFILL
        assert not long.done()                      # the bound cut nothing
        headers, text = long.result(timeout=60)
        assert headers["x-disagg-decode"] == flex.url and text == "tok " * 40
    finally:
        if r is not None:
            r.close()
        stop_all([flex, decode, prefill], grace=1)


def test_local_flex_roles_file_switches_a_worker(routers, tiny_model, tmp_path):
    """Local runs: the roles file ({url: role}) says each flex worker's role, re-read as it changes."""
    flex = routers.upstream(tmp_path, "flex", 4, 0.01)
    decode = routers.upstream(tmp_path, "decode", 4, 0.01)
    roles = tmp_path / "flex-roles.json"
    roles.write_text(json.dumps({flex.url: ROLE_DECODE}))
    r = None
    try:
        for u in (flex, decode):
            u.wait_ready(timeout=30)
        r = FlexRouter(tiny_model, [], [decode.url], {flex.url: ROLE_DECODE}, flex_roles_file=str(roles))
        assert r.serves(flex.url) == ROLE_DECODE
        roles.write_text(json.dumps({flex.url: ROLE_PREFILL}))
        wait_for(lambda: r.serves(flex.url) == ROLE_PREFILL, 10, "the switch the file asks for", interval=0.05)
        headers, text = r.stream("prefilled by the flex worker " * 4).result(timeout=30)
        assert headers["x-disagg-prefill"] == flex.url and headers["x-disagg-decode"] == decode.url
        assert headers["x-disagg-path"] == m.PATH_REMOTE_PREFILL and text == "tok " * 4
    finally:
        if r is not None:
            r.close()
        stop_all([flex, decode], grace=1)
