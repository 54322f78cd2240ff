"""A stream that failed mid-way, continued on another decode worker (spec.router.maxMigrations).

Whether it may be (:meth:`Continuation.refused`) and opening the continuation (:meth:`Continuation.open`);
the token log and the rewritten chunks are :mod:`.migration`'s, the relay around it :mod:`.streaming`'s.
"""

from __future__ import annotations

from disagg.api import metrics as m

from . import migration, pairing
from .accounting import account
from .calls import Calls, WorkerError
from .config import RouterConfig
from .decision import Decider, Route
from .errors import NoWorkers, UpstreamRejected
from .fleet import Fleet
from .handoff import Handoff, fallback_reason
from .relay import EndedBeforeOutput, first_token
from .tracing import A_GENERATED, A_WORKER, MIGRATION, Trace, decode_spans, end_spans
from .tracing import failed as mark_failed


class Continuation:
    def __init__(self, config: RouterConfig, metrics, decider: Decider, fleet: Fleet, calls: Calls,
                 handoff: Handoff) -> None:
        self.config = config
        self.metrics = metrics
        self.decider = decider
        self.fleet = fleet
        self.calls = calls
        self.handoff = handoff

    def refused(self, tokens: migration.TokenLog | None, unsupported: str | None, migrations: int) -> str | None:
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

    async def open(self, tokens: migration.TokenLog, tried: list[str], revision: str | None,
                   trace: Trace | None = None, failed_worker: str | None = None):
        """Opens the continuation of a failed stream: planned as a new request whose prompt is the prompt's
        ids plus the generated ones (another decode worker first; the same one when there is no other,
        since a stall or an error event does not mean it is gone), of the stream's own KV revision: its
        ids are that revision's model's tokens. Returns (response, worker, head, head_error) as the first
        open does, and the continuation's decode span (tracing on, else None; the caller ends it with the stream).
        Traced, the reopening is a ``migration`` span (from ``failed_worker``) that holds its own prefill
        and decode attempts."""
        if trace is None:
            return await self._open(tokens, tried, revision, None)
        span = trace.span(MIGRATION, {A_WORKER: failed_worker or "", A_GENERATED: len(tokens.generated())})
        try:
            return await self._open(tokens, tried, revision, trace.under(span))
        except BaseException as e:
            mark_failed(span, e)
            raise
        finally:
            span.end()

    async def _open(self, tokens: migration.TokenLog, tried: list[str], revision: str | None,
                    trace: Trace | None):
        ids = tokens.prompt + tokens.generated()
        body = tokens.continuation()
        err: Exception = NoWorkers("no healthy decode workers are available")
        local = False        # a continuation whose KV pull failed is prefilled by its decode worker next
        excludes = [set(tried), set()]
        while excludes:
            exclude = excludes.pop(0)
            try:
                # the stream's own adapter: its tokens so far are that adapter's
                plan = self.decider.plan(ids, exclude, revision,
                                         None if body.get("model") == self.config.model else body.get("model"))
            except NoWorkers as e:
                err = e
                continue
            w = plan.decode
            kv = None if local else await self.handoff.prefill(migration.COMPLETIONS, plan, body,
                                                               Route(m.PATH_LOCAL_PREFILL, w.name, trace=trace))
            sent = dict(body, kv_transfer_params=kv) if kv else body
            span = wait = headers = None
            if trace is not None:
                span, wait, headers = decode_spans(trace, w, sent)
            account(w, +1)
            try:
                resp = await self.calls.open_stream(w, migration.COMPLETIONS, sent, headers)
                try:
                    # as a first open: a decode waiting for KV from a prefill worker that stopped answering
                    # is given up once the probes find that worker unhealthy, not at the first-token timeout
                    head, head_error = await self.fleet.unless_prefill_lost(first_token(resp, w.name),
                                                                            plan.prefill if kv else None)
                except BaseException:
                    resp.close()
                    raise
                if wait is not None:
                    wait.end()
                return resp, w, head, head_error, span
            except (WorkerError, EndedBeforeOutput, UpstreamRejected) as e:
                account(w, -1)
                if span is not None:
                    end_spans(e, wait, span)
                tried.append(w.name)
                err = e
                if kv and not isinstance(e, UpstreamRejected):
                    self.metrics.fallbacks.labels(fallback_reason(e)).inc()
                    local = True
                    excludes.insert(0, exclude)     # the same choice again, without the prefill's KV
            except BaseException as e:
                account(w, -1)
                if span is not None:
                    end_spans(e, wait, span)
                raise
        try:
            pairing.choose(self.decider.pool, set(tried), revision)
        except NoWorkers as gone:       # what ended it: its revision has no decode left untried (a rollout's end)
            raise WorkerError(f"{gone}; last attempt: {err}") from None
        raise WorkerError(str(err))
