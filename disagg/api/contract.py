"""What the operator's pod specs, the router and the workers must agree on, and where each value comes
from. Decided once, here; the operator renders from it, the router and workers read it, and the contract
test (tests/test_operator_contract.py) parses what the operator renders with the real entrypoints.

* KV block size: ``--block-size`` in ``spec.engine.args`` when given, else :data:`DEFAULT_BLOCK_SIZE`.
  The operator always passes it to both workers explicitly, because vLLM's own default depends on
  the backend (vLLM 0.32: 16 on CUDA, 128 on the CPU build), and passes the same value to the router,
  which hashes prompt blocks of that size to match the KV events workers publish.
* Context length: ``--max-model-len`` in ``spec.engine.args`` when given, and the router is told the
  same. When not given, nobody guesses: vLLM derives it from the model's config, and the router learns
  that effective value from the workers' ``/v1/models`` (``max_model_len``) before it refuses anything
  for length.
* Neither may appear in one role's ``extraArgs`` (admission refuses it, see :data:`SHARED_ENGINE_FLAGS`):
  prefill and decode must agree on both, or a prefilled KV would not fit the decode's blocks and the
  router could accept a prompt one side refuses.
* Drain: a terminating worker pod first keeps serving for :data:`ENDPOINT_GRACE_SECONDS` (its preStop
  sleep), until every router has seen it leave; then vLLM runs its drain, ``--shutdown-timeout``
  :data:`DRAIN_SECONDS`. The pod's ``terminationGracePeriodSeconds`` is :func:`termination_grace_seconds`
  of it: both, plus the time the worker's supervisor gives vLLM to exit after its drain before it kills it.
"""

from __future__ import annotations

from collections.abc import Sequence

# A size every vLLM 0.32 attention backend takes: CUDA's want multiples of 16, the CPU kernels
# multiples of 32 (vllm/v1/attention/backends/cpu_attn.py).
DEFAULT_BLOCK_SIZE = 32
# How long a worker lets in-flight requests finish (and a prefill's KV be pulled) after SIGTERM.
DRAIN_SECONDS = 120
# How often a router re-reads its workers' EndpointSlices (and the pods behind them).
DISCOVERY_INTERVAL_SECONDS = 5.0
# How long a terminating worker keeps serving new requests before its drain begins (the pod's preStop
# sleep). A router sends to it until its next discovery poll sees it terminating, and a vLLM that has begun
# its drain refuses new requests (HTTP 500, "cannot schedule new futures after shutdown"): two polls.
ENDPOINT_GRACE_SECONDS = int(2 * DISCOVERY_INTERVAL_SECONDS)
# After the drain, how long vLLM has to shut down before the supervisor kills it (and before the
# kubelet would): process teardown, NIXL deregistration.
DRAIN_MARGIN_SECONDS = 30

# The ZMQ topic workers publish their KV events on and routers subscribe to.
KV_EVENTS_TOPIC = "kv-events"
# How long a prefill keeps KV blocks nobody pulled (NixlConnector's kv_lease_duration, which a decode holding
# the request extends by heartbeats): the workers start vLLM with it and the router waits for it when a flex
# worker's switch drains blocks a decode gave up on.
KV_LEASE_SECONDS = 30
# Where a worker's vLLM answers requests to resend KV event batches a router missed (its KV events'
# replay_endpoint; container and Service port "kv-replay"): a router heals its prefix index from it.
KV_REPLAY_PORT = 5558
# The port workers and routers serve HTTP on (vLLM's OpenAI API; the router's), in their pods.
HTTP_PORT = 8000
# HTTP paths the pods' probes use: vLLM's health (its engine is alive and serving), the router's
# readiness (it can serve: a healthy decode worker) and its liveness (the process answers).
WORKER_HEALTH_PATH = "/health"
# vLLM serves /metrics on its API port, and a NetworkPolicy cannot tell paths apart: admitting Prometheus to
# that port would admit it to the model API, past the router's keys. So each worker pod also serves
# /metrics alone on this port (the supervisor relays vLLM's, workers/metrics_port.py), the container port
# named WORKER_METRICS_PORT_NAME, and Prometheus is admitted to this port only (operator/render.py).
WORKER_METRICS_PORT = 9400
WORKER_METRICS_PORT_NAME = "metrics"
ROUTER_READY_PATH = "/health"
ROUTER_LIVE_PATH = "/livez"
# A router replica runs spec.router.processes processes on one serving port; a scrape of that port would
# reach one of them, so process i also serves /metrics (and /livez) alone on ROUTER_METRICS_PORT + i,
# the container port named router_metrics_port_name(i). The chart's router PodMonitor keeps every port
# whose name matches ROUTER_METRICS_PORT_NAMES (charts/disagg/templates/monitors.yaml spells it out).
ROUTER_METRICS_PORT = 9200
ROUTER_METRICS_PORT_NAMES = "metrics-[0-9]+"


