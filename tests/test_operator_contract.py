"""The contract between the pods the operator renders and the processes they run: every router and
worker setting a pod depends on is set by the operator from the spec, read back through the router's
and the worker's real argument parsers, and agrees across router, workers, ports, probes and Services.
Nothing is left to a default of one side that the other side does not share."""

from __future__ import annotations

import json

import pytest

from disagg.api import contract
from disagg.api.names import local_model_path
from disagg.api.v1alpha1 import DisaggDeployment
from disagg.e2e.testing import dd_manifest
from disagg.operator import render
from disagg.router.__main__ import _parser as router_parser
from disagg.router.__main__ import config_from
from disagg.workers.__main__ import _parser as worker_parser
from disagg.workers.__main__ import settings_from
from disagg.workers.command import build, kv_events_config

# The worker settings a pod depends on, each of which the operator must set (not leave to a default).
WORKER_SETTINGS = {"role", "model", "served_model_name", "port", "nixl_port", "kv_events_port",
                   "kv_replay_port", "kv_buffer_device", "nixl_backends", "block_size", "drain_seconds",
                   "metrics_port"}
ROUTER_SETTINGS = {"model", "tokenizer", "port", "block_size", "kv_events_topic", "spec"}


def _dd(**spec) -> DisaggDeployment:
    manifest = dd_manifest("demo", **spec)
    manifest["metadata"]["namespace"] = "ns"
    return DisaggDeployment.model_validate(manifest)


def _last(argv: list[str], flag: str) -> str | None:
    """A flag's value as vLLM's parser reads it: the last occurrence wins."""
    return contract.flag_value(argv, flag)


def _pods(dd: DisaggDeployment) -> dict[str, dict]:
    manifests, _ = render.children(dd, "uid")
    return {m["metadata"]["labels"]["serving.disagg.dev/role"]: m["spec"]["template"]["spec"]
            for m in manifests if m["kind"] == "Deployment"}


def _services(dd: DisaggDeployment) -> dict[str, dict]:
    return {s["metadata"]["name"]: s for s in render.services(dd, "uid")}


def _worker(pod: dict):
    c = pod["containers"][0]
    args = c["args"]
    split = args.index("--")
    settings = settings_from(worker_parser().parse_args(args[:split]), args[split + 1:])
    return c, settings, build(settings, python="python")


def _router(pod: dict):
    c = pod["containers"][0]
    parsed = router_parser().parse_args(c["args"])
    return c, parsed, config_from(parsed)


