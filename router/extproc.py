"""The endpoint picker protocol: Envoy's external processing (ext_proc) over gRPC, as the Gateway API
Inference Extension defines it (its proposal 004): for each request the picker answers the destination in
the ``x-gateway-destination-endpoint`` header and in the ``envoy.lb`` dynamic metadata, or an immediate
response (429 shed, 503 nothing ready, 4xx for a request it refuses) in the OpenAI error shape. gRPC
health answers for ``liveness``, ``readiness`` and the ext_proc service.

Request bodies may come BUFFERED (one message: what the project's own Envoy configuration asks for,
:mod:`disagg.e2e.gateway`) or FULL_DUPLEX_STREAMED (chunks: what Gateway implementations configure for an
InferencePool); either way the headers are answered once the whole body is in, so the destination header
and the new body leave together. Response headers, when sent, get the route's ``x-disagg-*`` headers;
response bodies, when a gateway sends them, are passed back unchanged (the project's configuration
does not send them: the tokens never reach Python).

The stream's end is the request's end: Envoy closes the ext_proc stream of a request with a body when
its HTTP stream ends, which is when the picker gives back the decode's load and the admission slot.
"""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from . import errors
from .picker import Pick, Picker

log = logging.getLogger("disagg.router.picker")
DESTINATION = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("liveness", "readiness", SERVICE)
STREAMED = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
# Envoy's message timeout covers the picker's answer; a prefill may take longer, so the picker extends
# it for that request (override_message_timeout, within the gateway's max_message_timeout) before it waits
PREFILL_MARGIN_S = 5


def _header(key: str, value: str | bytes, replace: bool = False) -> base_pb2.HeaderValueOption:
    """``replace``: the value replaces one the request came with (else Envoy's default: added beside it)."""
    raw = value if isinstance(value, bytes) else value.encode()
    if replace:
        return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=raw),
                                          append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=raw))


def _headers_of(msg: pb.HttpHeaders) -> dict[str, str]:
    return {h.key: (h.raw_value.decode("latin-1") if h.raw_value else h.value) for h in msg.headers.headers}


def _immediate(err: errors.RouterError) -> pb.ProcessingResponse:
    headers = [_header("content-type", "application/json")]
    if isinstance(err, errors.Overloaded):
        headers.append(_header("retry-after", str(err.retry_after_s)))
    elif isinstance(err, errors.Unauthorized):
        headers.append(_header("www-authenticate", "Bearer"))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=err.status),
        headers=pb.HeaderMutation(set_headers=headers),
        body=json.dumps(errors.body(err)).encode(), details=f"disagg_picker_{err.status}"))


def _subset(req: pb.ProcessingRequest) -> set[str] | None:
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_KEY]
    items = value.list_value.values if value.HasField("list_value") else [value]
    return {v.string_value for v in items if v.string_value}