def router_metrics_port_name(process: int) -> str:
    return f"metrics-{process}"

# The user every pod the operator renders runs as (never root): the uid and gid the Dockerfile's images
# create (`useradd --uid`; tests/test_dockerfile.py keeps the two equal).
RUN_AS_USER = 10001
# Router and worker containers have a read-only root filesystem; this directory is an emptyDir, the one
# place they write. Every cache is pointed into it by name rather than left to each library's default
# under a HOME the image may not have (vLLM's compile and config caches, Triton's kernels, the Hugging
# Face download of weights and tokenizers for hf:// sources, ZMQ's IPC sockets and Python's tempfiles
# under TMPDIR). A variable of the same name in spec.engine.env wins.
SCRATCH_DIR = "/tmp"
SCRATCH_ENV = {
    "HOME": SCRATCH_DIR,
    "TMPDIR": SCRATCH_DIR,
    "XDG_CACHE_HOME": f"{SCRATCH_DIR}/.cache",
    "XDG_CONFIG_HOME": f"{SCRATCH_DIR}/.config",
    "HF_HOME": f"{SCRATCH_DIR}/huggingface",
    "VLLM_CACHE_ROOT": f"{SCRATCH_DIR}/.cache/vllm",
    "VLLM_CONFIG_ROOT": f"{SCRATCH_DIR}/.config/vllm",
    "TRITON_CACHE_DIR": f"{SCRATCH_DIR}/.triton/cache",
    # no .pyc writes into the read-only image (they would fail anyway, on every start)
    "PYTHONDONTWRITEBYTECODE": "1",
}

BLOCK_SIZE_FLAG = "--block-size"
MAX_MODEL_LEN_FLAG = "--max-model-len"
# vLLM's parser takes either spelling of a flag (underscores become dashes)
SHARED_ENGINE_FLAGS = (BLOCK_SIZE_FLAG, "--block_size", MAX_MODEL_LEN_FLAG, "--max_model_len")


def termination_grace_seconds(drain_seconds: int = DRAIN_SECONDS) -> int:
    """The pod's grace period for a worker draining for ``drain_seconds``: the kubelet counts the preStop
    sleep in it."""
    return ENDPOINT_GRACE_SECONDS + drain_seconds + DRAIN_MARGIN_SECONDS


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in an argument list as vLLM's parser reads it (the last occurrence wins;
    ``--flag value``, ``--flag=value`` and the underscore spelling all count); None when absent."""
    spellings = {flag, "--" + flag[2:].replace("-", "_")}
    found = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name not in spellings:
            continue
        if eq:
            found = value
        elif i + 1 < len(args):
            found = args[i + 1]
    return found


def names_shared_flag(args: Sequence[str]) -> bool:
    """Whether ``args`` set a flag both roles must share (a role's extraArgs may not)."""
    return any(a.partition("=")[0] in SHARED_ENGINE_FLAGS for a in args)


def block_size(engine_args: Sequence[str]) -> int:
    """The KV block size the workers run with (ValueError when the args give a non-integer)."""
    value = flag_value(engine_args, BLOCK_SIZE_FLAG)
    if value is None:
        return DEFAULT_BLOCK_SIZE
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{BLOCK_SIZE_FLAG} must be a positive integer, not {value!r}")
    return int(value)


_SUFFIXES = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 1024, "M": 1024**2, "G": 1024**3}


def max_model_len(engine_args: Sequence[str]) -> int | None:
    """The context length the args fix, as vLLM reads it ("32768", "32k" = 32,000, "32K" = 32,768);
    None when they leave it to vLLM (absent, "auto" or -1: derived from the model and memory)."""
    value = flag_value(engine_args, MAX_MODEL_LEN_FLAG)
    if value is None or value.strip() in ("auto", "-1"):
        return None
    value = value.strip()
    scale = _SUFFIXES.get(value[-1:], 1)
    number = value[:-1] if scale != 1 else value
    try:
        tokens = int(float(number) * scale)
    except ValueError:
        raise ValueError(f"{MAX_MODEL_LEN_FLAG} must be a token count such as 32768 or 32k, not {value!r}") from None
    if tokens < 1:
        raise ValueError(f"{MAX_MODEL_LEN_FLAG} must be positive, not {value!r}")
    return tokens


