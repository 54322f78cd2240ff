"""Revision-safe pairing (router/pairing.py): prefill and decode of one KV revision only, new requests
on the newest revision with both roles, refusals counted (no HTTP, no vLLM)."""

from __future__ import annotations

import itertools

import pytest
from prometheus_client import generate_latest

from disagg.api import metrics as m
from disagg.api.names import ROLE_DECODE, ROLE_PREFILL
from disagg.router.config import RouterConfig
from disagg.router.errors import NoWorkers
from disagg.router.metrics import RouterMetrics
from disagg.router.service import Route, Router
from disagg.workers.local import metric_sum, parse_metrics

PROMPT = list(range(100))
# (url, revision, generation)
OLD = [("http://p-old:8000", "aaaa", 1), ("http://d-old:8000", "aaaa", 1)]
NEW = [("http://p-new:8000", "bbbb", 4), ("http://d-new:8000", "bbbb", 4)]


def _router(prefill, decode, mode: str = "always") -> Router:
    def eps(ws):
        return [{"url": u, "revision": rev, "revision_generation": gen} for u, rev, gen in ws]
    cfg = RouterConfig(model="tiny", tokenizer="unused", block_size=16, spec={"disaggregation": mode},
                       prefill=eps(prefill), decode=eps(decode))
    return Router(cfg, tokenizer=None, metrics=RouterMetrics())


def _refusals(r: Router) -> float:
    return metric_sum(parse_metrics(generate_latest(r.metrics.registry).decode()), m.ROUTER_PAIRING_REFUSALS)


def _set_health(r: Router, healthy: dict[str, bool]) -> None:
    for w in r.pool.all():
        w.healthy = healthy[w.name]


def test_mixed_revisions_are_never_paired():
    """Every combination of healthy workers over three revisions: a plan with a prefill always has it
    of the decode's revision, and the route names that revision."""
    prefill = [("http://p-a:8000", "aaaa", 1), ("http://p-b:8000", "bbbb", 2), ("http://p-c:8000", "cccc", 3)]
    decode = [("http://d-a:8000", "aaaa", 1), ("http://d-b:8000", "bbbb", 2), ("http://d-c:8000", "cccc", 3)]
    r = _router(prefill, decode)
    names = [u for u, _, _ in prefill + decode]
    plans = 0
    for states in itertools.product([True, False], repeat=len(names)):
        _set_health(r, dict(zip(names, states)))
        try:
            plan = r.plan(PROMPT)
        except NoWorkers:
            assert not any(states[3:]), "a healthy decode exists"
            continue
        plans += 1
        if plan.prefill is not None:
            assert plan.prefill.revision == plan.decode.revision, (states, plan)
        else:   # decode-only only when no healthy prefill shares a revision with a healthy decode
            healthy = {(w.role, w.revision) for w in r.pool.all() if w.healthy}
            assert not any((ROLE_PREFILL, rev) in healthy for role, rev in healthy if role == ROLE_DECODE)
    assert plans == 7 * 8    # the 7 non-empty decode sets times the 8 prefill sets


def test_the_newest_complete_revision_takes_new_requests():
    r = _router([OLD[0], NEW[0]], [OLD[1], NEW[1]])
    for _ in range(20):
        plan = r.plan(PROMPT)
        assert (plan.prefill.name, plan.decode.name) == ("http://p-new:8000", "http://d-new:8000")
    # the new revision loses its prefill: the old complete pair serves, not the new decode alone
    r.pool.workers[ROLE_PREFILL]["http://p-new:8000"].healthy = False
    plan = r.plan(PROMPT)
    assert (plan.prefill.name, plan.decode.name) == ("http://p-old:8000", "http://d-old:8000")
    assert _refusals(r) == 0       # a pair was found: nothing refused
    # generation, not the hash, orders revisions: a newer revision whose hash sorts first still wins
    r = _router([("http://p-z:8000", "ffff", 1), ("http://p-y:8000", "0000", 2)],
                [("http://d-z:8000", "ffff", 1), ("http://d-y:8000", "0000", 2)])
    assert r.plan(PROMPT).decode.name == "http://d-y:8000"


def test_no_same_revision_prefill_runs_decode_only_and_is_counted():
    # mid-rollout: the old revision kept only its decode, the new one only its prefill
    r = _router([NEW[0]], [OLD[1]])
    plan = r.plan(PROMPT)
    assert plan.prefill is None and plan.decode.name == "http://d-old:8000"
    r.plan(PROMPT)
    assert _refusals(r) == 2
    # no prefill at all is no refusal (nothing was passed over), nor is disaggregation: never
    r = _router([], [OLD[1]])
    assert r.plan(PROMPT).prefill is None and _refusals(r) == 0
    r = _router([NEW[0]], [OLD[1]], mode="never")
    assert r.plan(PROMPT).prefill is None and _refusals(r) == 0


def test_decode_only_goes_to_the_newest_revision_with_a_decode():
    r = _router([("http://p-x:8000", "xxxx", 9)], [OLD[1], NEW[1]])
    assert r.plan(PROMPT).decode.name == "http://d-new:8000"


def test_workers_without_a_revision_pair_as_before():
    """A static configuration that names no revision: one revision of its own, paired as always."""
    r = _router([("http://p:8000", None, None)], [("http://d:8000", None, None)])
    plan = r.plan(PROMPT)
    assert plan.prefill is not None and plan.decode.revision is None
    assert "x-disagg-revision" not in Route("remote_prefill", plan.decode.name, plan.prefill.name).headers()


