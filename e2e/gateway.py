"""Envoy as the gateway in front of the workers, with the router as its endpoint picker (picker mode).

No conformant Gateway API implementation runs here, so this is the Gateway API Inference Extension's own
end-to-end pattern: plain Envoy with a static configuration, the picker answering its ext_proc calls, the
model servers behind. :func:`envoy_config` writes what a gateway renders for an InferencePool:

- an early header mutation (before the route is chosen) dropping any ``x-gateway-destination-endpoint`` a
  client sent: else a client could pick any address when the picker is down and the pool fails open;
- the ext_proc filter: request headers and body to the picker (body BUFFERED, or FULL_DUPLEX_STREAMED as
  Gateway implementations send it), response headers too (the route's ``x-disagg-*`` headers), never the
  response body (the tokens stay in Envoy); the picker's failure mode as the pool's ``failureMode`` says
  (FailOpen: any endpoint of the pool; FailClose: 503);
- the route to an ORIGINAL_DST cluster keyed on the picker's header, recomputed after the picker answers
  (``clear_route_cache``); without the header (fail-open) a round-robin cluster of the pool's endpoints.

:func:`pool_endpoints` reads an InferencePool the operator wrote as a gateway would (its picker Service,
its selected pods and target port). :class:`Envoy` runs the binary from the cache (build-envoy.sh).
"""

from __future__ import annotations

import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

DESTINATION = "x-gateway-destination-endpoint"
FAIL_OPEN, FAIL_CLOSE = "FailOpen", "FailClose"
BUFFERED, STREAMED = "BUFFERED", "FULL_DUPLEX_STREAMED"
# one gateway's worth of streams is far above Envoy's default circuit breakers (1,024 requests a cluster)
MAX_REQUESTS = 1_000_000


def envoy_binary() -> Path:
    """Envoy from the cache, fetched into it when absent (e2e/localcluster/build-envoy.sh)."""
    out = subprocess.run(["bash", str(Path(__file__).resolve().parent / "localcluster" / "build-envoy.sh")],
                         check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1]) / "envoy"


def _address(hostport: str) -> dict:
    host, _, port = hostport.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def _static_cluster(name: str, endpoints: list[str], http2: bool = False) -> dict:
    c = {"name": name, "type": "STATIC", "connect_timeout": "2s", "lb_policy": "ROUND_ROBIN",
         "circuit_breakers": _breakers(),
         "load_assignment": {"cluster_name": name, "endpoints": [
             {"lb_endpoints": [{"endpoint": {"address": _address(e)}} for e in endpoints]}]}}
    if http2:
        c["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {"max_concurrent_streams": 2**31 - 1}}}}
    return c


def _breakers() -> dict:
    return {"thresholds": [{"max_connections": MAX_REQUESTS, "max_pending_requests": MAX_REQUESTS,
                            "max_requests": MAX_REQUESTS, "max_retries": 16}]}


def envoy_config(*, port: int, admin_port: int, picker: str, pool: list[str], failure_mode: str = FAIL_CLOSE,
                 body_mode: str = BUFFERED, host: str = "127.0.0.1", message_timeout_s: float = 30,
                 max_message_timeout_s: float = 300, max_body_bytes: int = 8 * 2**20) -> dict:
    """Envoy's bootstrap for a gateway on ``host:port`` whose picker is ``picker`` (ip:port) and whose pool
    is ``pool`` (ip:port of each endpoint: the fail-open route's targets). ``message_timeout_s``: how long
    Envoy waits for each picker answer; a picker that is gone fails at once (connection refused), so this
    bounds only a picker that hangs or is swamped (2 s timed out requests still queued in gRPC at 2,000
    streams on two cores; the Inference Extension's own Envoy Gateway manifests wait 1,000 s)."""
    if failure_mode not in (FAIL_OPEN, FAIL_CLOSE):
        raise ValueError(f"failure_mode must be {FAIL_OPEN} or {FAIL_CLOSE}, not {failure_mode!r}")
    streamed = body_mode == STREAMED
    mode = {"request_header_mode": "SEND", "response_header_mode": "SEND",
            "request_body_mode": body_mode, "response_body_mode": body_mode if streamed else "NONE",
            # full duplex streaming needs the trailers (Envoy refuses the mode without them)
            "request_trailer_mode": "SEND" if streamed else "SKIP",
            "response_trailer_mode": "SEND" if streamed else "SKIP"}
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": f"{max_message_timeout_s:g}s"},
        "failure_mode_allow": failure_mode == FAIL_OPEN,
        "status_on_error": {"code": 503},
        "message_timeout": f"{message_timeout_s:g}s",
        # the picker extends one request's timeout while it waits for a prefill (override_message_timeout)
        "max_message_timeout": f"{max_message_timeout_s:g}s",
        "processing_mode": mode,
        # the picker's destination header is read by the route (and the original-destination cluster)
        "mutation_rules": {"allow_all_routing": True},
    }
    routes = [{"match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]},
               "route": {"cluster": "picked", "timeout": "0s"}}]
    clusters = [_static_cluster("picker", [picker], http2=True),
                {"name": "picked", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "2s",
                 "circuit_breakers": _breakers(),
                 "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}}]
    if failure_mode == FAIL_OPEN and pool:
        routes.append({"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}})
        clusters.append(_static_cluster("pool", pool))
    else:
        routes.append({"match": {"prefix": "/"}, "direct_response": {
            "status": 503, "body": {"inline_string": '{"error":{"message":"no endpoint was picked",'
                                                     '"type":"internal_error","code":503}}'}}})
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        # no x-request-id made per request (a UUID from the system's random source): nothing here reads it
        "generate_request_id": False,
        "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": routes}]},
        # before the route is first chosen: a filter removing it later would leave a route chosen by it
        "early_header_mutation_extensions": [{"name": "envoy.http.early_header_mutation.header_mutation",
                                              "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [{"remove": DESTINATION}]}}],
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    return {
        "admin": {"address": _address(f"127.0.0.1:{admin_port}")},
        "static_resources": {
            "listeners": [{"name": "gateway", "address": _address(f"{host}:{port}"),
                           "per_connection_buffer_limit_bytes": max_body_bytes + 65536,
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                           "typed_config": hcm}]}]}],
            "clusters": clusters,
        },
    }


