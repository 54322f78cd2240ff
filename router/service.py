"""The router's logic: workers picked (:mod:`.decision`), run prefill then decode, account for it all.

Routes (:mod:`.app`) hand it validated requests; it returns a JSON body or a
:class:`Stream` of SSE bytes, and raises :mod:`.errors` types for everything a
client should see as an error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

import aiohttp
import zmq.asyncio

from disagg.api import metrics as m
from disagg.api.names import ROLE_DECODE, ROLE_PREFILL

from . import migration, pairing, upstream
from .admission import Admission
from .config import MAX_ANSWER_BYTES, MAX_ERROR_BODY_BYTES, RouterConfig
from .decision import Decider, Plan, Route
from .errors import (BadRequest, NoWorkers, NotFound, RouterError, UpstreamFailed, UpstreamRejected, UpstreamTimeout,
                     sse)
from .events import Subscriber
from .index import PrefixIndex
from .pool import Pool, Worker
from .protocol import ChatCompletionRequest, CompletionRequest
from .relay import EndedBeforeOutput, Sink, StreamEnd, Watchdog, emit, finish, first_token, relay

log = logging.getLogger("disagg.router")
TOKENIZE_INLINE_CHARS = 16384
# /health timeouts in a row before a worker that still accepts connections counts as unhealthy: under a
# burst of thousands of streams a busy (but serving) worker or router may answer a probe late, and taking
# every worker out at once turned that into 503s for everyone (bench/router_vs_vllm_router.py, 2,000 streams)
PROBE_TIMEOUTS_TO_UNHEALTHY = 3
T = TypeVar("T")
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


class Stream:
    """A decode stream opened for a client, its first token in hand: :meth:`send` relays the rest to a
    :class:`~.relay.Sink`; :meth:`close` gives it up when it is never sent (the client's response could
    not start), so its worker connection and load are not held."""
    __slots__ = ("_run", "_abandon", "_sent")

    def __init__(self, run: Callable[[Sink], Awaitable[None]], abandon: Callable[[], None]) -> None:
        self._run, self._abandon, self._sent = run, abandon, False

    async def send(self, sink: Sink) -> None:
        self._sent = True
        await self._run(sink)

    def close(self) -> None:
        if not self._sent:
            self._sent = True
            self._abandon()


class _Upstream(Exception):
    """A worker could not be reached or failed (5xx); the router may try elsewhere."""


class _TooLarge(_Upstream):
    """A worker's answer was larger than the router reads (config.MAX_ANSWER_BYTES)."""


class _PrefillLost(_Upstream):
    """The prefill worker holding a decode's KV was found unhealthy before the decode answered (its
    stream's first token, or a non-streaming request's whole answer)."""


def _fallback_reason(err: Exception) -> str:
    """Why a decode that failed before output is retried without the prefill's KV (ROUTER_FALLBACKS)."""
    return m.FALLBACK_PREFILL_LOST if isinstance(err, _PrefillLost) else m.FALLBACK_KV_TRANSFER