class _Stream:
    """One request's ext_proc stream."""
    __slots__ = ("picker", "headers", "chunks", "streamed", "pick", "subset")

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.streamed = False
        self.pick: Pick | None = None
        self.subset: set[str] | None = None

    async def decide(self, body: bytes | None):
        """The answers to a request whose headers (and body, if any) are all in: an immediate response,
        or the headers' answer (and the body's, when it had one)."""
        h = self.headers
        try:
            self.picker.authorize(h.get("authorization"))
            pick = self.pick = await self.picker.pick(h.get(":method", "GET"), h.get(":path", "/"), body,
                                                      self.subset, h)
            if pick.plan is not None and pick.plan.prefill is not None:
                yield pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(
                    seconds=int(self.picker.router.config.spec.prefill_timeout_seconds + PREFILL_MARGIN_S)))
                await self.picker.handoff(pick)
        except errors.RouterError as e:
            yield _immediate(e)
            return
        mutation = [_header(DESTINATION, pick.destination)]
        if pick.trace is not None:       # the decode's llm_request joins the request's trace
            mutation += [_header(k, v, replace=True) for k, v in pick.request_headers().items()]
        if pick.body is not None:
            mutation.append(_header("content-length", str(len(pick.body))))
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=mutation), clear_route_cache=True)
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: pick.destination}})
        if body is None:
            yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                        dynamic_metadata=metadata)
        elif self.streamed:
            yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                        dynamic_metadata=metadata)
            yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=pick.body if pick.body is not None else body, end_of_stream=True)))))
        else:
            if pick.body is not None:
                common.body_mutation.body = pick.body
            yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)

    def response_headers(self, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        mutation = []
        if self.pick is not None:
            status = _headers_of(msg).get(":status", "0")
            self.picker.answered(self.pick, int(status) if status.isdigit() else 0)
            mutation = [_header(k, v) for k, v in self.pick.response_headers().items()]
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=mutation))))

    def close(self) -> None:
        if self.pick is not None:
            self.picker.done(self.pick)
            self.pick = None


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(self, requests, context):
        s = _Stream(self.picker)
        gauge = self.picker.metrics.picker_streams
        gauge.inc()
        try:
            async for req in requests:
                kind = req.WhichOneof("request")
                if kind == "request_headers":
                    s.headers = _headers_of(req.request_headers)
                    s.streamed = req.protocol_config.request_body_mode == STREAMED
                    s.subset = _subset(req)
                    if req.request_headers.end_of_stream:
                        async for resp in s.decide(None):
                            yield resp
                    elif not s.streamed:
                        # buffered: the body comes once the headers are answered; they leave with the body's answer
                        yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                elif kind == "request_body":
                    chunk = req.request_body
                    s.chunks.append(chunk.body)
                    if chunk.end_of_stream or chunk.end_of_stream_without_message:
                        body, s.chunks = b"".join(s.chunks), []
                        async for resp in s.decide(body):
                            yield resp
                    elif sum(map(len, s.chunks)) > self.picker.router.config.spec.max_body_bytes:
                        yield _immediate(errors.PayloadTooLarge(
                            "The request body is larger than the router accepts "
                            f"({self.picker.router.config.spec.max_body_bytes} bytes)."))
                        return
                elif kind == "response_headers":
                    yield s.response_headers(req.response_headers)
                elif kind == "response_body":
                    # a gateway that sends the response body gets it back as it came
                    chunk = req.response_body
                    if req.protocol_config.response_body_mode == STREAMED or s.streamed:
                        yield pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                                body=chunk.body, end_of_stream=chunk.end_of_stream)))))
                    else:
                        yield pb.ProcessingResponse(response_body=pb.BodyResponse())
                elif kind == "request_trailers":
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif kind == "response_trailers":
                    yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        finally:
            s.close()
            gauge.dec()


class Health:
    """gRPC health for ``liveness`` (always, while the process answers), and ``readiness`` and the
    ext_proc service (a healthy decode worker: what the HTTP readiness probe also says)."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.servicer = health.aio.HealthServicer()

    async def refresh(self) -> None:
        ready = bool(self.picker.router.pool.healthy("decode"))
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        for name in ("readiness", SERVICE, ""):
            await self.servicer.set(name, status)


async def serve(picker: Picker, host: str, port: int, reuse_port: bool = False) -> grpc.aio.Server:
    """The ext_proc and health services, started on ``host:port`` (0: any free port; ``server.port``).
    ``reuse_port``: several router processes on one port (spec.router.processes), as the HTTP port."""
    # gRPC core's backlog protection cancels streams that arrive faster than the server's accept loop takes
    # them (1,000 pending, then random drops): at 2,000 streams Envoy saw resets its FailClose turned into
    # 503s (bench/results/envoy-picker-2026-12-04.md). Admission sheds with a 429 that says why; gRPC must
    # not shed first.
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", picker.router.config.spec.max_body_bytes
                                       + 65536),
                                      ("grpc.max_concurrent_streams", 0x7FFFFFFF),
                                      ("grpc.server.max_pending_requests", 1 << 20),
                                      ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
                                      ("grpc.so_reuseport", int(reuse_port))])
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker), server)
    h = Health(picker)
    health_pb2_grpc.add_HealthServicer_to_server(h.servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await h.refresh()

    async def keep_health() -> None:
        while True:
            await asyncio.sleep(picker.router.config.health_interval_s)
            await h.refresh()

    server.port = bound
    server.health_task = asyncio.create_task(keep_health())
    log.info("endpoint picker (ext_proc) listening on %s:%d", host, bound)
    return server
