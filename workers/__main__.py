"""``python -m disagg.workers``: the prefill/decode pod's entrypoint.

    python -m disagg.workers --role prefill --model /models/x [flags] [-- vLLM args]   # serve
    python -m disagg.workers command --role decode --model /models/x                 # print the vLLM command
    python -m disagg.workers tiny-model                                              # make the test model

Settings come from ``DISAGG_*`` variables (see :class:`WorkerSettings`), then flags; the pod IP
(``POD_IP``) is what peers reach the NIXL side channel and KV events on.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from disagg import redact
from disagg.api.names import local_model_path

from .command import build
from .settings import WorkerSettings

ACTIONS = ("serve", "command", "tiny-model")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m disagg.workers")
    p.add_argument("action", nargs="?", choices=ACTIONS, default="serve")
    p.add_argument("--role", choices=["prefill", "decode", "flex"])
    p.add_argument("--model")
    p.add_argument("--served-model-name")
    p.add_argument("--tokenizer")
    p.add_argument("--revision")
    p.add_argument("--tensor-parallel-size", type=int)
    p.add_argument("--port", type=int)
    p.add_argument("--kv-connector", choices=["NixlConnector"])
    p.add_argument("--kv-buffer-device", choices=["auto", "cuda", "cpu"])
    p.add_argument("--nixl-backends", help="comma-separated, in order of preference")
    p.add_argument("--metrics-port", type=int, help="serve vLLM's /metrics alone on this port too")
    p.add_argument("--nixl-side-channel-port", type=int)
    p.add_argument("--kv-events-port", type=int)
    p.add_argument("--kv-replay-port", type=int, help="where vLLM resends KV event batches a router missed")
    p.add_argument("--kv-offload-cpu-gib", type=float)
    p.add_argument("--kv-offload-disk-gib", type=float)
    p.add_argument("--block-size", type=int, help="KV block size (the router hashes the same)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--drain-seconds", type=int, help="vLLM's --shutdown-timeout: how long a SIGTERM drains")
    p.add_argument("--otlp-traces-endpoint", help="export vLLM's request spans over OTLP/gRPC there (spec.tracing)")
    p.add_argument("--trace-sampling-ratio", type=float,
                   help="share of requests without a traceparent traced (spec.tracing.samplingRatio)")
    p.add_argument("--python", default=None, help="the worker environment's Python (default: this one)")
    return p


def settings_from(args: argparse.Namespace, engine_args: list[str]) -> WorkerSettings:
    extra = []
    if args.tensor_parallel_size:
        extra += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.tokenizer:
        extra += ["--tokenizer", local_model_path(args.tokenizer)]
    if args.revision:
        extra += ["--revision", args.revision]
    if args.model and args.model.startswith("s3://") and not any(a.startswith("--load-format") for a in engine_args):
        # vLLM streams s3:// weights with the Run:ai model streamer (credentials from the environment)
        extra += ["--load-format", "runai_streamer"]
    base = WorkerSettings.from_env() if "DISAGG_ROLE" in os.environ and "DISAGG_MODEL" in os.environ else None
    overrides = dict(
        role=args.role, model=local_model_path(args.model) if args.model else None,
        served_model_name=args.served_model_name, port=args.port, kv_buffer_device=args.kv_buffer_device,
        nixl_backends=args.nixl_backends.split(",") if args.nixl_backends else None,
        metrics_port=args.metrics_port, nixl_port=args.nixl_side_channel_port,
        kv_events_port=args.kv_events_port,
        kv_replay_port=args.kv_replay_port,
        offload_cpu_gib=args.kv_offload_cpu_gib,
        offload_disk_gib=args.kv_offload_disk_gib, block_size=args.block_size, max_model_len=args.max_model_len,
        drain_seconds=args.drain_seconds, otlp_traces_endpoint=args.otlp_traces_endpoint,
        trace_sampling_ratio=args.trace_sampling_ratio,
        advertise_host=os.environ.get("POD_IP") or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST"))
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if base is not None:
        s = base.model_copy(update=overrides)
        s = WorkerSettings.model_validate(s.model_dump())
    else:
        s = WorkerSettings.from_env(**overrides)
    if extra or engine_args:
        s = s.model_copy(update={"engine_args": [*s.engine_args, *extra, *engine_args]})
    return s


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, engine_args = argv[:i], argv[i + 1:]
    args = _parser().parse_args(argv)

    if args.action == "tiny-model":
        from .envpath import worker_python
        from .tinymodel import ensure

        print(ensure(worker_python()))
        return 0
    settings = settings_from(args, engine_args)
    if args.action == "serve":
        from .leader import LEADER_WAIT_SECONDS, resolve_leader_flags
        from .supervisor import log

        # a replica's other pods reach its leader by IP (vLLM's ZMQ resolves no names): wait for it here
        settings = settings.model_copy(update={"engine_args": resolve_leader_flags(
            settings.engine_args, LEADER_WAIT_SECONDS, log=log)})
    cmd = build(settings, python=args.python or sys.executable)
    if args.action == "command":
        print(json.dumps({"argv": shlex.join(redact.argv(cmd.argv)), "env": redact.env(cmd.env)}, indent=2))
        return 0
    from .supervisor import run

    if settings.metrics_port:
        from .metrics_port import serve

        serve(settings.metrics_port, settings.port, host=settings.host)
    return run(cmd, settings.drain_seconds)


if __name__ == "__main__":
    sys.exit(main())
