"""``python -m disagg.planner``: the planner sidecar (next to the operator, or on its own)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from .metrics_source import DEFAULT_SCRAPE_INTERVAL, parse_duration


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
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)

    from kubernetes import config
    from prometheus_client import start_http_server

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
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=metrics.registry)
    endpoints = Allowlist.load(args.prometheus_endpoints)
    sources: dict[str, PrometheusSource] = {}

    def source_for(endpoint: Endpoint) -> PrometheusSource:
        if endpoint.name not in sources:
            sources[endpoint.name] = PrometheusSource.for_endpoint(endpoint)
        return sources[endpoint.name]

    loop = PlannerLoop(api_client, Executor(api_client, metrics), source_for, endpoints, args.namespace,
                       scrape_interval=args.scrape_interval)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    loop.run(stop, args.tick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
