"""The router: workers picked, prefill then decode, all accounted for; a facade over its parts.

Routes (:mod:`.app`) hand it validated requests; it returns a JSON body or a :class:`~.streaming.Stream`
of SSE bytes, and raises :mod:`.errors` types for everything a client should see as an error. The parts:
the live workers (:mod:`.fleet`), the routing decision (:mod:`.decision`), the calls to a worker
(:mod:`.calls`), the prefill→decode hand-off (:mod:`.handoff`), the streamed decode (:mod:`.streaming`)
and its continuation elsewhere (:mod:`.continuation`), the metrics (:mod:`.accounting`).
"""

from __future__ import annotations

import asyncio
import time
from functools import partial

from disagg.api import metrics as m
from disagg.api.names import ROLE_DECODE, ROLE_PREFILL

from . import pairing
from .accounting import Accounting
from .adapters import Declared
from .admission import Admission
from .calls import Calls
from .config import RouterConfig
from .continuation import Continuation
from .decision import Decider, Plan, Route
from .errors import BadRequest, NoWorkers, RouterError, UpstreamRejected
from .fleet import Fleet
from .handoff import REMOTE_DECODE, Handoff
from .index import PrefixIndex
from .pool import Pool
from .protocol import ChatCompletionRequest, CompletionRequest
from .streaming import Stream, Streaming
from .tracing import ROUTING, TOKENIZE, Trace, Tracing, failed, routing_attributes

__all__ = ["REMOTE_DECODE", "Plan", "Route", "Router", "Stream", "raw_text"]
TOKENIZE_INLINE_CHARS = 16384


