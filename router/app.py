"""HTTP routes: thin handlers over :class:`~.service.Router`; errors rendered in one place."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.exposition import choose_encoder

from disagg.api import metrics as m
from disagg.api.contract import ROUTER_LIVE_PATH, ROUTER_READY_PATH

from . import errors
from .auth import OPEN_PATHS, ApiKeys
from .config import RouterConfig
from .metrics import RouterMetrics
from .body import parse_body
from .protocol import ChatCompletionRequest, CompletionRequest
from .service import Router
from .tracing import A_ENDPOINT, A_OUTCOME, A_PATH, A_STATUS, ADMISSION, REQUEST
from .tracing import failed as mark_failed

log = logging.getLogger("disagg.router")
ROUTER_KEY = web.AppKey("router", Router)
KEYS_KEY = web.AppKey("api_keys", ApiKeys)


def _error(err: errors.RouterError) -> web.Response:
    headers = None
    if isinstance(err, errors.Overloaded):
        headers = {"Retry-After": str(err.retry_after_s)}
    elif isinstance(err, errors.Unauthorized):
        headers = {"WWW-Authenticate": "Bearer"}
    return web.json_response(errors.body(err), status=err.status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except errors.RouterError as e:
        return _error(e)
    except web.HTTPRequestEntityTooLarge:
        return _error(_too_large(request))
    except web.HTTPException as e:
        if e.status >= 400:
            return web.json_response(errors.body(_http(e)), status=e.status)
        raise
    except Exception:  # a bug: logged, and a 500 in the same shape (never a 400)
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error(errors.RouterError("internal error in the router"))


@web.middleware
async def auth_middleware(request: web.Request, handler):
    """With spec.router.auth, a valid API key on everything but the probes; checked before admission and
    before the body is read, so a client without a key costs no slot and no upload."""
    keys = request.app[KEYS_KEY]
    if request.path not in OPEN_PATHS:
        reason = keys.failure(request.headers.get("Authorization"))
        if reason is not None:
            # counted here only, not in requests_total: the planner reads that rate as load, and a flood of
            # unauthenticated requests must not buy GPUs
            request.app[ROUTER_KEY].metrics.auth_failures.labels(reason).inc()
            raise errors.Unauthorized(
                "No API key: send one as 'Authorization: Bearer <key>'." if reason == m.AUTH_MISSING
                else "The API key is not valid.")
    return await handler(request)


def _too_large(request: web.Request) -> errors.PayloadTooLarge:
    limit = request.app[ROUTER_KEY].config.spec.max_body_bytes
    return errors.PayloadTooLarge(f"The request body is larger than the router accepts ({limit} bytes).")


def _http(e: web.HTTPException) -> errors.RouterError:
    err = errors.RouterError(e.reason)
    err.status = e.status
    err.type = "invalid_request_error" if e.status < 500 else "internal_error"
    return err


async def _parse(request: web.Request, model) -> tuple[object, dict]:
    spec = request.app[ROUTER_KEY].config.spec
    if request.content_length is not None and request.content_length > spec.max_body_bytes:
        raise _too_large(request)          # refused before a byte of it is read
    try:
        if request.content.is_eof():       # the whole body came with the headers (most requests): no timer
            raw = await request.read()
        else:
            # bounded: a client dripping its body holds an admission slot only this long (a timer, no task)
            async with asyncio.timeout(spec.body_timeout_seconds):
                raw = await request.read()
    except TimeoutError:
        raise errors.BodyTimeout(f"The request body did not arrive within {spec.body_timeout_seconds:g} s.") \
            from None
    except web.RequestPayloadError:        # a body aiohttp cannot decode
        raise errors.BadRequest("The request body could not be read: malformed chunked transfer encoding or "
                                "a Content-Encoding the body does not have.") from None
    return parse_body(raw, model)


class _EventStream(web.StreamResponse):
    """An SSE response whose headers leave with its first chunk, in one write: aiohttp sends a
    StreamResponse's headers at ``prepare`` (a ``Response``'s with its body), which cost every stream a
    segment of its own, a write and a client wake-up before the first token (strace, one stream). The
    router prepares only once the worker's first token is in hand, so nothing waits for it."""
    _send_headers_immediately = False      # aiohttp's own switch (web.Response sets it; aiohttp pinned)