class Router:
    def __init__(self, config: RouterConfig, tokenizer, metrics, pool: Pool | None = None, discovery=None):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.pool = pool or Pool.static(config)
        self.index = {ROLE_PREFILL: PrefixIndex(), ROLE_DECODE: PrefixIndex()}
        self.decider = Decider(config, self.pool, self.index, metrics)
        self.policy = self.decider.policy
        self._session: aiohttp.ClientSession | None = None
        # decode streams: the lean client (upstream.py); the rest on aiohttp's session
        self._streams: upstream.Client | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self._subscribers: dict[str, Subscriber] = {}
        self._health_task: asyncio.Task | None = None
        self._discovery = discovery
        self._discovery_task: asyncio.Task | None = None
        # the context refused beyond: configured (the engine args), else learned from a worker
        self.max_model_len: int | None = config.max_model_len
        spec = config.spec
        self.admission = Admission(spec.max_in_flight, spec.max_queued, spec.queue_timeout_seconds, metrics)
        self._probe_timeouts: dict[str, int] = {}
        # per prefill worker, set when it is found unhealthy: decodes waiting for its KV give up on it
        self._prefill_lost: dict[str, asyncio.Event] = {}
        self.watchdog = Watchdog(spec.first_token_timeout_seconds, spec.idle_timeout_seconds)
        self._watchdog_task: asyncio.Task | None = None
        self._children: dict[tuple, object] = {}
        self.needs_ids = self.decider.needs_ids

    def _labelled(self, metric, *values: str):
        """``metric.labels(*values)``, looked up once: prometheus_client's ``labels`` validates, joins and
        locks on every call (~2% of the router's samples at one stream, py-spy)."""
        child = self._children.get((metric, values))
        if child is None:
            child = self._children[metric, values] = metric.labels(*values)
        return child

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        # https:// workers: one trust context for both clients (streams, and prefill/probes on aiohttp's)
        ca = self.config.worker_ca_file
        tls = ssl.create_default_context(cafile=ca) if ca else None
        self._session = aiohttp.ClientSession(
            # keep-alive shorter than the workers' (uvicorn: 5 s), so a pooled connection is
            # not reused just as the worker closes it
            # no connection limit here: the bound on requests is the router's admission control
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=3,
                                           ssl=tls if tls is not None else True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.spec.connect_timeout_seconds))
        self._streams = upstream.Client(self.config.spec.connect_timeout_seconds, keepalive_s=3, ssl_context=tls)
        self._zmq = zmq.asyncio.Context()
        for role, idx in self.index.items():
            self._subscribers[role] = Subscriber(self._zmq, idx, self.config.kv_events_topic,
                                                 self.metrics.kv_event_batches.inc, self.config.block_size,
                                                 self.metrics.kv_resynced)
            self.metrics.indexed_blocks.labels(role).set_function(idx.blocks)
        for w in self.pool.all():
            self._watch(w)
        self._health_task = asyncio.create_task(self._check_health())
        self._watchdog_task = asyncio.create_task(self.watchdog.run())
        if self._discovery is not None:
            self._discovery_task = asyncio.create_task(self._discovery.run(self.update_workers))

    def update_workers(self, role: str, endpoints) -> None:
        """Replace a role's workers (discovery); departed workers leave the prefix index too."""
        added, removed = self.pool.set(role, endpoints)
        for w in added:
            self._watch(w)
        for w in removed:
            if role in self._subscribers:
                self._subscribers[role].unwatch(w.name)
            else:
                self.index[role].cleared(w.name)
            self._forget(w)
        if added or removed:
            log.info("%s workers: +%s -%s", role, [w.name for w in added], [w.name for w in removed])

    async def close(self) -> None:
        for task in (self._health_task, self._discovery_task, self._watchdog_task):
            if task:
                task.cancel()
        for sub in self._subscribers.values():
            await sub.close()
        if self._session:
            await self._session.close()
        if self._streams:
            self._streams.close()
        if self._zmq:
            self._zmq.term()

    def _forget(self, w: Worker) -> None:
        """Drops what the router kept for a worker that left discovery: with workers coming and going
        (rollouts, scaling, restarts under new pod IPs) it would otherwise grow for as long as the router
        runs, and /metrics would list every worker it ever knew."""
        self._probe_timeouts.pop(w.name, None)
        # a decode still waiting for this prefill's KV holds the event itself; no probe sets it any more,
        # so that decode ends at its first-token timeout, as it would have before the worker left
        self._prefill_lost.pop(w.name, None)
        try:
            self.metrics.active.remove(w.role, w.name)
        except KeyError:        # never watched
            pass
        self.decider.forget(w)
        if self._streams is not None:
            self._streams.forget(w.target)

    def _watch(self, w: Worker) -> None:
        self.metrics.active.labels(w.role, w.name).set_function(lambda: w.active)
        if w.kv_events and w.role in self._subscribers:   # subscribers exist once started
            self._subscribers[w.role].watch(w.name, w.kv_events, w.kv_replay)

    async def _probe(self, w: Worker, timeout: float = 2) -> None:
        try:
            async with self._session.get(f"{w.url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                w.healthy = r.status == 200
            self._probe_timeouts.pop(w.name, None)
        except asyncio.TimeoutError:        # slow, not refused: out only after several in a row
            n = self._probe_timeouts[w.name] = self._probe_timeouts.get(w.name, 0) + 1
            if n >= PROBE_TIMEOUTS_TO_UNHEALTHY:
                w.healthy = False
        except aiohttp.ClientError:         # refused or reset: out until /health answers
            w.healthy = False
        if not w.healthy and w.role == ROLE_PREFILL and w.name in self._prefill_lost:
            self._prefill_lost.pop(w.name).set()
        if w.healthy and self.max_model_len is None:
            await self._learn_context(w, timeout)

    async def _learn_context(self, w: Worker, timeout: float) -> None:
        """The context length vLLM derived (no --max-model-len in the engine args), from the model card
        a serving worker lists on /v1/models; until one answers, the workers refuse over-long prompts."""
        try:
            async with self._session.get(f"{w.url}/v1/models", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                raw = (await _read(r, MAX_ANSWER_BYTES))[0] if r.status == 200 else b"{}"
            cards = json.loads(raw).get("data") or []
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return
        for card in cards if isinstance(cards, list) else []:
            if not isinstance(card, dict) or card.get("id") != self.config.model:
                continue
            length = card.get("max_model_len")
            if isinstance(length, int) and length > 0:
                self.max_model_len = length
                log.info("context length %d learned from %s /v1/models", length, w.name)
                return

    async def _check_health(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(w) for w in self.pool.all()))
            for role in self.index:
                ws = self.pool.workers[role].values()
                self.metrics.workers.labels(role, "healthy").set(sum(w.healthy for w in ws))
                self.metrics.workers.labels(role, "unhealthy").set(sum(not w.healthy for w in ws))
            await asyncio.sleep(self.config.health_interval_s)

    # ---------------------------------------------------------------- routing
    def plan(self, token_ids: list[int], exclude: set[str] = frozenset(),
             revision: str | None | pairing.Unset = pairing.UNSET) -> Plan:
        return self.decider.plan(token_ids, exclude, revision)

    # ---------------------------------------------------------------- requests
    def _check_model(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.model != self.config.model:
            raise NotFound(f"The model `{req.model}` does not exist; this router serves `{self.config.model}`.",
                           param="model")

    def validate(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        self._check_model(req)
        ids = self.tokenizer.prompt_ids(req)
        limit = self.max_model_len
        if limit is None:  # not learned yet: no worker has served; the workers refuse over-long prompts
            return ids
        if len(ids) >= limit:
            raise BadRequest(f"The prompt has {len(ids)} tokens; this model's context is {limit} tokens.",
                             param="messages" if isinstance(req, ChatCompletionRequest) else "prompt")
        if req.output_limit is not None and len(ids) + req.output_limit > limit:
            raise BadRequest(f"max_tokens ({req.output_limit}) plus the prompt's {len(ids)} tokens exceed "
                             f"this model's context of {limit} tokens.", param="max_tokens")
        return ids

    async def handle(self, endpoint: str, req: CompletionRequest | ChatCompletionRequest,
                     body: dict, arrival: float | None = None) -> tuple[dict | Stream, Route]:
        """Non-streaming: the final JSON. Streaming: a :class:`Stream` of SSE bytes. Either with the
        route the request took (settled before the first byte). ``arrival`` (time.monotonic()): when the
        request reached the router, before its admission wait; its TTFT and duration count from there,
        as its client sees them (default: now). The worker timeouts count from now."""
        start = time.monotonic()
        arrival = start if arrival is None else arrival
        ids: list[int] = []      # unknown without tokenizing: no prefix keys, no prompt tokens counted
        try:
            if self.needs_ids:
                # long prompts tokenize off the event loop, so they do not stall every other stream
                big = len(raw_text(req)) > TOKENIZE_INLINE_CHARS
                ids = await asyncio.to_thread(self.validate, req) if big else self.validate(req)
            else:
                self._check_model(req)
        except RouterError:
            self.metrics.requests.labels(m.OUTCOME_CLIENT_ERROR, "none").inc()
            raise
        if self.needs_ids:
            self.metrics.input_tokens.observe(len(ids))
        try:
            plan = self.plan(ids)
        except NoWorkers:
            # none looked healthy at the last check: ask the unhealthy ones again, once, before a 503
            await asyncio.gather(*(self._probe(w, 1) for w in self.pool.all() if not w.healthy))
            try:
                plan = self.plan(ids)
            except NoWorkers:
                self.metrics.requests.labels(m.OUTCOME_NO_WORKERS, "none").inc()
                raise
        route = Route(m.PATH_LOCAL_PREFILL, plan.decode.name, plan.prefill.name if plan.prefill else None,
                      revision=plan.decode.revision)
        try:
            kv_params = await self._prefill(endpoint, plan, body, route)
            if self.needs_ids:
                self.metrics.prompt_tokens.inc(plan.prompt_tokens)
                self.metrics.cached_prompt_tokens.inc(plan.cached_tokens)
            decode_body = dict(body)
            if kv_params is not None:
                decode_body["kv_transfer_params"] = kv_params
            if req.stream:
                # without ids, a migration's continuation tokenizes the prompt when the worker did not send it
                return await self._stream(endpoint, plan, decode_body, route, start, ids,
                                          None if self.needs_ids else partial(self.tokenizer.prompt_ids, req),
                                          arrival), route
            return await self._unary(endpoint, plan, decode_body, route, arrival, ids), route
        except UpstreamRejected:
            # a worker's 4xx: how an over-long prompt is refused where the router does not tokenize. The
            # client's mistake as a worker judged it, apart from the router's own client_error
            self._labelled(self.metrics.requests, m.OUTCOME_UPSTREAM_REJECTED, route.path).inc()
            raise

    async def _prefill(self, endpoint: str, plan: Plan, body: dict, route: Route) -> dict | None:
        if plan.prefill is None:
            return None
        pbody = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
        pbody.update(max_tokens=1, stream=False, kv_transfer_params=REMOTE_DECODE)
        w = plan.prefill
        self._account(w, +1)
        try:
            data = await self._post(w, endpoint, pbody, timeout=self.config.spec.prefill_timeout_seconds)
            params = data.get("kv_transfer_params")
            if not params:
                raise _Upstream(f"prefill worker {w.name} returned no kv_transfer_params")
            route.path = m.PATH_REMOTE_PREFILL
            return params
        except TimeoutError:
            reason = m.FALLBACK_PREFILL_TIMEOUT
            log.warning("prefill on %s timed out; decode prefills locally", w.name)
        except _Upstream as e:
            reason = m.FALLBACK_PREFILL_ERROR
            log.warning("prefill on %s failed (%s); decode prefills locally", w.name, e)
        finally:
            self._account(w, -1)
        self.metrics.fallbacks.labels(reason).inc()
        route.path, route.fallback = m.PATH_FALLBACK, reason
        return None

    async def _post(self, w: Worker, endpoint: str, body: dict, timeout: float | None) -> dict:
        try:
            async with self._session.post(f"{w.url}{endpoint}", json=body, timeout=aiohttp.ClientTimeout(
                    total=timeout, sock_connect=self.config.spec.connect_timeout_seconds)) as r:
                if 400 <= r.status < 500:
                    raise await _rejected(r)
                if r.status != 200:
                    text = (await _read(r, MAX_ERROR_BODY_BYTES))[0]
                    raise _Upstream(f"HTTP {r.status}: {text[:200].decode(errors='replace')}")
                # a declared length over the bound is refused before a byte of it is read
                more = r.content_length is not None and r.content_length > MAX_ANSWER_BYTES
                if not more:
                    raw, more = await _read(r, MAX_ANSWER_BYTES)
                if more:
                    r.close()
                    raise _TooLarge(f"the worker {w.name} answered more than the router accepts "
                                    f"({MAX_ANSWER_BYTES} bytes)")
        except aiohttp.ClientError as e:
            if isinstance(e, aiohttp.ConnectionTimeoutError):  # connect timed out: another worker may answer
                self.metrics.timeouts.labels(m.TIMEOUT_CONNECT).inc()
                raise _Upstream(f"connecting timed out ({self.config.spec.connect_timeout_seconds:g} s)") from e
            if isinstance(e, TimeoutError):
                raise TimeoutError(str(e)) from e
            if isinstance(e, aiohttp.ClientConnectorError):   # nothing listens there: out until /health says so
                w.healthy = False
            raise _Upstream(str(e) or type(e).__name__) from e
        except TimeoutError as e:          # the total timeout (aiohttp raises asyncio's own)
            raise TimeoutError(str(e)) from e
        try:
            data = json.loads(raw)
        except ValueError as e:            # UnicodeDecodeError among them
            raise _Upstream(f"the worker {w.name} answered with invalid JSON: {e}") from None
        if not isinstance(data, dict):
            raise _Upstream(f"the worker {w.name} answered with JSON that is not an object")
        return data

    def _count_prompt(self, usage: dict | None) -> None:
        """Prompt-token metrics from the worker's usage where the router did not tokenize (it counts its
        own before routing otherwise): the worker's cached count stands in for the router's index's."""
        prompt_tokens = (usage or {}).get("prompt_tokens")
        if self.needs_ids or prompt_tokens is None:
            return
        self.metrics.input_tokens.observe(prompt_tokens)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.cached_prompt_tokens.inc((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def _account(self, w: Worker, delta: int) -> None:
        w.active += delta     # the gauge reads it at scrape time (_watch)

    async def _unary(self, endpoint, plan, body, route: Route, arrival, ids) -> dict:
        tried: list[str] = []
        w = plan.decode
        while True:
            cur = w
            self._account(cur, +1)
            try:
                data = await self._unless_prefill_lost(
                    self._post(cur, endpoint, body, timeout=self.config.spec.request_timeout_seconds),
                    plan.prefill if "kv_transfer_params" in body else None)
                break
            except TimeoutError:
                # the worker is slow, not gone: another one would be as slow, and the client has waited enough
                self.metrics.timeouts.labels(m.TIMEOUT_REQUEST).inc()
                self.metrics.requests.labels(m.OUTCOME_TIMEOUT, route.path).inc()
                raise UpstreamTimeout(f"the decode worker {cur.name} did not answer within the request "
                                      f"timeout ({self.config.spec.request_timeout_seconds:g} s)") from None
            except _TooLarge as e:
                # the answer exists, and another worker would write the same: no retry
                self.metrics.requests.labels(m.OUTCOME_UPSTREAM_ERROR, route.path).inc()
                raise UpstreamFailed(str(e)) from None
            except _Upstream as e:
                w = self._next_decode(cur, e, ids, tried, route)
                body = self._without_remote_kv(body, route, _fallback_reason(e))
            finally:
                self._account(cur, -1)
        data.pop("kv_transfer_params", None)
        path = route.path
        # no TTFT here: the first token came and went inside the upstream's answer, and the whole duration
        # is no first-token time (the planner reads vLLM's own TTFT when no stream shows one)
        self._labelled(self.metrics.e2e, path).observe(time.monotonic() - arrival)
        usage = data.get("usage") or {}
        self.metrics.output_tokens.observe(usage.get("completion_tokens", 0))
        self._count_prompt(usage)
        self._labelled(self.metrics.requests, m.OUTCOME_SUCCESS, path).inc()
        return data

    def _next_decode(self, failed: Worker, err: Exception, ids: list[int], tried: list[str], route: Route) -> Worker:
        """Another decode worker after one failed before any output, or a clean error. A worker that
        refused connections is marked unhealthy; one that still looks healthy (say, a pooled
        connection closed under us) may be tried again when there is no other."""
        tried.append(failed.name)
        log.warning("decode on %s failed before any output: %s", failed.name, err)
        nxt = None
        if len(tried) < self.config.decode_attempts:
            nxt = self.decider.another_decode(failed, ids, tried)
        if nxt is None:
            self.metrics.requests.labels(m.OUTCOME_UPSTREAM_ERROR, route.path).inc()
            raise UpstreamFailed(f"the decode worker failed: {err}")
        self.metrics.fallbacks.labels(m.FALLBACK_DECODE_RETRY).inc()
        route.decode, route.revision = nxt.name, nxt.revision
        return nxt

    async def _unless_prefill_lost(self, work: Awaitable[T], kv_from: Worker | None) -> T:
        """``work`` (a decode request: its answer, or its stream's first token); for a decode that has to
        pull its KV from ``kv_from`` first, given up (:class:`_PrefillLost`) once that prefill worker is
        found unhealthy (refused, or its probes timing out): ``work`` is cancelled, which closes the
        connection, and vLLM aborts a request whose client went away. vLLM fails a pull from a dead engine
        by itself (kv_load_failure_policy "fail"), but a pull from one that is alive and not answering
        (hung, or its node unreachable) waits, streamed or not."""
        if kv_from is None:
            return await work
        lost = self._prefill_lost.setdefault(kv_from.name, asyncio.Event())
        task, gone = asyncio.ensure_future(work), asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        await asyncio.wait((task,))        # its connection closed before the request is tried elsewhere
        raise _PrefillLost(f"the prefill worker {kv_from.name} failed while the decode waited for its KV")

    def _without_remote_kv(self, body: dict, route: Route, reason: str = m.FALLBACK_KV_TRANSFER) -> dict:
        """The retry after a decode failure prefills locally: the failure may be the KV pull itself
        (the prefill worker died or dropped the blocks), and asking again for the same blocks would
        fail again or wait out NIXL's timeout."""
        if "kv_transfer_params" not in body:
            return body
        self.metrics.fallbacks.labels(reason).inc()
        route.path, route.fallback = m.PATH_FALLBACK, reason
        return {k: v for k, v in body.items() if k != "kv_transfer_params"}

    async def _open_stream(self, w: Worker, endpoint: str, body: dict) -> upstream.Connection:
        """The worker's streamed response, its head read; the first-token timeout runs from here until
        :func:`~.relay.first_token` has a token."""
        spec = self.config.spec
        try:
            r = await self._streams.post(w.target, endpoint, upstream.dumps(body), spec.first_token_timeout_seconds)
        except upstream.UpstreamError as e:
            if isinstance(e, upstream.ConnectTimeout):
                self.metrics.timeouts.labels(m.TIMEOUT_CONNECT).inc()
            elif isinstance(e, upstream.ReadTimeout):      # no answer headers within the first-token timeout
                self.metrics.timeouts.labels(m.TIMEOUT_FIRST_TOKEN).inc()
            elif isinstance(e, upstream.ConnectFailed):    # nothing listens there: out until /health says so
                w.healthy = False
            raise _Upstream(str(e) or type(e).__name__) from e
        status = r.status        # before release(), which clears it when the connection is pooled
        if status == 200:
            return r
        try:
            text = await r.body(MAX_ERROR_BODY_BYTES)
        except upstream.UpstreamError as e:
            raise _Upstream(f"HTTP {status}, then {e}") from e
        finally:
            r.release()
        if 400 <= status < 500:
            raise _rejected_body(status, text)
        raise _Upstream(f"HTTP {status}: {text[:200].decode(errors='replace')}")

    async def _stream(self, endpoint, plan, body, route: Route, start, ids,
                      lazy_ids: Callable[[], list[int]] | None = None, arrival: float | None = None) -> Stream:
        """Opens the decode stream (another worker if one fails before output), then relays events."""
        opts = body.get("stream_options") or {}
        client_wants_usage = bool(opts.get("include_usage"))
        tokens, unsupported = None, None
        if self.config.spec.max_migrations:
            unsupported = migration.unsupported(endpoint, body)
            if unsupported is None:     # ids from the worker, for a continuation elsewhere (migration.py)
                tokens = migration.TokenLog(endpoint, body, lazy_ids or ids, self.tokenizer.decode)
        body = dict(body, stream_options={**opts, "include_usage": True},
                    **({"return_token_ids": True} if tokens else {}))
        tried: list[str] = []
        w = plan.decode
        while True:
            self._account(w, +1)
            try:
                resp = await self._open_stream(w, endpoint, body)
                try:
                    # up to the first token before the client sees anything: a stream that ends empty
                    # is a failure before output, served by another worker
                    head, head_error = await self._unless_prefill_lost(
                        first_token(resp, w.name), plan.prefill if "kv_transfer_params" in body else None)
                except BaseException:
                    resp.close()
                    raise
                break
            except (_Upstream, EndedBeforeOutput) as e:
                self._account(w, -1)
                w = self._next_decode(w, e, ids, tried, route)
                body = self._without_remote_kv(body, route, _fallback_reason(e))
            except BaseException:
                self._account(w, -1)
                raise
        def abandon() -> None:
            resp.close()
            self._account(w, -1)

        return Stream(lambda sink: self._relay(sink, resp, w, route.path, start, client_wants_usage, head,
                                               head_error, tokens, unsupported,
                                               start if arrival is None else arrival), abandon)

    async def _relay(self, sink: Sink, resp: upstream.Connection, w: Worker, path: str, start: float,
                     client_wants_usage: bool, head: bytes = b"", head_error: BaseException | None = None,
                     tokens: migration.TokenLog | None = None, unsupported: str | None = None,
                     arrival: float | None = None) -> None:
        """The stream relay (:mod:`.relay`) and the request's accounting once it ends, however it ends.
        A stream that fails is continued on another decode worker (:mod:`.migration`), up to
        spec.router.maxMigrations times; the client sees one stream. ``start`` times the first token
        for the watchdog; TTFT and duration count from ``arrival`` (default ``start``)."""
        spec = self.config.spec
        arrival = start if arrival is None else arrival
        outcome, migrations, last, output_tokens = m.OUTCOME_UPSTREAM_ERROR, 0, None, 0
        tried: list[str] = []
        finishing = None         # a stream that sent [DONE] and whose worker's body has yet to end
        try:
            while True:
                end = StreamEnd(last_activity=start if last is None else time.monotonic(), resp=resp)
                self.watchdog.streams.add(end)
                try:
                    await relay(resp, w.name, end, sink, start=arrival, client_wants_usage=client_wants_usage,
                                observe_ttft=self._labelled(self.metrics.ttft, path).observe,
                                observe_itl=self.metrics.itl.observe,
                                first_token_timeout_s=spec.first_token_timeout_seconds,
                                idle_timeout_s=spec.idle_timeout_seconds, head=head,
                                head_error=head_error, tokens=tokens, last=last)
                finally:
                    self.watchdog.streams.discard(end)
                    if end.outcome == m.OUTCOME_SUCCESS:
                        finishing = resp     # below, once the request is accounted for
                    else:
                        resp.close()         # cut or broken: never reuse a connection with a stalled stream on it
                    self._account(w, -1)
                    if end.idle_timeout:
                        self.metrics.timeouts.labels(
                            m.TIMEOUT_IDLE if end.first_token_at is not None else m.TIMEOUT_FIRST_TOKEN).inc()
                if end.outcome == m.OUTCOME_SUCCESS:
                    outcome, output_tokens = m.OUTCOME_SUCCESS, end.output_tokens
                    self._count_prompt(end.usage)
                    break
                last = end.last_token_at or last
                outcome = m.OUTCOME_TIMEOUT if end.idle_timeout else m.OUTCOME_UPSTREAM_ERROR
                refused = self._migration_refused(tokens, unsupported, migrations)
                if refused is None and (tokens.finished or tokens.remaining() == 0):
                    # it failed after its last token: the router ends the stream as the worker would have
                    self.metrics.migrations.labels(m.MIGRATION_NOT_NEEDED).inc()
                    await emit(sink, tokens.closing(client_wants_usage))
                    outcome, output_tokens = m.OUTCOME_SUCCESS, len(tokens.generated())
                    break
                if refused is not None:
                    if refused != m.MIGRATION_DISABLED:
                        self.metrics.migrations.labels(refused).inc()
                    await emit(sink, end.failure)
                    break
                log.warning("%s; continuing on another decode worker (%d tokens generated)",
                            end.error, len(tokens.generated()))
                tried.append(w.name)
                try:
                    resp, w, head, head_error = await self._continue(tokens, tried, w.revision)
                except (_Upstream, RouterError) as e:
                    self.metrics.migrations.labels(m.MIGRATION_FAILED).inc()
                    await emit(sink, sse(UpstreamFailed(
                        f"{end.error}; no decode worker could continue the stream: {e}")))
                    break
                migrations += 1
                self.metrics.migrations.labels(m.MIGRATION_MIGRATED).inc()
                tokens.start_continuation()
        except ConnectionError:
            # the client's writes failed: it went away (the relay's write, or an error event's); the
            # worker served
            outcome = m.OUTCOME_CLIENT_DISCONNECTED
            raise
        finally:
            self._labelled(self.metrics.requests, outcome, path).inc()
            if outcome == m.OUTCOME_SUCCESS:
                self._labelled(self.metrics.e2e, path).observe(time.monotonic() - arrival)
                self.metrics.output_tokens.observe(output_tokens)
        # after the accounting: a client that stops reading at [DONE] and asks for /metrics finds the
        # request there; the client's response ends after this, with the connection already pooled
        if finishing is not None:
            await finish(finishing)

    def _migration_refused(self, tokens: migration.TokenLog | None, unsupported: str | None,
                           migrations: int) -> str | None:
        """Why a failed stream is not continued elsewhere (a ROUTER_MIGRATIONS outcome), or None."""
        if unsupported is not None:
            return m.MIGRATION_UNSUPPORTED
        if tokens is None:
            return m.MIGRATION_DISABLED
        if not tokens.has_ids:           # a worker that sends no token ids (not vLLM, or ids hidden)
            return m.MIGRATION_UNSUPPORTED
        if migrations >= self.config.spec.max_migrations:
            return m.MIGRATION_EXHAUSTED
        return None

    async def _continue(self, tokens: migration.TokenLog, tried: list[str], revision: str | None):
        """Opens the continuation of a failed stream: planned as a new request whose prompt is the prompt's
        ids plus the generated ones (another decode worker first; the same one when there is no other,
        since a stall or an error event does not mean it is gone), of the stream's own KV revision: its
        ids are that revision's model's tokens. Returns (response, worker, head, head_error) as the first
        open does."""
        ids = tokens.prompt + tokens.generated()
        body = tokens.continuation()
        err: Exception = NoWorkers("no healthy decode workers are available")
        local = False        # a continuation whose KV pull failed is prefilled by its decode worker next
        excludes = [set(tried), set()]
        while excludes:
            exclude = excludes.pop(0)
            try:
                plan = self.plan(ids, exclude, revision)
            except NoWorkers as e:
                err = e
                continue
            w = plan.decode
            kv = None if local else await self._prefill(migration.COMPLETIONS, plan, body,
                                                        Route(m.PATH_LOCAL_PREFILL, w.name))
            self._account(w, +1)
            try:
                resp = await self._open_stream(w, migration.COMPLETIONS, dict(body, kv_transfer_params=kv)
                                               if kv else body)
                try:
                    # as a first open: a decode waiting for KV from a prefill worker that stopped answering
                    # is given up once the probes find that worker unhealthy, not at the first-token timeout
                    head, head_error = await self._unless_prefill_lost(first_token(resp, w.name),
                                                                       plan.prefill if kv else None)
                except BaseException:
                    resp.close()
                    raise
                return resp, w, head, head_error
            except (_Upstream, EndedBeforeOutput, UpstreamRejected) as e:
                self._account(w, -1)
                tried.append(w.name)
                err = e
                if kv and not isinstance(e, UpstreamRejected):
                    self.metrics.fallbacks.labels(_fallback_reason(e)).inc()
                    local = True
                    excludes.insert(0, exclude)     # the same choice again, without the prefill's KV
            except BaseException:
                self._account(w, -1)
                raise
        try:
            pairing.choose(self.pool, set(tried), revision)
        except NoWorkers as gone:       # what ended it: its revision has no decode left untried (a rollout's end)
            raise _Upstream(f"{gone}; last attempt: {err}") from None
        raise _Upstream(str(err))


def raw_text(req: CompletionRequest | ChatCompletionRequest) -> str | list:
    if isinstance(req, ChatCompletionRequest):
        return "".join(m.text() for m in req.messages)
    return req.prompt


async def _read(r: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """A worker's body, at most ``limit`` bytes of it, and whether it had more: then the rest is not read
    and the connection is closed (aiohttp would otherwise read it to the end before pooling it)."""
    parts, size = [], 0
    while size <= limit and (data := await r.content.read(limit + 1 - size)):
        parts.append(data)
        size += len(data)
    if size > limit:
        r.close()
        return b"".join(parts)[:limit], True
    return b"".join(parts), False


async def _rejected(r: aiohttp.ClientResponse) -> UpstreamRejected:
    """A worker's 4xx, passed on with its own message (a body cut at MAX_ERROR_BODY_BYTES is no JSON:
    then a message of the router's own)."""
    try:
        return _rejected_body(r.status, (await _read(r, MAX_ERROR_BODY_BYTES))[0])
    except aiohttp.ClientError:
        return _rejected_body(r.status, b"")


def _rejected_body(status: int, text: bytes) -> UpstreamRejected:
    try:
        err = json.loads(text).get("error") or {}
    except (ValueError, AttributeError):
        err = {}
    if not isinstance(err, dict):
        err = {}
    return UpstreamRejected(status, err.get("message") or f"the worker refused the request (HTTP {status})",
                            param=err.get("param"), type_=err.get("type"))
