"""``python -m disagg.router``: runs the router.

    python -m disagg.router --config router.yaml                   # a RouterConfig (static workers)
    python -m disagg.router --model m --tokenizer hf://org/m --block-size 32 --discovery endpointslices \\
        --namespace ns --prefill-service x-prefill --decode-service x-decode [--policy kv-aware ...]

The second form is what the operator runs in the router Deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys

import uvloop
import yaml
from aiohttp import web

from disagg.api.contract import DRAIN_SECONDS
from disagg.api.names import ROLE_DECODE, ROLE_FLEX, ROLE_PREFILL, local_model_path

from .app import make_app
from .config import RouterConfig
from .processes import LIVENESS_S


# flag -> type; each is spec.router's field of the same name in camelCase
_LIMITS = (("max-in-flight", int), ("max-queued", int), ("queue-timeout-seconds", float),
           ("connect-timeout-seconds", float), ("first-token-timeout-seconds", float),
           ("idle-timeout-seconds", float), ("request-timeout-seconds", float), ("max-migrations", int),
           ("max-body-bytes", int), ("body-timeout-seconds", float), ("processes", int),
           ("prefill-timeout-seconds", float))


def _camel(flag: str) -> str:
    head, *rest = flag.split("-")
    return head + "".join(w.title() for w in rest)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m disagg.router")
    p.add_argument("--config", help="YAML or JSON RouterConfig")
    p.add_argument("--port", type=int)
    p.add_argument("--metrics-port", type=int,
                   help="also serve /metrics and /livez alone on this port; with --processes N, process i "
                        "serves them on this port + i (the serving port's /metrics reaches one process)")
    p.add_argument("--model")
    p.add_argument("--tokenizer")
    p.add_argument("--policy")
    p.add_argument("--overlap-weight", type=float)
    p.add_argument("--max-load-skew", type=float)
    p.add_argument("--disaggregation")
    p.add_argument("--local-prefill-threshold-tokens", type=int)
    # admission control and timeouts (spec.router)
    for flag, kind in _LIMITS:
        p.add_argument(f"--{flag}", type=kind)
    p.add_argument("--block-size", type=int, help="the workers' KV block size (vLLM --block-size)")
    p.add_argument("--max-model-len", type=int,
                   help="the workers' context length (default: learned from their /v1/models)")
    p.add_argument("--kv-events-topic", help="ZMQ topic of the workers' KV events")
    p.add_argument("--api-keys-file", help="API keys clients must send as 'Authorization: Bearer', one a line "
                                           "(spec.router.auth); re-read when it changes")
    p.add_argument("--otlp-traces-endpoint",
                   help="trace each request (OpenTelemetry, router/tracing.py) and export the spans over OTLP/gRPC "
                        "to this endpoint, e.g. http://127.0.0.1:4317 (spec.tracing.otlpEndpoint); off if unset")
    p.add_argument("--trace-sampling-ratio", type=float,
                   help="share of requests traced, 0..1 (spec.tracing.samplingRatio; default 1)")
    p.add_argument("--worker-ca-file", help="PEM certificate authorities for https:// workers (in place of the "
                                            "system's trust store)")
    p.add_argument("--max-loras", type=int, help="the workers' LoRA adapter slots (spec.model.maxLoras)")
    p.add_argument("--adapters-file", help="JSON object of LoRA adapter name -> source, re-read when it changes "
                                           "(local runs; with --discovery endpointslices the DisaggDeployment's "
                                           "spec.model.adapters are read instead)")
    p.add_argument("--discovery", choices=["static", "endpointslices"], default="static")
    p.add_argument("--event-loop", choices=["uvloop", "asyncio"], default="uvloop",
                   help="asyncio: Python's own loop (to compare; bench/router_vs_vllm_router.py)")
    p.add_argument("--reuse-port", action="store_true",
                   help="SO_REUSEPORT: several router processes on one port, the kernel spreading connections "
                        "over them (each its own event loop, admission, load and KV index from the same events; "
                        "each its own /metrics: see --metrics-port); --processes starts them")
    p.add_argument("--process-liveness-seconds", type=float, default=LIVENESS_S,
                   help="with --processes N and --metrics-port: a process that has not answered /livez on its "
                        "metrics port this long is killed and the replica stops (exits non-zero), so the kubelet "
                        "restarts it; the pod's own probe reaches only one process through the shared port")
    p.add_argument("--drain-seconds", type=float, default=DRAIN_SECONDS,
                   help="on SIGTERM, how long requests in flight may finish (streams included) before they are cut; "
                        "the pod's grace period covers it (disagg.api.contract.termination_grace_seconds)")
    p.add_argument("--mode", choices=["proxy", "picker"], default="proxy",
                   help="picker: also the endpoint picker of a Gateway API Inference Extension gateway (Envoy's "
                        "ext_proc over gRPC on --grpc-port), which then carries the streams to the decode workers")
    p.add_argument("--grpc-port", type=int, default=9002, help="picker mode: the ext_proc and gRPC health port")
    p.add_argument("--namespace", default="default")
    p.add_argument("--prefill-service")
    p.add_argument("--decode-service")
    p.add_argument("--flex-drain-seconds", type=float,
                   help="spec.flex.switchDrainSeconds: longest a flex worker's role switch waits for its drain")
    p.add_argument("--flex-service", help="with --discovery endpointslices and spec.flex: the flex workers' Service "
                                          "(each used in its pod's serving-role label)")
    p.add_argument("--deployment", help="with --discovery endpointslices: the DisaggDeployment whose worker pods "
                                        "are listed (by its label); default: the one the Services are named after")
    return p


def config_from(args: argparse.Namespace) -> RouterConfig:
    data: dict = {}
    if args.config:
        with open(args.config) as f:
            data = yaml.safe_load(f) or {}
    spec = dict(data.get("spec") or {})
    for flag, key in (("policy", "policy"), ("overlap_weight", "overlapWeight"),
                      ("max_load_skew", "maxLoadSkew"), ("disaggregation", "disaggregation"),
                      ("local_prefill_threshold_tokens", "localPrefillThresholdTokens")):
        if getattr(args, flag) is not None:
            spec[key] = getattr(args, flag)
    for flag, _ in _LIMITS:
        if getattr(args, flag.replace("-", "_")) is not None:
            spec[_camel(flag)] = getattr(args, flag.replace("-", "_"))
    data["spec"] = spec
    if args.model:
        data["model"] = args.model
    if args.tokenizer:
        data["tokenizer"] = local_model_path(args.tokenizer)
    if args.otlp_traces_endpoint or args.trace_sampling_ratio is not None:
        tracing = dict(data.get("tracing") or {})
        if args.otlp_traces_endpoint:
            tracing["otlpEndpoint"] = args.otlp_traces_endpoint
        if args.trace_sampling_ratio is not None:
            tracing["samplingRatio"] = args.trace_sampling_ratio
        data["tracing"] = tracing
    for flag in ("port", "metrics_port", "block_size", "max_model_len", "kv_events_topic", "api_keys_file",
                 "worker_ca_file", "flex_drain_seconds", "max_loras", "adapters_file"):
        if getattr(args, flag) is not None:
            data[flag] = getattr(args, flag)
    return RouterConfig.model_validate(data)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = config_from(args)
    logging.basicConfig(level=logging.INFO, format='{"ts":"%(asctime)s","level":"%(levelname)s",'
                                                  '"logger":"%(name)s","msg":"%(message)s"}')
    if config.spec.processes > 1:      # a parent that only starts and watches the processes (processes.py)
        from .processes import supervise

        return supervise(sys.argv[1:] if argv is None else list(argv), config.spec.processes,
                         config.spec.max_in_flight, config.spec.max_queued, config.metrics_port,
                         args.process_liveness_seconds, config.host)
    discovery = None
    if args.discovery == "endpointslices":
        if not (args.prefill_service and args.decode_service):
            print("--discovery endpointslices needs --prefill-service and --decode-service", file=sys.stderr)
            return 2
        from kubernetes import config as kconfig

        from disagg.api.kube import api_client

        from .discovery import EndpointSliceDiscovery

        try:
            kconfig.load_incluster_config()
        except kconfig.ConfigException:
            kconfig.load_kube_config()
        try:
            discovery = EndpointSliceDiscovery(api_client(), args.namespace,
                                               {ROLE_PREFILL: args.prefill_service, ROLE_DECODE: args.decode_service,
                                                **({ROLE_FLEX: args.flex_service} if args.flex_service else {})},
                                               deployment=args.deployment)
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
    if args.mode == "picker":
        # thousands of live streams, each a task and gRPC objects: the cyclic GC walking them was 15% of
        # the picker's samples at 1,000 streams (py-spy); what exists at start-up is never garbage, and
        # collections can be rarer (bench/results/envoy-picker-2026-12-04.md: -10% CPU per request)
        gc.set_threshold(50_000, 20, 100)
    try:
        app = make_app(config, discovery=discovery, reuse_port=args.reuse_port,
                       picker_port=args.grpc_port if args.mode == "picker" else None)
    except OSError as e:         # the API keys file: a router told to authenticate never starts open
        print(f"cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    if args.mode == "picker":
        gc.freeze()
    # a deep accept backlog: a burst of a thousand clients connecting at once must not be refused
    # uvloop: the relay's cost is mostly the event loop's socket reads and writes (the profile at 1,000
    # streams, bench/router_vs_vllm_router.py), which libuv does in C
    # shutdown_timeout: aiohttp stops accepting at SIGTERM, then lets in-flight streams run this long
    web.run_app(app, host=config.host, port=config.port, access_log=None, shutdown_timeout=args.drain_seconds,
                print=None, backlog=4096, reuse_port=args.reuse_port or None,
                loop=uvloop.new_event_loop() if args.event_loop == "uvloop" else asyncio.new_event_loop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
