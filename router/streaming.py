"""A streamed decode: opened (another worker if one fails before output), then relayed to the client,
continued elsewhere if it fails mid-way (:mod:`.continuation`), and accounted for however it ends.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from collections.abc import Awaitable, Callable

from disagg.api import metrics as m

from . import migration, upstream
from .accounting import Accounting, account
from .calls import Calls, WorkerError
from .config import RouterConfig
from .continuation import Continuation
from .decision import Route
from .errors import RouterError, UpstreamFailed, sse
from .fleet import Fleet
from .handoff import Handoff, fallback_reason
from .pool import Worker
from .relay import EndedBeforeOutput, Sink, StreamEnd, Watchdog, emit, finish, first_token, relay
from .tracing import A_OUTCOME, A_OUTPUT_TOKENS, Trace, decode_spans, end_spans
from .tracing import failed as mark_failed

log = logging.getLogger("disagg.router")


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


class Streaming:
    """Its :attr:`watchdog` cuts the streams past their timeouts once its ``run()`` is started."""

    def __init__(self, config: RouterConfig, tokenizer, metrics, fleet: Fleet, calls: Calls, handoff: Handoff,
                 continuation: Continuation, accounting: Accounting) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.fleet = fleet
        self.calls = calls
        self.handoff = handoff
        self.continuation = continuation
        self.accounting = accounting
        spec = config.spec
        self.watchdog = Watchdog(spec.first_token_timeout_seconds, spec.idle_timeout_seconds)

    async def open(self, endpoint, plan, body, route: Route, start, ids,
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
        trace = route.trace
        span = None
        while True:
            headers = None
            if trace is not None:
                span, wait, headers = decode_spans(trace, w, body)
            account(w, +1)
            try:
                resp = await self.calls.open_stream(w, endpoint, body, headers)
                try:
                    # up to the first token before the client sees anything: a stream that ends empty
                    # is a failure before output, served by another worker
                    head, head_error = await self.fleet.unless_prefill_lost(
                        first_token(resp, w.name), plan.prefill if "kv_transfer_params" in body else None,
                        route.kv_hold, pulled=lambda out: out[1] is None)
                except BaseException:
                    resp.close()
                    raise
                if trace is not None:
                    wait.end()
                break
            except (WorkerError, EndedBeforeOutput) as e:
                account(w, -1)
                if trace is not None:
                    end_spans(e, wait, span)
                w = self.handoff.next_decode(w, e, ids, tried, route)
                body = self.handoff.without_remote_kv(body, route, fallback_reason(e))
            except BaseException as e:
                account(w, -1)
                if trace is not None:
                    end_spans(e, wait, span)
                raise
        def abandon() -> None:
            resp.close()
            account(w, -1)
            if span is not None:
                span.end()

        return Stream(lambda sink: self._relay(sink, resp, w, route.path, start, client_wants_usage, head,
                                               head_error, tokens, unsupported,
                                               start if arrival is None else arrival, trace, span), abandon)

    async def _relay(self, sink: Sink, resp: upstream.Connection, w: Worker, path: str, start: float,
                     client_wants_usage: bool, head: bytes = b"", head_error: BaseException | None = None,
                     tokens: migration.TokenLog | None = None, unsupported: str | None = None,
                     arrival: float | None = None, trace: Trace | None = None, span=None) -> None:
        """The stream relay (:mod:`.relay`) and the request's accounting once it ends, however it ends.
        A stream that fails is continued on another decode worker (:mod:`.migration`), up to
        spec.router.maxMigrations times; the client sees one stream. ``start`` times the first token
        for the watchdog; TTFT and duration count from ``arrival`` (default ``start``). ``trace``, ``span``:
        the request's trace and the decode span of ``w``'s stream (tracing on), ended here with it."""
        spec = self.config.spec
        labelled = self.accounting.labelled
        arrival = start if arrival is None else arrival
        outcome, migrations, last, output_tokens = m.OUTCOME_UPSTREAM_ERROR, 0, None, 0
        tried: list[str] = []
        finishing = None         # a stream that sent [DONE] and whose worker's body has yet to end
        observe_ttft = labelled(self.metrics.ttft, path).observe
        if trace is not None and trace.recording:
            # the TTFT observation's exemplar: a slow bucket links to the request's trace (OpenMetrics scrapes)
            observe_ttft = partial(observe_ttft, exemplar={m.EXEMPLAR_TRACE_ID: trace.trace_id})
        try:
            while True:
                end = StreamEnd(last_activity=start if last is None else time.monotonic(), resp=resp)
                self.watchdog.streams.add(end)
                try:
                    await relay(resp, w.name, end, sink, start=arrival, client_wants_usage=client_wants_usage,
                                observe_ttft=observe_ttft,
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
                    if span is not None:
                        if span.is_recording():
                            span.set_attribute(A_OUTPUT_TOKENS, end.output_tokens)
                            if end.outcome != m.OUTCOME_SUCCESS:
                                mark_failed(span, end.error or end.outcome)
                        span.end()
                        span = None
                if end.outcome == m.OUTCOME_SUCCESS:
                    outcome, output_tokens = m.OUTCOME_SUCCESS, end.output_tokens
                    self.accounting.count_prompt(end.usage)
                    break
                last = end.last_token_at or last
                outcome = m.OUTCOME_TIMEOUT if end.idle_timeout else m.OUTCOME_UPSTREAM_ERROR
                refused = self.continuation.refused(tokens, unsupported, migrations)
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
                    resp, w, head, head_error, span = await self.continuation.open(tokens, tried, w.revision, trace,
                                                                                   w.name)
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
            labelled(self.metrics.requests, outcome, path).inc()
            if trace is not None:
                if span is not None:        # the continuation's, when the client left before it was relayed
                    span.end()
                trace.root.set_attribute(A_OUTCOME, outcome)
            if outcome == m.OUTCOME_SUCCESS:
                labelled(self.metrics.e2e, path).observe(time.monotonic() - arrival)
                self.metrics.output_tokens.observe(output_tokens)
        # after the accounting: a client that stops reading at [DONE] and asks for /metrics finds the
        # request there; the client's response ends after this, with the connection already pooled
        if finishing is not None:
            await finish(finishing)
