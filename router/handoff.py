"""The prefill→decode hand-off of a planned request, and its retries before any output.

The prefill runs with ``max_tokens=1`` and ``do_remote_decode``; the decode gets the
``kv_transfer_params`` it returns. A prefill that fails leaves the decode to prefill locally; a decode
that fails before any output is retried on another decode worker (:meth:`Handoff.next_decode`), without
the prefill's KV. Streamed decodes are :mod:`.streaming`'s; this module answers non-streaming ones.
"""

from __future__ import annotations

import logging
import time

from disagg.api import metrics as m

from .accounting import Accounting, account
from .calls import Calls, TooLarge, WorkerError
from .config import RouterConfig
from .decision import Decider, Plan, Route
from .errors import UpstreamFailed, UpstreamTimeout
from .fleet import Fleet, PrefillLost
from .pool import Worker
from .tracing import A_KV, A_REASON, A_WORKER, DECODE, PREFILL
from .tracing import failed as mark_failed

log = logging.getLogger("disagg.router")
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def fallback_reason(err: Exception) -> str:
    """Why a decode that failed before output is retried without the prefill's KV (ROUTER_FALLBACKS)."""
    return m.FALLBACK_PREFILL_LOST if isinstance(err, PrefillLost) else m.FALLBACK_KV_TRANSFER


class Handoff:
    def __init__(self, config: RouterConfig, metrics, decider: Decider, fleet: Fleet, calls: Calls,
                 accounting: Accounting) -> None:
        self.config = config
        self.metrics = metrics
        self.decider = decider
        self.fleet = fleet
        self.calls = calls
        self.accounting = accounting

    async def prefill(self, endpoint: str, plan: Plan, body: dict, route: Route) -> dict | None:
        """The KV parameters for the decode, or None: no prefill planned, or it failed (counted in
        ``route``, and the decode prefills locally)."""
        if plan.prefill is None:
            return None
        # min_tokens is the decode's: vLLM refuses a prefill asked for 1 token and at least min_tokens (400)
        pbody = {k: v for k, v in body.items()
                 if k not in ("stream", "stream_options", "max_completion_tokens", "min_tokens")}
        pbody.update(max_tokens=1, stream=False, kv_transfer_params=REMOTE_DECODE)
        w = plan.prefill
        trace, span, headers = route.trace, None, None
        if trace is not None:
            # the prefill's own llm_request span (vLLM) joins the trace under this one
            span = trace.span(PREFILL, {A_WORKER: w.name})
            headers = trace.headers(span)
        account(w, +1)
        try:
            data = await self.calls.post(w, endpoint, pbody, timeout=self.config.spec.prefill_timeout_seconds,
                                         headers=headers)
            params = data.get("kv_transfer_params")
            if not params:
                raise WorkerError(f"prefill worker {w.name} returned no kv_transfer_params")
            route.path = m.PATH_REMOTE_PREFILL
            route.kv_hold = self.fleet.hold(w)
            return params
        except TimeoutError:
            reason = m.FALLBACK_PREFILL_TIMEOUT
            log.warning("prefill on %s timed out; decode prefills locally", w.name)
            if span is not None:
                mark_failed(span, reason)
        except WorkerError as e:
            reason = m.FALLBACK_PREFILL_ERROR
            log.warning("prefill on %s failed (%s); decode prefills locally", w.name, e)
            if span is not None:
                mark_failed(span, e)
                span.set_attribute(A_REASON, reason)
        except BaseException as e:       # a worker's 4xx (the client's), or cancelled
            if span is not None:
                mark_failed(span, e)
            raise
        finally:
            account(w, -1)
            if span is not None:
                span.end()
        self.metrics.fallbacks.labels(reason).inc()
        route.path, route.fallback = m.PATH_FALLBACK, reason
        if trace is not None:
            trace.fallback(reason, w.name)
        return None

    async def unary(self, endpoint, plan, body, route: Route, arrival, ids) -> dict:
        """A non-streaming decode's answer, accounted for."""
        tried: list[str] = []
        w = plan.decode
        trace, span, headers = route.trace, None, None
        while True:
            cur = w
            if trace is not None:
                # the decode's llm_request span (vLLM) joins under this one; no first-token span: the first
                # token comes and goes inside the answer
                span = trace.span(DECODE, {A_WORKER: cur.name, A_KV: "kv_transfer_params" in body})
                headers = trace.headers(span)
            account(cur, +1)
            try:
                data = await self.fleet.unless_prefill_lost(
                    self.calls.post(cur, endpoint, body, timeout=self.config.spec.request_timeout_seconds,
                                    headers=headers),
                    plan.prefill if "kv_transfer_params" in body else None, route.kv_hold)
                break
            except TimeoutError:
                # the worker is slow, not gone: another one would be as slow, and the client has waited enough
                if span is not None:
                    mark_failed(span, m.TIMEOUT_REQUEST)
                self.metrics.timeouts.labels(m.TIMEOUT_REQUEST).inc()
                self.metrics.requests.labels(m.OUTCOME_TIMEOUT, route.path).inc()
                raise UpstreamTimeout(f"the decode worker {cur.name} did not answer within the request "
                                      f"timeout ({self.config.spec.request_timeout_seconds:g} s)") from None
            except TooLarge as e:
                # the answer exists, and another worker would write the same: no retry
                if span is not None:
                    mark_failed(span, e)
                self.metrics.requests.labels(m.OUTCOME_UPSTREAM_ERROR, route.path).inc()
                raise UpstreamFailed(str(e)) from None
            except WorkerError as e:
                if span is not None:
                    mark_failed(span, e)
                w = self.next_decode(cur, e, ids, tried, route)
                body = self.without_remote_kv(body, route, fallback_reason(e))
            except BaseException as e:       # a worker's 4xx (the client's), or cancelled
                if span is not None:
                    mark_failed(span, e)
                raise
            finally:
                account(cur, -1)
                if span is not None:
                    span.end()
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

    def next_decode(self, failed: Worker, err: Exception, ids: list[int], tried: list[str], route: Route) -> Worker:
        """Another decode worker after one failed before any output, or a clean error. A worker that
        refused connections is marked unhealthy; one that still looks healthy (say, a pooled
        connection closed under us) may be tried again when there is no other."""
        tried.append(failed.name)
        log.warning("decode on %s failed before any output: %s", failed.name, err)
        nxt = None
        if len(tried) < self.config.decode_attempts:
            nxt = self.decider.another_decode(failed, ids, tried, route.adapter)
        if nxt is None:
            self.metrics.requests.labels(m.OUTCOME_UPSTREAM_ERROR, route.path).inc()
            raise UpstreamFailed(f"the decode worker failed: {err}")
        self.metrics.fallbacks.labels(m.FALLBACK_DECODE_RETRY).inc()
        if route.trace is not None:
            route.trace.fallback(m.FALLBACK_DECODE_RETRY, failed.name)
        route.decode, route.revision = nxt.name, nxt.revision
        return nxt

    def without_remote_kv(self, body: dict, route: Route, reason: str = m.FALLBACK_KV_TRANSFER) -> dict:
        """The retry after a decode failure prefills locally: the failure may be the KV pull itself
        (the prefill worker died or dropped the blocks), and asking again for the same blocks would
        fail again or wait out NIXL's timeout."""
        if "kv_transfer_params" not in body:
            return body
        self.metrics.fallbacks.labels(reason).inc()
        route.path, route.fallback = m.PATH_FALLBACK, reason
        if route.trace is not None:
            route.trace.fallback(reason, route.prefill)
        return {k: v for k, v in body.items() if k != "kv_transfer_params"}
