"""The router's logic: workers picked (:mod:`.decision`) of those live (:mod:`.fleet`), run prefill then
decode (:mod:`.calls`), account for it all (:mod:`.accounting`).

Routes (:mod:`.app`) hand it validated requests; it returns a JSON body or a
:class:`Stream` of SSE bytes, and raises :mod:`.errors` types for everything a
client should see as an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial

from disagg.api import metrics as m
from disagg.api.names import ROLE_DECODE, ROLE_PREFILL

from . import migration, pairing, upstream
from .accounting import Accounting, account
from .admission import Admission
from .calls import Calls, TooLarge, WorkerError
from .config import RouterConfig
from .decision import Decider, Plan, Route
from .errors import (BadRequest, NoWorkers, NotFound, RouterError, UpstreamFailed, UpstreamRejected, UpstreamTimeout,
                     sse)
from .fleet import Fleet, PrefillLost
from .index import PrefixIndex
from .pool import Pool, Worker
from .protocol import ChatCompletionRequest, CompletionRequest
from .relay import EndedBeforeOutput, Sink, StreamEnd, Watchdog, emit, finish, first_token, relay

log = logging.getLogger("disagg.router")
TOKENIZE_INLINE_CHARS = 16384
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


def _fallback_reason(err: Exception) -> str:
    """Why a decode that failed before output is retried without the prefill's KV (ROUTER_FALLBACKS)."""
    return m.FALLBACK_PREFILL_LOST if isinstance(err, PrefillLost) else m.FALLBACK_KV_TRANSFER