# the client's unsent bytes above which the relay waits for them to drain (the transport's own high-water
# mark, uvloop and asyncio: 64 KiB), as StreamResponse.write does
WRITE_BUFFER_LIMIT = 0x10000


class _ClientSink:
    """The stream's chunks to the client (a :class:`~.relay.Sink`). The first through aiohttp (the
    headers leave with it); the rest framed here and written to the transport in the relay's own call:
    ``StreamResponse.write`` is four Python calls and two awaits per chunk (~5% of the router's samples at
    1,000 streams, py-spy). A client gone away is an error here as it is in aiohttp's writer, so the relay
    stops and the worker's request is closed."""
    __slots__ = ("_request", "_resp", "_transport", "_chunked", "_pending", "_started")

    def __init__(self, request: web.Request, resp: web.StreamResponse) -> None:
        self._request, self._resp, self._transport = request, resp, request.transport
        self._chunked = resp.headers.get("Transfer-Encoding") == "chunked"   # HTTP/1.0 clients get no framing
        self._pending: bytes | None = None      # a write for aiohttp to make, at the next drain
        self._started = False

    def write(self, data: bytes) -> bool:
        if not (self._started and self._chunked):
            self._started = True
            self._pending = data
            return True
        transport = self._transport
        if transport is None or transport.is_closing():
            # as aiohttp's writer: asyncio's transport drops writes after a close without a word (uvloop's
            # raises a RuntimeError a write later)
            raise ConnectionResetError("the client closed the connection")
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return transport.get_write_buffer_size() > WRITE_BUFFER_LIMIT   # a slow client: wait for it

    async def drain(self) -> None:
        if self._pending is not None:
            data, self._pending = self._pending, None
            await self._resp.write(data)
        else:
            await self._request.writer.drain()


async def _serve(request: web.Request, endpoint: str, model) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    # the client's clock starts here: its TTFT includes the router's own queue
    arrival = time.monotonic()
    if router.tracing is not None:
        return await _traced(request, endpoint, model, router, arrival)
    # admitted before the body is even read: under overload a 429 is the cheapest answer
    await router.admission.enter()
    try:
        return await _answer(request, endpoint, model, router, arrival, None)
    finally:
        router.admission.leave()


async def _traced(request: web.Request, endpoint: str, model, router: Router, arrival: float) -> web.StreamResponse:
    """:func:`_serve` with the request's trace (tracing.py): its root span from arrival to the last byte,
    the admission wait its first child; an error answered here carries the trace id too."""
    trace = router.tracing.start(REQUEST, request.headers, arrival, {A_ENDPOINT: endpoint})
    try:
        queued = trace.span(ADMISSION, start=arrival)
        try:
            await router.admission.enter()
        except BaseException as e:
            mark_failed(queued, e)
            raise
        finally:
            queued.end()
        try:
            resp = await _answer(request, endpoint, model, router, arrival, trace)
        finally:
            router.admission.leave()
        if trace.recording:
            trace.root.set_attribute(A_STATUS, resp.status)
        return resp
    except errors.RouterError as e:
        mark_failed(trace.root, e)
        if trace.recording:
            trace.root.set_attribute(A_STATUS, e.status)
        resp = _error(e)
        resp.headers.update(trace.response_headers())
        return resp
    except BaseException as e:
        mark_failed(trace.root, e)
        raise
    finally:
        trace.finish()


async def _answer(request: web.Request, endpoint: str, model, router: Router, arrival: float,
                  trace) -> web.StreamResponse:
    """An admitted request's answer: its body read, the router's JSON or stream to the client."""
    req, body = await _parse(request, model)
    result, route = await router.handle(endpoint, req, body, arrival, trace)
    if trace is not None and trace.recording:
        trace.root.set_attribute(A_PATH, route.path)
        if isinstance(result, dict):     # a stream's outcome is its relay's to set
            trace.root.set_attribute(A_OUTCOME, m.OUTCOME_SUCCESS)
    if isinstance(result, dict):
        return web.json_response(result, headers=route.headers())
    resp = _EventStream(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                 **route.headers()})
    try:
        await resp.prepare(request)
        await result.send(_ClientSink(request, resp))
    except ConnectionError:
        # the client went away mid-stream (the relay counted it): nobody to answer, and no bug
        return resp
    finally:
        result.close()               # a stream never sent gives its worker connection back
    await resp.write_eof()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "/v1/completions", CompletionRequest)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "/v1/chat/completions", ChatCompletionRequest)


