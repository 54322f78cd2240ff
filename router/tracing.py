"""Request tracing with OpenTelemetry: where one request's time went, across the router and both workers.

Off unless configured (``RouterConfig.tracing``, from the deployment's spec.tracing): then the router has
one :class:`Tracing` (its own TracerProvider and OTLP/gRPC exporter, exporting from a background thread),
and each request a :class:`Trace` (its root span) carried on its :class:`~.decision.Route`, so that every
part that handles the request (:mod:`.handoff`, :mod:`.streaming`, :mod:`.continuation`, :mod:`.picker`)
opens its spans under it. Off, nothing here runs on the request path: the parts check ``route.trace is
None`` and do no tracer work at all.

The span tree of one request (names in this module's constants)::

    request                      the client's request, from its arrival to its last byte (proxy mode)
    pick                         picker mode: from the gateway's question to the end of its stream
      admission                  the wait for an admission slot (the router's queue)
      tokenize                   the prompt's token ids (where routing uses them)
      routing                    the decision: candidates with their load and prefix overlap, the
                                 workers chosen, Plan.reason
      prefill                    the prefill leg (max_tokens=1, do_remote_decode): vLLM's llm_request
                                 span of the prefill joins here (traceparent)
      decode                     one decode attempt, from opening its stream to its end; vLLM's
        first_token              llm_request of the decode joins under it; first_token is the wait from
                                 opening the stream to the first token: the KV pull and the first step
      fallback                   each fallback (a failed prefill, a decode retried elsewhere, a KV pull
                                 given up), a marker with its reason
      migration                  a stream continued elsewhere, up to the continuation's first token (its
        prefill                  own prefill and decode attempt under it)
        decode

The trace id comes back to the client in the ``x-disagg-trace-id`` response header when the request was
sampled. Sampling is parent-based with the configured ratio: a client's (or a gateway's) sampled
``traceparent`` is followed, and the router's decision goes to the workers in the ``traceparent`` it sends
(flag 00 when not sampled), so a worker that traces too records exactly the router's sampled requests.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation import set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACE_ID_HEADER = "x-disagg-trace-id"
SERVICE_NAME = "disagg-router"
INSTRUMENTATION = "disagg.router"

# span names
REQUEST = "request"
PICK = "pick"
ADMISSION = "admission"
TOKENIZE = "tokenize"
ROUTING = "routing"
PREFILL = "prefill"
DECODE = "decode"
FIRST_TOKEN = "first_token"
FALLBACK = "fallback"
MIGRATION = "migration"

# attribute keys (the project's own under disagg.*)
A_ENDPOINT = "http.route"
A_STATUS = "http.response.status_code"
A_WORKER = "disagg.worker"
A_ROLE = "disagg.role"
A_PATH = "disagg.path"
A_OUTCOME = "disagg.outcome"
A_REASON = "disagg.reason"
A_KV = "disagg.kv_transfer"
A_ATTEMPT = "disagg.attempt"
A_OUTPUT_TOKENS = "disagg.output_tokens"
A_GENERATED = "disagg.generated_tokens"

_PROPAGATOR = TraceContextTextMapPropagator()


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as the wall-clock nanoseconds OpenTelemetry timestamps spans with. Two
    calls for one reading can differ by some nanoseconds (the two clocks are read one after the other),
    so one trace converts through its anchor (:class:`Trace`), never twice through this."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class Tracing:
    """The router's tracer, made once at start-up when tracing is configured. Its own TracerProvider (no
    global state: several routers in one process, as tests run them, each trace apart). ``exporter``
    replaces the OTLP one (tests pass the SDK's in-memory exporter); ``batch``: export from a background
    thread in batches (a test's in-memory exporter is given each span as it ends)."""

    def __init__(self, endpoint: str | None, sampling_ratio: float = 1.0, service_name: str = SERVICE_NAME,
                 exporter=None, batch: bool = True) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                       sampler=ParentBased(TraceIdRatioBased(sampling_ratio)))
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer(INSTRUMENTATION)

    @classmethod
    def from_config(cls, config) -> Tracing | None:
        """The router's tracing per ``config.tracing`` (a TracingSpec), or None: off."""
        t = config.tracing
        if t is None:
            return None
        return cls(t.otlp_endpoint, t.sampling_ratio)

    def start(self, name: str, headers: Mapping[str, str] | None = None, arrival: float | None = None,
              attributes: dict | None = None) -> Trace:
        """A request's trace: its root span ``name``, from ``arrival`` (time.monotonic(); default now),
        a child of the ``traceparent`` in ``headers`` when one came."""
        parent = _PROPAGATOR.extract(headers) if headers is not None and "traceparent" in headers else None
        if arrival is None:
            arrival = time.monotonic()
        anchor = (arrival, wall_ns(arrival))
        root = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes,
                                      start_time=anchor[1])
        return Trace(self.tracer, root, anchor=anchor)

    def shutdown(self) -> None:
        """Exports what is left and stops the exporter's thread (at the router's close: an unreachable
        collector holds it up to the exporter's timeout, 10 s, inside the drain's grace)."""
        self.provider.shutdown()