class Router:
    def __init__(self, config: RouterConfig, tokenizer, metrics, pool: Pool | None = None, discovery=None):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.pool = pool or Pool.static(config)
        self.declared = Declared(config.model)
        self.declared.set(config.adapters)
        self.index = {ROLE_PREFILL: PrefixIndex(), ROLE_DECODE: PrefixIndex()}
        self.decider = Decider(config, self.pool, self.index, metrics)
        self.policy = self.decider.policy
        self.needs_ids = self.decider.needs_ids
        self.calls = Calls(config, metrics)
        self.fleet = Fleet(config, metrics, self.pool, self.index, self.calls, self.decider.forget, discovery,
                           self.declared)
        spec = config.spec
        self.admission = Admission(spec.max_in_flight, spec.max_queued, spec.queue_timeout_seconds, metrics)
        self.accounting = Accounting(metrics, self.needs_ids)
        self.handoff = Handoff(config, metrics, self.decider, self.fleet, self.calls, self.accounting)
        self.streaming = Streaming(config, tokenizer, metrics, self.fleet, self.calls, self.handoff,
                                   Continuation(config, metrics, self.decider, self.fleet, self.calls, self.handoff),
                                   self.accounting)
        self.watchdog = self.streaming.watchdog
        self._watchdog_task: asyncio.Task | None = None
        # None unless config.tracing: then each request's trace rides on its Route (tracing.py)
        self.tracing: Tracing | None = Tracing.from_config(config)

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
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)     # the last spans exported

    # ---------------------------------------------------------------- routing
    def plan(self, token_ids: list[int], exclude: set[str] = frozenset(),
             revision: str | None | pairing.Unset = pairing.UNSET, notes: dict | None = None,
             adapter: str | None = None) -> Plan:
        return self.decider.plan(token_ids, exclude, revision, notes=notes, adapter=adapter)

    # ---------------------------------------------------------------- requests
    def _check_model(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        self.declared.adapter_of(req.model)     # the base model, or a declared adapter; else a 404

    def ready_adapters(self) -> list[str]:
        """The declared adapters some healthy decode worker holds: those a request can be served with."""
        held = {a for w in self.pool.healthy(ROLE_DECODE) for a in w.adapters}
        return sorted(a for a in self.declared.paths if a in held)

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

    async def prompt_ids(self, req: CompletionRequest | ChatCompletionRequest,
                         trace: Trace | None = None) -> list[int]:
        """The request checked (model, context) and its prompt's token ids where routing uses them (else
        []: no prefix keys, no prompt tokens counted); a refusal is counted as the client's error. Proxy and
        picker alike."""
        span = trace.span(TOKENIZE) if trace is not None else None
        ids: list[int] = []
        try:
            if self.needs_ids:
                # long prompts tokenize off the event loop, so they do not stall every other stream
                big = len(raw_text(req)) > TOKENIZE_INLINE_CHARS
                ids = await asyncio.to_thread(self.validate, req) if big else self.validate(req)
            else:
                self._check_model(req)
        except RouterError as e:
            self.metrics.requests.labels(m.OUTCOME_CLIENT_ERROR, "none").inc()
            if span is not None:
                failed(span, e)
            raise
        finally:
            if span is not None:
                span.end()
        if self.needs_ids:
            self.metrics.input_tokens.observe(len(ids))
        return ids

    async def plan_or_probe(self, ids: list[int], exclude: set[str] = frozenset(),
                            trace: Trace | None = None, adapter: str | None = None) -> Plan:
        """A plan; when no worker looked healthy at the last check, the unhealthy ones are asked again, once,
        before the NoWorkers (503) that is then counted."""
        span = notes = None
        if trace is not None:
            span, notes = trace.span(ROUTING), {}
        try:
            try:
                plan = self.plan(ids, exclude, notes=notes, adapter=adapter)
            except NoWorkers:
                await asyncio.gather(*(self.fleet.probe(w, 1) for w in self.pool.all() if not w.healthy))
                try:
                    plan = self.plan(ids, exclude, notes=notes, adapter=adapter)
                except NoWorkers as e:
                    self.metrics.requests.labels(m.OUTCOME_NO_WORKERS, "none").inc()
                    if span is not None:
                        failed(span, e)
                    raise
            if span is not None and span.is_recording():
                span.set_attributes(routing_attributes(plan, notes, self.config.spec.policy))
            return plan
        finally:
            if span is not None:
                span.end()

    async def handle(self, endpoint: str, req: CompletionRequest | ChatCompletionRequest,
                     body: dict, arrival: float | None = None,
                     trace: Trace | None = None) -> tuple[dict | Stream, Route]:
        """Non-streaming: the final JSON. Streaming: a :class:`Stream` of SSE bytes. Either with the
        route the request took (settled before the first byte). ``arrival`` (time.monotonic()): when the
        request reached the router, before its admission wait; its TTFT and duration count from there,
        as its client sees them (default: now). The worker timeouts count from now. ``trace``: the
        request's (tracing on), carried on its route to every part that handles it."""
        start = time.monotonic()
        arrival = start if arrival is None else arrival
        ids = await self.prompt_ids(req, trace)
        plan = await self.plan_or_probe(ids, trace=trace, adapter=self.declared.adapter_of(req.model))
        route = Route(m.PATH_LOCAL_PREFILL, plan.decode.name, plan.prefill.name if plan.prefill else None,
                      revision=plan.decode.revision, local_reason=plan.reason if plan.prefill is None else None,
                      trace=trace, adapter=plan.adapter)
        try:
            kv_params = await self.handoff.prefill(endpoint, plan, body, route)
            if self.needs_ids:
                self.metrics.prompt_tokens.inc(plan.prompt_tokens)
                self.metrics.cached_prompt_tokens.inc(plan.cached_tokens)
            decode_body = dict(body)
            if kv_params is not None:
                decode_body["kv_transfer_params"] = kv_params
            if req.stream:
                # without ids, a migration's continuation tokenizes the prompt when the worker did not send it
                return await self.streaming.open(endpoint, plan, decode_body, route, start, ids,
                                                 None if self.needs_ids else partial(self.tokenizer.prompt_ids, req),
                                                 arrival), route
            return await self.handoff.unary(endpoint, plan, decode_body, route, arrival, ids), route
        except UpstreamRejected:
            # a worker's 4xx: how an over-long prompt is refused where the router does not tokenize. The
            # client's mistake as a worker judged it, apart from the router's own client_error
            self.accounting.labelled(self.metrics.requests, m.OUTCOME_UPSTREAM_REJECTED, route.path).inc()
            raise


def raw_text(req: CompletionRequest | ChatCompletionRequest) -> str | list:
    if isinstance(req, ChatCompletionRequest):
        return "".join(m.text() for m in req.messages)
    return req.prompt