@dataclass
class PoolEndpoints:
    picker: str             # ip:port of the endpoint picker (the pool's endpointPickerRef)
    endpoints: list[str]    # ip:port of each selected pod's target port
    failure_mode: str


def pool_endpoints(api, namespace: str, name: str) -> PoolEndpoints:
    """What a gateway reads from the InferencePool ``name``: the picker Service's address and port, the
    selected pods' addresses at the pool's target port, and the failure mode."""
    from kubernetes import client

    pool = client.CustomObjectsApi(api).get_namespaced_custom_object(
        "inference.networking.k8s.io", "v1", namespace, "inferencepools", name)
    spec = pool["spec"]
    ref = spec["endpointPickerRef"]
    core = client.CoreV1Api(api)
    svc = core.read_namespaced_service(ref["name"], namespace)
    selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    port = spec["targetPorts"][0]["number"]
    pods = [p for p in core.list_namespaced_pod(namespace, label_selector=selector).items
            if p.status.pod_ip and p.metadata.deletion_timestamp is None]
    return PoolEndpoints(f"{svc.spec.cluster_ip}:{ref['port']['number']}",
                         sorted(f"{p.status.pod_ip}:{port}" for p in pods), ref.get("failureMode", FAIL_CLOSE))


class Envoy:
    """An Envoy process on loopback with :func:`envoy_config`'s configuration (keyword arguments); its
    process, log and stop are a :class:`~disagg.workers.local.LocalProcess`'s, ready when its admin port
    says so."""

    def __init__(self, directory: Path, *, concurrency: int = 2, binary: Path | None = None, **config) -> None:
        from disagg.workers.local import LocalProcess

        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = envoy_config(**config)
        self.port = config["port"]
        self.admin_port = config["admin_port"]
        path = self.dir / "envoy.yaml"
        path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        # a dynamic base id: several Envoys on one machine (parallel test runs) never share hot-restart memory
        self.process = LocalProcess("envoy", [str(binary or envoy_binary()), "-c", str(path), "--concurrency",
                                              str(concurrency), "--use-dynamic-base-id", "--log-level", "warn"],
                                    {}, f"http://127.0.0.1:{self.admin_port}", self.dir)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> Envoy:
        self.process.start().wait_ready(timeout, path="/ready")
        return self

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters and gauges (admin /stats), those starting with ``prefix``."""
        with urllib.request.urlopen(f"{self.process.url}/stats?format=text", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            key, _, value = line.partition(": ")
            if key.startswith(prefix) and value.strip().lstrip("-").isdigit():
                out[key] = int(value)
        return out

    def stop(self) -> None:
        self.process.stop()

    def tail(self, lines: int = 30) -> str:
        return self.process.tail(lines)

    def __enter__(self) -> Envoy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
