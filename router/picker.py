"""Picker mode: the router decides, a gateway (Envoy) carries the bytes.

The Gateway API Inference Extension's endpoint picker answers, for each request, the worker the gateway
should send it to. Here that worker is a decode, chosen by the router's own decision (:mod:`.decision`:
prefix index, load, admission, KV-revision pairing), and the prefill→decode hand-off happens before the
answer: where the plan has a prefill, the picker runs it (:meth:`.handoff.Handoff.prefill`, with
``do_remote_decode``) and returns the request body with the ``kv_transfer_params`` the decode needs to
pull the KV. The gateway then opens the decode itself and streams its answer to the client; no token
passes through Python. (llm-d puts that hand-off in a sidecar of the decode pod, which then carries the
decode's stream; here the decode's stream stays in Envoy, and only the prefill's one-token answer is read.)

What moves with the bytes and is no longer the router's: mid-stream migration (Envoy cannot continue a
stream elsewhere: a decode that fails after its first byte ends the client's stream with an error) and the
router's own TTFT/ITL histograms (the workers' own metrics cover them). What stays: admission (429),
503 with no worker, the counted fallbacks of a failed prefill, revision-safe pairing and the route
headers (``x-disagg-*``) on the client's response.

The protocol (gRPC, ext_proc) is :mod:`.extproc`'s; this module knows requests, not messages.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from disagg.api import metrics as m
from disagg.api.names import ROLE_DECODE

from . import errors
from .accounting import account
from .pool import Worker
from .body import parse_body
from .protocol import ChatCompletionRequest, CompletionRequest
from .decision import Plan
from .service import Route, Router
from .tracing import A_ENDPOINT, A_STATUS, A_WORKER, ADMISSION, DECODE, PICK, Trace
from .tracing import failed as mark_failed

# the OpenAI endpoints the picker plans; anything else (GET /v1/models, /health) goes to any ready decode
ENDPOINTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


@dataclass
class Pick:
    """Where one request goes and what it carries there. :meth:`Picker.done` gives back what it holds."""
    destination: str                  # the decode's ip:port (x-gateway-destination-endpoint)
    route: Route | None = None        # planned requests only
    plan: Plan | None = None
    endpoint: str = ""
    request: dict | None = None       # the parsed body of a planned request
    body: bytes | None = None         # the body to send instead (kv_transfer_params added); None: unchanged
    decode: Worker | None = None      # held (its load counted) until done
    admitted: bool = False
    arrival: float = field(default_factory=time.monotonic)
    status: int | None = None         # the decode's HTTP status, once its response headers passed
    trace: Trace | None = None        # tracing on: the request's (its root ends in Picker.done)
    decode_span: object = None        # tracing on: the gateway's decode, from the answer to the end

    def response_headers(self) -> dict[str, str]:
        return self.route.headers() if self.route is not None else {}

    def request_headers(self) -> dict[str, str]:
        """Headers the gateway adds to the decode's request: the traceparent (tracing on), so that the
        decode's own llm_request span joins the request's trace."""
        if self.trace is None:
            return {}
        if self.decode_span is None and self.decode is not None:
            self.decode_span = self.trace.span(DECODE, {A_WORKER: self.decode.name})
        return self.trace.headers(self.decode_span)


def destination(w: Worker) -> str:
    """``ip:port`` of a worker's base URL, as the gateway's original-destination cluster takes it."""
    t = w.target
    return f"{t.host}:{t.port}"


class Picker:
    """The endpoint picker over a :class:`~.service.Router`: its workers, decision, hand-off, admission
    and metrics, shared with the proxy that the same process may also serve."""

    def __init__(self, router: Router, keys=None) -> None:
        self.router = router
        self.keys = keys                # ApiKeys (spec.router.auth) or None
        self.metrics = router.metrics
        self._decision = router.accounting.labelled(self.metrics.picker_decision, "plan")
        self._other = router.accounting.labelled(self.metrics.picker_decision, "other")

    def authorize(self, authorization: str | None) -> None:
        if self.keys is None:
            return
        reason = self.keys.failure(authorization)
        if reason is not None:
            self.metrics.auth_failures.labels(reason).inc()
            raise errors.Unauthorized("No API key: send one as 'Authorization: Bearer <key>'."
                                      if reason == m.AUTH_MISSING else "The API key is not valid.")

    async def pick(self, method: str, path: str, raw: bytes | None, subset: set[str] | None = None,
                   headers: dict[str, str] | None = None) -> Pick:
        """The destination of one request, or a :mod:`.errors` type the gateway answers in its place; a
        planned prefill is :meth:`handoff`'s, next (the caller first tells the gateway to wait for it).
        ``subset``: the gateway's candidate endpoints (ip:port) when it sends one (the protocol's
        ``x-gateway-destination-endpoint-subset``); none of them ready is a 503. ``headers``: the
        request's (tracing on: a traceparent there is the parent of its trace)."""
        model = ENDPOINTS.get(path.split("?", 1)[0]) if method == "POST" else None
        if model is None:
            t0 = time.perf_counter()
            w = self._any_decode(subset)
            self._other.observe(time.perf_counter() - t0)
            return Pick(destination(w))
        pick = Pick("")
        tracing = self.router.tracing
        if tracing is not None:
            return await self._traced(pick, tracing, path, model, raw, subset, headers)
        await self.router.admission.enter()
        pick.admitted = True
        try:
            return await self._plan(pick, path, model, raw or b"", subset)
        except BaseException:
            self.done(pick)
            raise

    async def _traced(self, pick: Pick, tracing, path: str, model, raw: bytes | None, subset: set[str] | None,
                      headers: dict[str, str] | None) -> Pick:
        """:meth:`pick` with the request's trace: its root (ended in :meth:`done`), the admission wait, the
        tokenizing and the decision under it."""
        trace = pick.trace = tracing.start(PICK, headers, pick.arrival, {A_ENDPOINT: path})
        try:
            queued = trace.span(ADMISSION, start=pick.arrival)
            try:
                await self.router.admission.enter()
            except BaseException as e:
                mark_failed(queued, e)
                raise
            finally:
                queued.end()
        except BaseException as e:
            mark_failed(trace.root, e)
            pick.trace = None
            trace.finish()
            raise
        pick.admitted = True
        try:
            return await self._plan(pick, path, model, raw or b"", subset)
        except BaseException as e:
            mark_failed(trace.root, e)
            self.done(pick)
            raise

    async def _plan(self, pick: Pick, endpoint: str, model, raw: bytes, subset: set[str] | None) -> Pick:
        router = self.router
        t0 = time.perf_counter()
        if len(raw) > router.config.spec.max_body_bytes:
            raise errors.PayloadTooLarge(f"The request body is larger than the router accepts "
                                         f"({router.config.spec.max_body_bytes} bytes).")
        req, body = parse_body(raw, model)
        ids = await router.prompt_ids(req, pick.trace)
        plan = await router.plan_or_probe(ids, self._outside(subset), pick.trace,
                                          router.declared.adapter_of(req.model))
        self._decision.observe(time.perf_counter() - t0)   # the decision alone; a prefill's wait is its own
        route = Route(m.PATH_LOCAL_PREFILL, plan.decode.name, plan.prefill.name if plan.prefill else None,
                      revision=plan.decode.revision, local_reason=plan.reason if plan.prefill is None else None,
                      trace=pick.trace, adapter=plan.adapter)
        pick.route, pick.decode, pick.destination = route, plan.decode, destination(plan.decode)
        pick.plan, pick.endpoint, pick.request = plan, endpoint, body
        account(plan.decode, +1)
        if router.needs_ids:
            self.metrics.prompt_tokens.inc(plan.prompt_tokens)
            self.metrics.cached_prompt_tokens.inc(plan.cached_tokens)
        return pick

    async def handoff(self, pick: Pick) -> None:
        """The planned prefill, run: the decode's body then carries the KV it pulls. A prefill that fails
        leaves the body as it was (the decode prefills itself), counted as the proxy counts it."""
        kv_params = await self.router.handoff.prefill(pick.endpoint, pick.plan, pick.request, pick.route)
        if kv_params is not None:
            body = dict(pick.request)
            body["kv_transfer_params"] = kv_params
            pick.body = _dump(body)

    def answered(self, pick: Pick, status: int) -> None:
        """The decode's response began (its headers passed the gateway)."""
        pick.status = status

    def done(self, pick: Pick) -> None:
        """The gateway's stream for ``pick`` ended (the client has its answer, or went away)."""
        if pick.decode is not None:
            account(pick.decode, -1)
            pick.decode = None
        if pick.admitted:
            pick.admitted = False
            self.router.admission.leave()
            path = pick.route.path if pick.route is not None else "none"
            if pick.status is None:
                outcome = m.OUTCOME_UNANSWERED
            elif pick.status < 400:
                outcome = m.OUTCOME_SUCCESS
                self.router.accounting.labelled(self.metrics.e2e, path).observe(time.monotonic() - pick.arrival)
            elif pick.status < 500:
                outcome = m.OUTCOME_UPSTREAM_REJECTED
            else:
                outcome = m.OUTCOME_UPSTREAM_ERROR
            self.router.accounting.labelled(self.metrics.requests, outcome, path).inc()
            if pick.trace is not None:
                self._finish(pick, outcome, path)

    @staticmethod
    def _finish(pick: Pick, outcome: str, path: str) -> None:
        trace, pick.trace = pick.trace, None
        span, pick.decode_span = pick.decode_span, None
        if trace.recording:
            if pick.status is not None:
                trace.root.set_attribute(A_STATUS, pick.status)
            if span is not None:
                span.set_attribute(A_STATUS, pick.status or 0)
                if outcome != m.OUTCOME_SUCCESS:
                    mark_failed(span, outcome)
        if span is not None:
            span.end()
        if outcome not in (m.OUTCOME_SUCCESS, m.OUTCOME_UPSTREAM_REJECTED):
            mark_failed(trace.root, outcome)
        trace.finish(outcome, path)

    def _outside(self, subset: set[str] | None) -> set[str]:
        """The decodes the gateway ruled out (by name), given its subset of endpoints."""
        if subset is None:
            return set()
        return {w.name for w in self.router.pool.workers[ROLE_DECODE].values() if destination(w) not in subset}

    def _any_decode(self, subset: set[str] | None) -> Worker:
        ready = self.router.pool.healthy(ROLE_DECODE, self._outside(subset))
        if not ready:
            raise errors.NoWorkers("no healthy decode workers are available")
        return min(ready, key=lambda w: w.active)


def _dump(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
