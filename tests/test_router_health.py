"""The router's liveness is separate from its readiness: with every decode worker down it is not
ready (503, out of the Service) but alive (200), so its liveness probe never restarts it and wipes
its prefix index. The decode worker here is a real HTTP server that answers /health and then goes away."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from disagg.api.contract import ROUTER_LIVE_PATH, ROUTER_READY_PATH
from disagg.router.app import make_app
from disagg.router.config import RouterConfig
from disagg.router.metrics import RouterMetrics
from disagg.router.service import Router


async def _wait_status(session: aiohttp.ClientSession, url: str, status: int, timeout: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        async with session.get(url) as r:
            if r.status == status:
                return
        assert asyncio.get_running_loop().time() < deadline, f"{url} never answered {status}"
        await asyncio.sleep(0.05)


async def _scenario() -> None:
    async def healthy(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_request: web.Request) -> web.Response:   # vLLM's model card shape
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 512}]})

    worker = web.Application()
    worker.router.add_get("/health", healthy)
    worker.router.add_get("/v1/models", models)
    decode = TestServer(worker, host="127.0.0.1")
    await decode.start_server()
    config = RouterConfig(model="m", tokenizer="unused", block_size=16, health_interval_s=0.05,
                          decode=[{"url": str(decode.make_url("")).rstrip("/")}])
    router = Router(config, tokenizer=None, metrics=RouterMetrics())
    server = TestServer(make_app(config, router=router), host="127.0.0.1")
    await server.start_server()
    base = str(server.make_url("")).rstrip("/")
    router.index["decode"].add_keys(router.pool.all()[0].name, [1, 2, 3])
    try:
        async with aiohttp.ClientSession() as s:
            await _wait_status(s, base + ROUTER_READY_PATH, 200)
            # configured with none: learned from the worker's model card (right after its /health answered)
            deadline = asyncio.get_running_loop().time() + 10
            while router.max_model_len is None and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            assert router.max_model_len == 512
            async with s.get(base + ROUTER_LIVE_PATH) as r:
                assert r.status == 200
            await decode.close()                       # the decode outage
            await _wait_status(s, base + ROUTER_READY_PATH, 503)
            async with s.get(base + ROUTER_LIVE_PATH) as r:
                assert r.status == 200, "liveness must not depend on the workers"
            assert router.index["decode"].blocks() == 3  # nothing restarted, nothing forgotten
    finally:
        await server.close()
        await decode.close()


def test_a_decode_outage_makes_the_router_unready_but_not_dead():
    asyncio.run(_scenario())


def test_the_rendered_router_pod_probes_liveness_and_readiness_separately():
    from disagg.e2e.testing import dd_manifest
    from disagg.api.v1alpha1 import DisaggDeployment
    from disagg.operator import render

    manifest = dd_manifest("demo")
    manifest["metadata"]["namespace"] = "ns"
    pod = render.router_deployment(DisaggDeployment.model_validate(manifest), "uid")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == ROUTER_LIVE_PATH
    assert c["readinessProbe"]["httpGet"]["path"] == ROUTER_READY_PATH