def _port(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


SPECS = {
    "engine-args-fix-both": dict(engine={"args": ["--max-model-len", "32768", "--block-size=32"]},
                                 model={"name": "llama", "source": "hf://org/llama", "tokenizer": "pvc://toks/llama"}),
    "engine-args-fix-neither": dict(model={"name": "tiny", "source": "/models/tiny"}),
    "human-readable-length": dict(engine={"args": ["--max_model_len=32k"]}),
}


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_router_and_workers_agree_on_everything_a_pod_depends_on(spec):
    dd = _dd(**spec)
    pods = _pods(dd)
    rc, rparsed, router = _router(pods["router"])
    want_block = contract.block_size(dd.spec.engine.args)
    want_len = contract.max_model_len(dd.spec.engine.args)

    # the router: set from the spec, not defaulted
    assert ROUTER_SETTINGS <= router.model_fields_set, ROUTER_SETTINGS - router.model_fields_set
    assert router.model == dd.spec.model.name
    assert router.tokenizer == local_model_path(dd.spec.model.tokenizer or dd.spec.model.source)
    assert router.port == _port(rc, "http")
    assert router.block_size == want_block
    assert router.max_model_len == want_len
    assert rparsed.discovery == "endpointslices" and rparsed.namespace == "ns"
    services = _services(dd)
    assert {rparsed.prefill_service, rparsed.decode_service} <= set(services)
    # the router's probes: readiness on its readiness path, liveness on its own, both on its port
    assert rc["readinessProbe"]["httpGet"] == {"path": contract.ROUTER_READY_PATH, "port": "http"}
    assert rc["livenessProbe"]["httpGet"] == {"path": contract.ROUTER_LIVE_PATH, "port": "http"}
    assert contract.ROUTER_LIVE_PATH != contract.ROUTER_READY_PATH
    front = services["demo"]["spec"]["ports"][0]
    assert front["targetPort"] == "http"

    for role in ("prefill", "decode"):
        c, settings, cmd = _worker(pods[role])
        assert WORKER_SETTINGS <= settings.model_fields_set, (role, WORKER_SETTINGS - settings.model_fields_set)
        argv = cmd.argv
        # what vLLM finally runs with, read as vLLM reads its argv
        assert int(_last(argv, "--block-size")) == want_block == router.block_size
        if want_len is None:
            assert _last(argv, "--max-model-len") is None       # vLLM derives it; the router learns it
        else:
            assert contract.max_model_len(argv) == want_len == router.max_model_len
        assert _last(argv, "--served-model-name") == router.model
        assert _last(argv, "--model") == local_model_path(dd.spec.model.source)
        if dd.spec.model.tokenizer:
            assert _last(argv, "--tokenizer") == router.tokenizer
        # ports: vLLM's, the container's, the probes' and the role Service's
        assert int(_last(argv, "--port")) == settings.port == _port(c, "http")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": contract.WORKER_HEALTH_PATH, "port": "http"}
        assert settings.metrics_port == contract.WORKER_METRICS_PORT == _port(c, contract.WORKER_METRICS_PORT_NAME)
        assert settings.metrics_port != settings.port, "the metrics port serves /metrics alone, not the API"
        assert cmd.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(settings.nixl_port) == str(_port(c, "nixl"))
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
        events = json.loads(_last(argv, "--kv-events-config"))
        assert events["endpoint"] == f"tcp://*:{_port(c, 'kv-events')}" == kv_events_config(settings)["endpoint"]
        assert events["topic"] == router.kv_events_topic
        assert events["replay_endpoint"] == f"tcp://*:{_port(c, 'kv-replay')}" == \
            kv_events_config(settings)["replay_endpoint"]
        svc_ports = {p["name"]: p for p in services[f"demo-{role}"]["spec"]["ports"]}
        for name in ("http", "nixl", "kv-events", "kv-replay"):
            assert svc_ports[name]["port"] == _port(c, name) and svc_ports[name]["targetPort"] == name
        # one drain budget: vLLM's shutdown timeout, the supervisor's and the kubelet's grace period
        assert int(_last(argv, "--shutdown-timeout")) == settings.drain_seconds == contract.DRAIN_SECONDS
        grace = pods[role]["terminationGracePeriodSeconds"]
        assert grace == contract.termination_grace_seconds(settings.drain_seconds)
        assert grace > settings.drain_seconds


def test_a_role_may_not_set_what_both_roles_must_share():
    from pydantic import ValidationError

    for args in (["--block-size", "32"], ["--max-model-len=8192"], ["--max_model_len", "8192"]):
        with pytest.raises(ValidationError, match="extraArgs may not set"):
            _dd(decode={"replicas": 1, "extraArgs": args})
    _dd(decode={"replicas": 1, "extraArgs": ["--max-num-seqs", "256"]})  # others stay per role


@pytest.mark.parametrize("args,block,length", [
    ([], contract.DEFAULT_BLOCK_SIZE, None),
    (["--block-size", "32", "--max-model-len", "4096"], 32, 4096),
    (["--block-size", "32", "--block-size", "64"], 64, None),       # the last one wins, as in vLLM
    (["--max-model-len", "32K"], contract.DEFAULT_BLOCK_SIZE, 32768),
    (["--max-model-len", "auto"], contract.DEFAULT_BLOCK_SIZE, None),
])
def test_engine_args_are_read_as_vllm_reads_them(args, block, length):
    assert contract.block_size(args) == block and contract.max_model_len(args) == length


def test_an_unreadable_block_size_is_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="--block-size must be a positive integer"):
        _dd(engine={"args": ["--block-size", "big"]})


def test_spec_tracing_reaches_the_router_and_both_engines():
    """spec.tracing: the router traces to the endpoint at the ratio, and both workers' vLLM exports its spans
    there (--otlp-traces-endpoint), named by role and sampling as the router does; without it, no component
    traces."""
    dd = _dd(tracing={"otlpEndpoint": "http://otel-collector.monitoring:4317", "samplingRatio": 0.25})
    pods = _pods(dd)
    _, _, router = _router(pods["router"])
    assert (router.tracing.otlp_endpoint, router.tracing.sampling_ratio) == (dd.spec.tracing.otlp_endpoint, 0.25)
    for role in ("prefill", "decode"):
        _, settings, cmd = _worker(pods[role])
        assert _last(cmd.argv, "--otlp-traces-endpoint") == "http://otel-collector.monitoring:4317"
        assert "--collect-detailed-traces" not in cmd.argv
        assert cmd.env["OTEL_SERVICE_NAME"] == f"vllm-{role}"
        assert (cmd.env["OTEL_TRACES_SAMPLER"], float(cmd.env["OTEL_TRACES_SAMPLER_ARG"])) == \
            ("parentbased_traceidratio", 0.25)
    pods = _pods(_dd())
    assert _router(pods["router"])[2].tracing is None
    for role in ("prefill", "decode"):
        _, _, cmd = _worker(pods[role])
        assert "--otlp-traces-endpoint" not in cmd.argv and "OTEL_SERVICE_NAME" not in cmd.env