def test_conditional_mode_reads_saturation_of_the_paired_revision_only():
    r = _router([OLD[0], NEW[0]], [OLD[1], NEW[1]], mode="conditional")
    r.config.spec.local_prefill_threshold_tokens = 1
    r.pool.workers[ROLE_PREFILL]["http://p-old:8000"].active = 10**6   # the other revision's prefill is busy
    assert r.plan(PROMPT).prefill.name == "http://p-new:8000"


def test_route_headers_carry_the_revision():
    r = _router([NEW[0]], [NEW[1]])
    plan = r.plan(PROMPT)
    route = Route("remote_prefill", plan.decode.name, plan.prefill.name, revision=plan.decode.revision)
    assert route.headers()["x-disagg-revision"] == "bbbb"


def test_no_decode_is_still_no_workers():
    r = _router([OLD[0]], [OLD[1]])
    r.pool.workers[ROLE_DECODE]["http://d-old:8000"].healthy = False
    with pytest.raises(NoWorkers, match="no healthy decode workers"):
        r.plan(PROMPT)


def test_discovery_takes_revisions_from_the_endpoints_pods():
    """An endpoint gets its pod's revision; one whose pod is not among the listed pods (created after
    the list) waits for the next poll rather than joining without a revision."""
    from types import SimpleNamespace as O   # the attributes discovery reads of V1EndpointSlice and V1Pod

    from disagg.api import contract
    from disagg.router.discovery import endpoints_from_slices, revisions_from_pods

    def ep(ip, pod):
        return O(addresses=[ip], conditions=O(ready=True, terminating=False), target_ref=O(kind="Pod", name=pod))
    slices = [O(endpoints=[ep("192.0.2.1", "a"), ep("192.0.2.2", "b")], ports=[O(name="http", port=8000)])]
    pods = [O(metadata=O(name="a", labels={contract.KV_REVISION_LABEL: "aaaa",
                                           contract.KV_REVISION_GENERATION_LABEL: "7"}))]
    eps = endpoints_from_slices(slices, revisions_from_pods(pods))
    assert [(e.url, e.revision, e.revision_generation) for e in eps] == [("http://192.0.2.1:8000", "aaaa", 7)]
    # workers no operator labelled (no pod carries a revision): all of them, without one
    assert [e.revision for e in endpoints_from_slices(slices, {})] == [None, None]


def test_requests_through_the_router_pair_within_a_revision(tiny_model):
    """The whole request path (real HTTP: the router app in front of in-process upstreams): the decode
    receives KV parameters only from a prefill of its own revision, the headers name the revision, and a
    decode-only request on an incomplete revision is counted as a refusal."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from disagg.router.app import ROUTER_KEY, make_app
    from disagg.workers.local import free_port

    received: dict[str, list] = {}     # decode url -> kv_transfer_params of each request it served

    def upstream(name: str) -> web.Application:
        async def completions(request):
            body = await request.json()
            params = body.get("kv_transfer_params") or {}
            usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
            if params.get("do_remote_decode"):          # a prefill: hands out KV parameters naming itself
                return web.json_response({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                          "usage": usage, "kv_transfer_params": {"from": name}})
            received.setdefault(name, []).append(body.get("kv_transfer_params"))
            return web.json_response({"id": "c", "object": "text_completion", "model": "tiny", "usage": usage,
                                      "choices": [{"index": 0, "text": "y", "finish_reason": "length"}]})

        async def health(_):
            return web.json_response({})
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/health", health)
        return app

    async def run() -> list[dict[str, str]]:
        runners, urls = [], {}
        for name in ("p-new", "d-old", "d-new"):
            runner = web.AppRunner(upstream(name))
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            urls[name] = f"http://127.0.0.1:{port}"
        cfg = RouterConfig(model="tiny", tokenizer=tiny_model, block_size=16, max_model_len=1024,
                           health_interval_s=600, spec={"disaggregation": "always"},
                           prefill=[{"url": urls["p-new"], "revision": "bbbb", "revision_generation": 4}],
                           decode=[{"url": urls["d-old"], "revision": "aaaa", "revision_generation": 1},
                                   {"url": urls["d-new"], "revision": "bbbb", "revision_generation": 4}])
        app = make_app(cfg)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        headers = []
        try:
            async with aiohttp.ClientSession() as s:
                async def ask(i):
                    async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                                      json={"model": "tiny", "prompt": f"hello {i}", "max_tokens": 1}) as r:
                        assert r.status == 200, await r.text()
                        headers.append({k.lower(): v for k, v in r.headers.items() if k.lower().startswith("x-disagg")})
                for i in range(4):
                    await ask(i)
                # the new revision's decode goes: the old decode serves alone, without the new prefill's KV
                app[ROUTER_KEY].pool.workers["decode"][urls["d-new"]].healthy = False
                await ask(9)
                async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                    text = await r.text()
        finally:
            for runner in reversed(runners):
                await runner.cleanup()
        return headers, text, urls

    headers, text, urls = asyncio.run(run())
    assert headers[:4] == [{"x-disagg-path": "remote_prefill", "x-disagg-decode": urls["d-new"],
                            "x-disagg-prefill": urls["p-new"], "x-disagg-revision": "bbbb"}] * 4
    assert received["d-new"] == [{"from": "p-new"}] * 4
    assert headers[4] == {"x-disagg-path": "local_prefill", "x-disagg-decode": urls["d-old"],
                          "x-disagg-revision": "aaaa", "x-disagg-local-reason": m.LOCAL_NO_PREFILL}
    assert received["d-old"] == [None]
    assert metric_sum(parse_metrics(text), m.ROUTER_PAIRING_REFUSALS) == 1
