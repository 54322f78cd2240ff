"""``python -m disagg.planner``: the planner sidecar (next to the operator, or on its own).

Its metrics port serves ``/metrics`` and :data:`HEALTH_PATH`, the liveness probe's: 200 while the loop makes
progress, 503 once it has made none for ``--stall-seconds``. ``/metrics`` is answered by a thread of the HTTP
server whatever the loop does, so a probe of it would keep a hung planner alive.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any, Callable
from wsgiref.simple_server import WSGIRequestHandler

from .metrics_source import DEFAULT_SCRAPE_INTERVAL, parse_duration

HEALTH_PATH = "/healthz"
# Progress comes at least this often even on a bad day: one deployment's Prometheus queries (5 s timeout
# each) and Kubernetes calls, or a list retried to four read timeouts (KUBE_REQUEST_TIMEOUT); only a hung
# loop goes longer
DEFAULT_STALL_SECONDS = 300.0


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # (a probe every 20 s is not worth a log line)
        pass


def serve(port: int, registry: Any, stalled_for: Callable[[], float], stall_seconds: float,
          addr: str = "0.0.0.0") -> Any:
    """The metrics port: ``/metrics`` (prometheus_client's app) and :data:`HEALTH_PATH`, in a daemon thread.
    Returns the server (``shutdown()`` stops it)."""
    from wsgiref.simple_server import make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable) -> list[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return metrics_app(environ, start_response)
        stalled = stalled_for()
        ok = stalled <= stall_seconds
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
        return [f"{'ok' if ok else 'stalled'}: last progress {stalled:.0f}s ago (limit {stall_seconds:g}s)\n"
                .encode()]

    httpd = make_server(addr, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, name="planner-metrics", daemon=True).start()
    return httpd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m disagg.planner", description="The disagg SLO planner.")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then ~/.kube/config)")
    p.add_argument("--namespace", action="append", default=[],
                   help="plan only in this namespace (repeatable; default: all namespaces)")
    p.add_argument("--prometheus-endpoints", default=None, metavar="FILE",
                   help="the Prometheus endpoints deployments may name in spec.planner.prometheus, and the default "
                        "(disagg/planner/endpoints.py; the chart's planner.prometheusEndpoints); none: no metrics")
    p.add_argument("--metrics-port", type=int, default=9091, help="port of the planner's own /metrics (0: off)")
    p.add_argument("--scrape-interval", type=parse_duration, default=DEFAULT_SCRAPE_INTERVAL, metavar="DURATION",
                   help="how often Prometheus scrapes the routers and workers (15s, 1m, or seconds): the planner's "
                        "rate() windows span at least four of them (default: %(default)gs)")
    p.add_argument("--tick", type=float, default=5.0, help="seconds between passes over the deployments")
    p.add_argument("--stall-seconds", type=float, default=DEFAULT_STALL_SECONDS,
                   help=f"{HEALTH_PATH} on the metrics port answers 503 once the loop has made no progress (a pass "
                        "ended, or a deployment handled) for this long (default: %(default)gs)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="OTLP/gRPC endpoint (http://collector:4317) to export each decision to as a span, with the "
                        "PromQL it read and the values (disagg/planner/tracing.py; default: off)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)

    from kubernetes import config

    from .apply import Executor, PlannerMetrics
    from .endpoints import Allowlist, Endpoint
    from .loop import PlannerLoop
    from .metrics_source import PrometheusSource

    if args.kubeconfig:
        api_client = config.new_client_from_config(args.kubeconfig)
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        from kubernetes import client
        api_client = client.ApiClient()
    metrics = PlannerMetrics()
    endpoints = Allowlist.load(args.prometheus_endpoints)
    sources: dict[str, PrometheusSource] = {}

    def source_for(endpoint: Endpoint) -> PrometheusSource:
        if endpoint.name not in sources:
            sources[endpoint.name] = PrometheusSource.for_endpoint(endpoint)
        return sources[endpoint.name]

    tracer = None
    if args.otlp_traces_endpoint:
        from .tracing import DecisionTracer
        tracer = DecisionTracer(args.otlp_traces_endpoint)
    loop = PlannerLoop(api_client, Executor(api_client, metrics), source_for, endpoints, args.namespace,
                       scrape_interval=args.scrape_interval, tracer=tracer)
    if args.metrics_port:
        serve(args.metrics_port, metrics.registry, loop.stalled_for, args.stall_seconds)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    loop.run(stop, args.tick)
    if tracer is not None:   # the last decisions' spans, before the process ends
        tracer.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
