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
* Drain: every worker runs vLLM with ``--shutdown-timeout`` :data:`DRAIN_SECONDS`; the pod's
  ``terminationGracePeriodSeconds`` is :func:`termination_grace_seconds` of it, the extra being the
  time the worker's supervisor gives vLLM to exit after its drain before it kills it.
"""

from __future__ import annotations

from collections.abc import Sequence

# A size every vLLM 0.32 attention backend takes: CUDA's want multiples of 16, the CPU kernels
# multiples of 32 (vllm/v1/attention/backends/cpu_attn.py).
DEFAULT_BLOCK_SIZE = 32
# How long a worker lets in-flight requests finish (and a prefill's KV be pulled) after SIGTERM.
DRAIN_SECONDS = 120
# After the drain, how long vLLM has to shut down before the supervisor kills it (and before the
# kubelet would): process teardown, NIXL deregistration.
DRAIN_MARGIN_SECONDS = 30

# The ZMQ topic workers publish their KV events on and routers subscribe to.
KV_EVENTS_TOPIC = "kv-events"
# Where a worker's vLLM answers requests to resend KV event batches a router missed (its KV events'
# replay_endpoint; container and Service port "kv-replay"): a router heals its prefix index from it.
KV_REPLAY_PORT = 5558
# HTTP paths the pods' probes use: vLLM's health (its engine is alive and serving), the router's
# readiness (it can serve: a healthy decode worker) and its liveness (the process answers).
WORKER_HEALTH_PATH = "/health"
ROUTER_READY_PATH = "/health"
ROUTER_LIVE_PATH = "/livez"

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
    """The pod's grace period for a worker draining for ``drain_seconds``."""
    return drain_seconds + DRAIN_MARGIN_SECONDS


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