# ---------------------------------------------------------------- KV revision
# A prefill's KV can be pulled by a decode only when both computed and laid it out the same way. The
# KV revision is a hash of exactly what decides that, computed here for every caller (the operator
# renders it onto the worker pods, `disagg serve --local` hands it to its router), so that the router
# pairs prefill and decode of one revision only. What counts:
#   * the weights: model source, revision, tokenizer (token ids must be the same ids);
#   * the engine build: the worker image (another vLLM may lay KV out differently);
#   * the transfer: connector, backends, buffer device (how a decode reads the prefill's memory);
#   * each role's tensor parallel size (heads per rank; both roles' sizes, so that a change of either
#     moves both roles to a new revision together);
#   * the engine arguments in KV_LAYOUT_FLAGS, in spec.engine.args and in each role's extraArgs.
# What does not count: everything else, notably the context length, batch and memory limits
# (--max-model-len, --max-num-seqs, --gpu-memory-utilization, ...), prefix caching, logging, and the
# replica counts: changing those keeps the revision, and the router keeps pairing across the change.
# An engine argument not in the list does not split pairing even if it should: add it here.
KV_LAYOUT_FLAGS = (
    "--dtype", "--kv-cache-dtype", "--quantization", "-q", "--block-size", "--tensor-parallel-size", "-tp",
    "--pipeline-parallel-size", "-pp", "--hf-overrides", "--rope-scaling", "--rope-theta", "--tokenizer",
    "--tokenizer-revision", "--revision", "--code-revision", "--attention-backend", "--calculate-kv-scales",
    "--kv-sharing-fast-prefill", "--model-impl", "--hf-config-path", "--override-attention-dtype",
    # which ranks hold which KV: data-parallel attention and expert parallel split it differently
    "--data-parallel-size", "-dp", "--enable-expert-parallel",
)
# The label (and worker env) carrying a worker's revision, and the label ordering revisions: the
# DisaggDeployment's metadata.generation when the operator first rendered that revision (kept while the
# revision stays the same, so scaling never re-rolls pods). The router sends new requests to the revision
# with the highest generation that has both roles ready.
KV_REVISION_LABEL = "serving.disagg.dev/kv-revision"
KV_REVISION_GENERATION_LABEL = "serving.disagg.dev/kv-revision-generation"
KV_REVISION_ENV = "DISAGG_KV_REVISION"
# During a rollout that changes the revision, the operator sets the worker Deployments' minReadySeconds
# to this while the new revision has no ready pair: new pods serve traffic once ready (the router sees
# them) but do not count as available, so the Deployment controller keeps every old pod (maxUnavailable
# is 0) until the operator lifts it, once a prefill and a decode of the new revision are ready.
ROLLOUT_HOLD_SECONDS = 86400


def kv_layout_args(args: Sequence[str]) -> list[str]:
    """The arguments of ``args`` that count for the KV revision (each counted flag with its value, in
    order; both spellings, ``--flag value`` and ``--flag=value``, normalised to ``--flag=value``)."""
    counted = {f for f in KV_LAYOUT_FLAGS} | {"--" + f[2:].replace("-", "_") for f in KV_LAYOUT_FLAGS
                                              if f.startswith("--")}
    out = []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name not in counted:
            continue
        name = "--" + name[2:].replace("_", "-") if name.startswith("--") else name
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("-"):
            value = args[i + 1]
        out.append(f"{name}={value}")
    return out


# Engine environment variables that cannot change what KV a worker computes or how it lays it out: logging
# and tracing. Every other variable of spec.engine.env counts for the KV revision (VLLM_KV_CACHE_LAYOUT,
# VLLM_ATTENTION_BACKEND, VLLM_USE_V2_MODEL_RUNNER, UCX_* and the like do, and a new one may): the engine's
# environment has no list of which variables matter, so the safe default is that all do, at the cost of
# a held rollout (not a rolling one) when only one of these harmless ones would have changed.
KV_NEUTRAL_ENV = frozenset({
    "VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_PREFIX",
    "VLLM_LOG_STATS_INTERVAL", "VLLM_TRACE_FUNCTION", "VLLM_DEBUG_LOG_API_SERVER_RESPONSE",
    "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "UCX_LOG_LEVEL", "NIXL_LOG_LEVEL", "PYTHONUNBUFFERED",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME",
})


def kv_env(env: dict[str, str] | Sequence[tuple[str, str]]) -> dict[str, str]:
    """The engine environment variables that count for the KV revision (all but KV_NEUTRAL_ENV)."""
    items = env.items() if isinstance(env, dict) else env
    return {k: v for k, v in items if k not in KV_NEUTRAL_ENV}


def kv_revision(*, model: str, model_revision: str | None, tokenizer: str | None, image: str,
                kv_transfer: dict, roles: dict[str, tuple[int, Sequence[str]]],
                engine_args: Sequence[str], engine_env: dict[str, str] | None = None) -> str:
    """The KV revision (16 hex digits) of workers built from these parts; ``roles`` maps each role to
    (tensor parallel size, its extra args); ``engine_env``: the engine's environment (kv_env picks what
    counts). Same parts, same revision, in any process."""
    import hashlib
    import json

    parts = {"model": model, "model_revision": model_revision, "tokenizer": tokenizer, "image": image,
             "kv_transfer": kv_transfer, "engine_args": kv_layout_args(engine_args),
             "roles": {role: [tp, kv_layout_args(extra)] for role, (tp, extra) in sorted(roles.items())}}
    env = kv_env(engine_env or {})
    if env:  # absent when empty, so a deployment without engine env keeps the revision it had
        parts["engine_env"] = env
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