class Trace:
    """One request's spans: its root, and the spans the router's parts open under it (:meth:`span`). A
    request that was not sampled has a non-recording root; its spans are that root again (no work), and
    its :meth:`headers` still carry the decision (flag 00) to the workers."""
    __slots__ = ("tracer", "root", "parent", "recording", "anchor", "_unsampled")

    def __init__(self, tracer, root, parent=None, anchor: tuple[float, int] | None = None) -> None:
        self.tracer = tracer
        self.root = root
        self.parent = root if parent is None else parent
        # (monotonic, wall ns) of the root's start: every monotonic reading of this trace converts from
        # it, so a child started "at arrival" starts exactly where its root does, not some ns before
        self.anchor = (time.monotonic(), time.time_ns()) if anchor is None else anchor
        self.recording = root.is_recording()
        self._unsampled: dict[str, str] | None = None     # not recording: the one traceparent every leg gets

    @property
    def trace_id(self) -> str:
        return format(self.root.get_span_context().trace_id, "032x")

    def response_headers(self) -> dict[str, str]:
        """The trace id for the client, when there is a trace to look up."""
        return {TRACE_ID_HEADER: self.trace_id} if self.recording else {}

    def span(self, name: str, attributes: dict | None = None, parent=None, start: float | None = None):
        """A span ``name`` under ``parent`` (default: this trace's parent, the root unless :meth:`under`
        said otherwise), started now or at ``start`` (time.monotonic()). The caller ends it."""
        if not self.recording:
            return self.root
        return self.tracer.start_span(name, context=set_span_in_context(parent or self.parent),
                                      attributes=attributes, start_time=None if start is None else self.wall_ns(start))

    def wall_ns(self, monotonic_s: float) -> int:
        """A time.monotonic() reading of this request as wall-clock ns, through the trace's anchor."""
        return self.anchor[1] + round((monotonic_s - self.anchor[0]) * 1e9)

    def under(self, span) -> Trace:
        """This trace with ``span`` as the parent of the spans opened through it (a migration's legs)."""
        return Trace(self.tracer, self.root, span, self.anchor)

    def headers(self, span=None) -> dict[str, str]:
        """The W3C ``traceparent`` of ``span`` (default: the root) for a worker's request: its own spans
        then join this trace under that span."""
        if not self.recording:
            if self._unsampled is None:
                self._unsampled = {}
                _PROPAGATOR.inject(self._unsampled, set_span_in_context(self.root))
            return self._unsampled
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, set_span_in_context(span if span is not None else self.root))
        return carrier

    def fallback(self, reason: str, worker: str | None = None) -> None:
        """A fallback, as a marker span under the root (and the root's attribute)."""
        if not self.recording:
            return
        self.root.set_attribute(A_REASON + ".fallback", reason)
        span = self.tracer.start_span(FALLBACK, context=set_span_in_context(self.parent),
                                      attributes={A_REASON: reason, **({A_WORKER: worker} if worker else {})})
        span.end()

    def finish(self, outcome: str | None = None, path: str | None = None) -> None:
        """The root span's end, with the request's outcome and route path."""
        root = self.root
        if self.recording:
            if outcome is not None:
                root.set_attribute(A_OUTCOME, outcome)
            if path is not None:
                root.set_attribute(A_PATH, path)
        root.end()


def failed(span, error: BaseException | str) -> None:
    """``span`` marked failed with ``error`` (an exception, or a reason)."""
    if not span.is_recording():
        return
    if isinstance(error, BaseException):
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
    else:
        span.set_status(Status(StatusCode.ERROR, error))
        span.set_attribute(A_REASON, error)


def routing_attributes(plan, notes: dict, policy: str) -> dict:
    """The routing span's attributes: the workers chosen, why, and per role the candidates with their
    load, prefix overlap (blocks, KV events and recent decisions) and the chosen one's cost."""
    attrs = {"disagg.routing.policy": policy, "disagg.routing.decode": plan.decode.name,
             "disagg.routing.reason": plan.reason, "disagg.routing.prompt_tokens": plan.prompt_tokens,
             "disagg.routing.cached_tokens": plan.cached_tokens}
    if plan.prefill is not None:
        attrs["disagg.routing.prefill"] = plan.prefill.name
    for role, (candidates, overlap, decision) in notes.items():
        attrs[f"disagg.routing.{role}.candidates"] = [
            f"{name} active={active} overlap_blocks={overlap.get(name, 0)}" for name, active in candidates]
        attrs[f"disagg.routing.{role}.overlap_blocks"] = decision.overlap_blocks
        attrs[f"disagg.routing.{role}.cost"] = float(decision.cost)
        attrs[f"disagg.routing.{role}.load_bounded"] = decision.load_bounded
    return attrs


def decode_spans(trace: Trace, w, body: dict):
    """A decode attempt's spans, opened as its stream is: the attempt (``decode``, to its stream's end;
    the worker's llm_request joins under it) and the wait for its first token under it (``first_token``:
    the KV pull and the first step); and the traceparent for the worker."""
    span = trace.span(DECODE, {A_WORKER: w.name, A_KV: "kv_transfer_params" in body})
    return span, trace.span(FIRST_TOKEN, parent=span), trace.headers(span)


def end_spans(error: BaseException, *spans) -> None:
    """Spans of an attempt that failed with ``error``, ended."""
    for s in spans:
        failed(s, error)
        s.end()


__all__ = ["TRACE_ID_HEADER", "Trace", "Tracing", "decode_spans", "end_spans", "failed", "routing_attributes",
           "wall_ns"]
