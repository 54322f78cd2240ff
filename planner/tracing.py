"""The planner's decisions as traces, when the planner is given an OTLP endpoint.

Each decision (and each fast-path reaction that scales) is one span, ``planner.decision`` or
``planner.fast_path``, under service ``disagg-planner``: from the start of its Prometheus reads to the end
of its apply. It carries the deployment, the reason, the message, the replica counts before and after, the
inputs and the prediction status shows; and one ``prometheus.query`` event per query it read, with the
PromQL and the value Prometheus answered (none when the series was empty or NaN). That is the link to the
metrics: the exact expressions, against the Prometheus endpoint the span names (by its allowlist name),
over the window it names.

The endpoint is the planner's own setting (``--otlp-traces-endpoint``, the chart's
``planner.otlpTracesEndpoint``), not a deployment's spec.tracing: the planner runs beside the operator,
and, as with its Prometheus allowlist, no user's spec chooses where it connects. Every decision is recorded
(a few a minute per deployment). Off (no endpoint), nothing here runs.
"""

from __future__ import annotations

from typing import Any

from disagg.router.tracing import Tracing

SERVICE_NAME = "disagg-planner"
DECISION = "planner.decision"
FAST_PATH = "planner.fast_path"
READ = "prometheus.query"

A_NAMESPACE = "k8s.namespace.name"
A_DEPLOYMENT = "disagg.deployment"
A_REASON = "disagg.planner.reason"
A_MESSAGE = "disagg.planner.message"
A_METRICS_OK = "disagg.planner.metrics_ok"
A_PROMETHEUS = "disagg.planner.prometheus"
A_WINDOW = "disagg.planner.window_seconds"
A_QUERY_NAME = "disagg.planner.query"
A_QUERY = "db.query.text"        # OpenTelemetry's semantic convention for a database query's text
A_VALUE = "disagg.planner.value"


class DecisionTracer:
    """The planner's tracer, made once at start-up when tracing is configured (its provider and OTLP
    exporter are the router's own setup, :class:`~disagg.router.tracing.Tracing`). ``exporter`` replaces
    the OTLP one (tests pass the SDK's in-memory exporter; each span is then handed over as it ends)."""

    def __init__(self, endpoint: str | None = None, exporter=None) -> None:
        self.tracing = Tracing(endpoint, 1.0, SERVICE_NAME, exporter=exporter, batch=exporter is None)

    def record(self, meta: dict[str, Any], obs: Any, decision: Any, target: Any, start_ns: int,
               end_ns: int | None = None, fast: bool = False, prometheus: str | None = None,
               window_seconds: float | None = None) -> None:
        """One decision's span, from ``start_ns`` (time.time_ns()) to ``end_ns`` (default: now).
        ``prometheus``: the allowlist name of the endpoint read."""
        attributes = {A_NAMESPACE: meta["namespace"], A_DEPLOYMENT: meta["name"], A_REASON: decision.reason,
                      A_MESSAGE: decision.message, A_METRICS_OK: decision.metrics_ok,
                      "disagg.planner.prefill.replicas": target.prefill,
                      "disagg.planner.decode.replicas": target.decode,
                      "disagg.planner.prefill.decided": decision.prefill.replicas,
                      "disagg.planner.decode.decided": decision.decode.replicas}
        if prometheus:
            attributes[A_PROMETHEUS] = prometheus
        if window_seconds is not None:
            attributes[A_WINDOW] = window_seconds
        for k, v in decision.inputs.items():
            attributes[f"disagg.planner.input.{k}"] = v
        for k, v in decision.prediction.items():
            attributes[f"disagg.planner.prediction.{k}"] = v
        span = self.tracing.tracer.start_span(FAST_PATH if fast else DECISION, attributes=attributes, start_time=start_ns)
        # each read's own time is not kept: all are stamped at the span's start, in the order they were made
        for key, promql, value in obs.reads:
            event = {A_QUERY_NAME: key, A_QUERY: promql}
            if value is not None:
                event[A_VALUE] = value
            span.add_event(READ, event, timestamp=start_ns)
        if obs.error:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, obs.error))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        self.tracing.shutdown()