class Router:
    def __init__(self, config: RouterConfig, tokenizer, metrics, pool: Pool | None = None, discovery=None):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.pool = pool or Pool.static(config)
        self.index = {ROLE_PREFILL: PrefixIndex(), ROLE_DECODE: PrefixIndex()}
        self.decider = Decider(config, self.pool, self.index, metrics)
        self.policy = self.decider.policy
        self.needs_ids = self.decider.needs_ids
        self.calls = Calls(config, metrics)
        self.fleet = Fleet(config, metrics, self.pool, self.index, self.calls, self.decider.forget, discovery)
        spec = config.spec
        self.admission = Admission(spec.max_in_flight, spec.max_queued, spec.queue_timeout_seconds, metrics)
        self.accounting = Accounting(metrics, self.needs_ids)
        self.watchdog = Watchdog(spec.first_token_timeout_seconds, spec.idle_timeout_seconds)
        self._watchdog_task: asyncio.Task | None = None

    @property
    def max_model_len(self) -> int | None:
        """The context refused beyond: configured (the engine args), else learned from a worker."""
        return self.fleet.max_model_len

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self.calls.start()
        self.fleet.start()
        self._watchdog_task = asyncio.create_task(self.watchdog.run())

    def update_workers(self, role: str, endpoints) -> None:
        self.fleet.update_workers(role, endpoints)

    async def close(self) -> None:
        if self._watchdog_task:
            self._watchdog_task.cancel()
        await self.fleet.close()
        await self.calls.close()

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
            await asyncio.gather(*(self.fleet.probe(w, 1) for w in self.pool.all() if not w.healthy))
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
            self.accounting.labelled(self.metrics.requests, m.OUTCOME_UPSTREAM_REJECTED, route.path).inc()
            raise

    async def _prefill(self, endpoint: str, plan: Plan, body: dict, route: Route) -> dict | None:
        if plan.prefill is None:
            return None
        pbody = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
        pbody.update(max_tokens=1, stream=False, kv_transfer_params=REMOTE_DECODE)
        w = plan.prefill
        account(w, +1)
        try:
            data = await self.calls.post(w, endpoint, pbody, timeout=self.config.spec.prefill_timeout_seconds)
            params = data.get("kv_transfer_params")
            if not params:
                raise WorkerError(f"prefill worker {w.name} returned no kv_transfer_params")
            route.path = m.PATH_REMOTE_PREFILL
            return params
        except TimeoutError:
            reason = m.FALLBACK_PREFILL_TIMEOUT
            log.warning("prefill on %s timed out; decode prefills locally", w.name)
        except WorkerError as e:
            reason = m.FALLBACK_PREFILL_ERROR
            log.warning("prefill on %s failed (%s); decode prefills locally", w.name, e)
        finally:
            account(w, -1)
        self.metrics.fallbacks.labels(reason).inc()
        route.path, route.fallback = m.PATH_FALLBACK, reason
        return None

    async def _unary(self, endpoint, plan, body, route: Route, arrival, ids) -> dict:
        tried: list[str] = []
        w = plan.decode
        while True:
            cur = w
            account(cur, +1)
            try:
                data = await self.fleet.unless_prefill_lost(
                    self.calls.post(cur, endpoint, body, timeout=self.config.spec.request_timeout_seconds),
                    plan.prefill if "kv_transfer_params" in body else None)
                break
            except TimeoutError:
                # the worker is slow, not gone: another one would be as slow, and the client has waited enough
                self.metrics.timeouts.labels(m.TIMEOUT_REQUEST).inc()
                self.metrics.requests.labels(m.OUTCOME_TIMEOUT, route.path).inc()
                raise UpstreamTimeout(f"the decode worker {cur.name} did not answer within the request "
                                      f"timeout ({self.config.spec.request_timeout_seconds:g} s)") from None
            except TooLarge as e:
                # the answer exists, and another worker would write the same: no retry
                self.metrics.requests.labels(m.OUTCOME_UPSTREAM_ERROR, route.path).inc()
                raise UpstreamFailed(str(e)) from None
            except WorkerError as e:
                w = self._next_decode(cur, e, ids, tried, route)
                body = self._without_remote_kv(body, route, _fallback_reason(e))
            finally:
                account(cur, -1)
        data.pop("kv_transfer_params", None)
        path = route.path
        # no TTFT here: the first token came and went inside the upstream's answer, and the whole duration
        # is no first-token time (the planner reads vLLM's own TTFT when no stream shows one)
        self.accounting.labelled(self.metrics.e2e, path).observe(time.monotonic() - arrival)
        usage = data.get("usage") or {}
        self.metrics.output_tokens.observe(usage.get("completion_tokens", 0))
        self.accounting.count_prompt(usage)
        self.accounting.labelled(self.metrics.requests, m.OUTCOME_SUCCESS, path).inc()
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

    def _without_remote_kv(self, body: dict, route: Route, reason: str = m.FALLBACK_KV_TRANSFER) -> dict:
        """The retry after a decode failure prefills locally: the failure may be the KV pull itself
        (the prefill worker died or dropped the blocks), and asking again for the same blocks would
        fail again or wait out NIXL's timeout."""
        if "kv_transfer_params" not in body:
            return body
        self.metrics.fallbacks.labels(reason).inc()
        route.path, route.fallback = m.PATH_FALLBACK, reason
        return {k: v for k, v in body.items() if k != "kv_transfer_params"}

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
            account(w, +1)
            try:
                resp = await self.calls.open_stream(w, endpoint, body)
                try:
                    # up to the first token before the client sees anything: a stream that ends empty
                    # is a failure before output, served by another worker
                    head, head_error = await self.fleet.unless_prefill_lost(
                        first_token(resp, w.name), plan.prefill if "kv_transfer_params" in body else None)
                except BaseException:
                    resp.close()
                    raise
                break
            except (WorkerError, EndedBeforeOutput) as e:
                account(w, -1)
                w = self._next_decode(w, e, ids, tried, route)
                body = self._without_remote_kv(body, route, _fallback_reason(e))
            except BaseException:
                account(w, -1)
                raise
        def abandon() -> None:
            resp.close()
            account(w, -1)

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
                                observe_ttft=self.accounting.labelled(self.metrics.ttft, path).observe,
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
                    account(w, -1)
                    if end.idle_timeout:
                        self.metrics.timeouts.labels(
                            m.TIMEOUT_IDLE if end.first_token_at is not None else m.TIMEOUT_FIRST_TOKEN).inc()
                if end.outcome == m.OUTCOME_SUCCESS:
                    outcome, output_tokens = m.OUTCOME_SUCCESS, end.output_tokens
                    self.accounting.count_prompt(end.usage)
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
                except (WorkerError, RouterError) as e:
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
            self.accounting.labelled(self.metrics.requests, outcome, path).inc()
            if outcome == m.OUTCOME_SUCCESS:
                self.accounting.labelled(self.metrics.e2e, path).observe(time.monotonic() - arrival)
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
            account(w, +1)
            try:
                resp = await self.calls.open_stream(w, migration.COMPLETIONS, dict(body, kv_transfer_params=kv)
                                                    if kv else body)
                try:
                    # as a first open: a decode waiting for KV from a prefill worker that stopped answering
                    # is given up once the probes find that worker unhealthy, not at the first-token timeout
                    head, head_error = await self.fleet.unless_prefill_lost(first_token(resp, w.name),
                                                                            plan.prefill if kv else None)
                except BaseException:
                    resp.close()
                    raise
                return resp, w, head, head_error
            except (WorkerError, EndedBeforeOutput, UpstreamRejected) as e:
                account(w, -1)
                tried.append(w.name)
                err = e
                if kv and not isinstance(e, UpstreamRejected):
                    self.metrics.fallbacks.labels(_fallback_reason(e)).inc()
                    local = True
                    excludes.insert(0, exclude)     # the same choice again, without the prefill's KV
            except BaseException:
                account(w, -1)
                raise
        try:
            pairing.choose(self.pool, set(tried), revision)
        except NoWorkers as gone:       # what ended it: its revision has no decode left untried (a rollout's end)
            raise WorkerError(f"{gone}; last attempt: {err}") from None
        raise WorkerError(str(err))


def raw_text(req: CompletionRequest | ChatCompletionRequest) -> str | list:
    if isinstance(req, ChatCompletionRequest):
        return "".join(m.text() for m in req.messages)
    return req.prompt