async def models(request: web.Request) -> web.Response:
    """The base model and every adapter a request can be served with now (loaded on a healthy decode)."""
    router = request.app[ROUTER_KEY]
    cfg, now = router.config, int(time.time())
    return web.json_response({"object": "list", "data": [
        {"id": cfg.model, "object": "model", "created": now, "owned_by": "disagg"},
        *({"id": a, "object": "model", "created": now, "owned_by": "disagg", "parent": cfg.model}
          for a in router.ready_adapters())]})


async def metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    if router.tracing is not None:
        # OpenMetrics to a scraper that asks for it (Prometheus does): the TTFT histogram's exemplars carry
        # trace ids, which Prometheus' text format cannot
        encode, content_type = choose_encoder(request.headers.get("Accept"))
        return web.Response(body=encode(router.metrics.registry), headers={"Content-Type": content_type})
    return web.Response(body=generate_latest(router.metrics.registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def health(request: web.Request) -> web.Response:
    """Readiness: 200 when the router can serve (a healthy decode worker), else 503."""
    router = request.app[ROUTER_KEY]
    ready = bool(router.pool.healthy("decode"))
    return web.json_response({"ready": ready}, status=200 if ready else 503)


async def livez(request: web.Request) -> web.Response:
    """Liveness: 200 while the event loop answers, whatever the workers do. A decode outage must take
    routers out of the Service (readiness), never restart them and wipe their prefix index."""
    return web.json_response({"alive": True})


async def _metrics_site(router: Router, config: RouterConfig) -> web.AppRunner:
    """/metrics and /livez of this process alone, on its own port (never SO_REUSEPORT): with several
    processes on the serving port, a scrape there reaches one of them (router/processes.py)."""
    app = web.Application()
    app[ROUTER_KEY] = router
    app.router.add_get("/metrics", metrics)
    app.router.add_get(ROUTER_LIVE_PATH, livez)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.metrics_port).start()
    return runner


def make_app(config: RouterConfig, tokenizer=None, router: Router | None = None,
             discovery=None, picker_port: int | None = None, reuse_port: bool = False) -> web.Application:
    """The router's HTTP app (the OpenAI API, probes, metrics); with ``picker_port``, also the endpoint
    picker (:mod:`.extproc`: Envoy's ext_proc over gRPC) on that port, in the same event loop, over the
    same workers, decision and admission."""
    if router is None:
        from .tokenizer import Tokenizer

        router = Router(config, tokenizer or Tokenizer(config.tokenizer), RouterMetrics(), discovery=discovery)
    keys = ApiKeys(config.api_keys_file, router.metrics) if config.api_keys_file else None
    # no auth layer at all without keys: nothing added to the request path
    app = web.Application(middlewares=[error_middleware, *([auth_middleware] if keys else [])],
                          client_max_size=config.spec.max_body_bytes)
    app[ROUTER_KEY] = router
    if keys is not None:
        app[KEYS_KEY] = keys
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    if config.metrics_port is None:
        # only where there is no metrics port (local runs): in a cluster the serving port, which faces
        # clients, serves the API and the probes alone, and Prometheus scrapes each process's metrics port
        app.router.add_get("/metrics", metrics)
    app.router.add_get(ROUTER_READY_PATH, health)
    app.router.add_get(ROUTER_LIVE_PATH, livez)

    async def lifecycle(app: web.Application):
        await router.start()
        reload = asyncio.create_task(keys.watch()) if keys is not None else None
        scrape = await _metrics_site(router, config) if config.metrics_port is not None else None
        picker = None
        if picker_port is not None:
            from .extproc import serve
            from .picker import Picker

            picker = await serve(Picker(router, keys), config.host, picker_port, reuse_port)
        yield
        if picker is not None:
            picker.health_task.cancel()
            await picker.stop(grace=None)
        if reload is not None:
            reload.cancel()
        if scrape is not None:
            await scrape.cleanup()
        await router.close()

    app.cleanup_ctx.append(lifecycle)
    return app
