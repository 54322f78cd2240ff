"""A worker's settings: what the operator (or `disagg serve --local`) tells one
prefill or decode pod, read from ``DISAGG_*`` environment variables or flags.

The mapping to vLLM's own flags and environment lives in :mod:`.command`.
"""

from __future__ import annotations

import json
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from disagg.api.contract import DRAIN_SECONDS, KV_LEASE_SECONDS, KV_REPLAY_PORT
from disagg.api.names import DISK_OFFLOAD_PATH, ROLE_DECODE, ROLE_PREFILL

Role = Literal["prefill", "decode", "flex"]
assert {ROLE_PREFILL, ROLE_DECODE} == {"prefill", "decode"}


# vLLM's tiering offload puts a CPU tier in front of the disk: without a CPU tier in the spec, this
# much host memory stages blocks on their way to and from disk
DISK_STAGING_GIB = 1.0


class WorkerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Role = Field(description="prefill produces KV for others to pull; decode pulls it (or prefills locally); "
                                   "flex does either, per request, as the router uses it (kv_role kv_both).")
    model: str = Field(min_length=1, description="Local path of the model (weights, config, tokenizer).")
    served_model_name: str | None = Field(None, description="Name clients send as `model` (default: the path).")
    host: str = Field("0.0.0.0", description="Address vLLM's HTTP server and its KV event sockets bind "
                                            "(local runs: 127.0.0.1, so nothing beyond the machine reaches them).")
    port: int = Field(8000, ge=1, le=65535, description="vLLM's HTTP port (OpenAI API, /health, /metrics).")
    advertise_host: str = Field("127.0.0.1", description="This pod's address as peers reach it (the pod IP): "
                                                         "the NIXL side channel and the KV event endpoint.")
    metrics_port: int | None = Field(None, ge=1, le=65535,
                                     description="Also serve vLLM's /metrics alone on this port (and nothing else "
                                                 "there), so a NetworkPolicy can admit scrapers to it without "
                                                 "admitting them to the API (workers/metrics_port.py). Off if unset.")
    nixl_port: int = Field(5600, ge=1, le=65535, description="NIXL side-channel port (distinct per instance).")
    kv_events_port: int = Field(5557, ge=1, le=65535, description="ZMQ PUB port of vLLM's KV events.")
    kv_replay_port: int = Field(KV_REPLAY_PORT, ge=1, le=65535,
                                description="ZMQ port where vLLM resends KV event batches a router missed.")
    kv_transfer: bool = Field(True, description="NIXL KV transfer on; off for an aggregated server "
                                                "(disaggregation: never, or a reference in tests).")
    kv_buffer_device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="Where KV is staged for NIXL transfer; auto: host memory on the CPU build, GPU "
                            "memory otherwise (resolved_buffer_device).")
    nixl_backends: list[str] = Field(default_factory=lambda: ["UCX"], min_length=1)
    ucx_tls: str | None = Field(None, description="UCX transports (UCX_TLS); on CPU it must include tcp.")
    kv_lease_seconds: int = Field(KV_LEASE_SECONDS, ge=1, description="How long a prefill keeps KV that nobody pulled.")
    nixl_progress_delay_us: int | None = Field(
        None, ge=0, description="Poll timeout (µs) of NIXL's UCX progress thread (it still wakes at once on UCX "
                                "events). nixl 1.5 busy-polls (0), one core per idle engine; default: 1000 on the CPU "
                                "build, where that core is the compute's, NIXL's own 0 otherwise "
                                "(workers/engine_site/sitecustomize.py).")
    vllm_shm_wait_ms: int | None = Field(
        None, ge=0, description="In the second after each read, where a reader of vLLM's shared-memory queues "
                                "(scheduler <-> worker process) spins on sched_yield, it waits this long (ms) "
                                "for the writer's notification instead (0: vLLM's spin). Default: 1 on the CPU "
                                "build, where each spinning process takes a core's time from the compute; 0 "
                                "otherwise (workers/engine_site/sitecustomize.py).")
    nixl_keep_affinity: bool | None = Field(
        None, description="Keep the worker's compute thread on its own cores: vLLM's NIXL worker pins the "
                          "thread that creates it to the machine's last core (a core it reserves for KV "
                          "transfer, whatever cores the engine was given), which on the CPU build is the "
                          "compute's thread. Default: on for the CPU build (with NIXL), off otherwise.")
    cpu: bool = Field(False, description="vLLM's CPU build: float32, eager mode, explicit OpenMP binding.")
    cpu_cores: str | None = Field(None, description="Cores this instance's OpenMP threads bind to, e.g. '0' or "
                                                    "'2-3' (VLLM_CPU_OMP_THREADS_BIND); distinct per instance.")
    max_model_len: int | None = Field(None, ge=16)
    kv_cache_bytes: int | None = Field(None, ge=1, description="KV cache size (--kv-cache-memory-bytes).")
    block_size: int | None = Field(None, ge=1, description="KV block size in tokens (the router hashes the same).")
    offload_cpu_gib: float = Field(0, ge=0, description="spec.kvCache.offload.cpuGiB: vLLM's offloading "
                                                        "connector next to NIXL (MultiConnector).")
    offload_disk_gib: float = Field(0, ge=0, description="spec.kvCache.offload.diskGiB: a local-disk tier behind "
                                                         "the CPU tier (vLLM's tiering offload, fs tier).")
    offload_disk_path: str = Field(DISK_OFFLOAD_PATH, description="Where the disk tier keeps its block files "
                                                                  "(the operator mounts a sized emptyDir there).")
    drain_seconds: int = Field(DRAIN_SECONDS, ge=0, description="On SIGTERM, how long in-flight requests may finish "
                                                                "(vLLM's --shutdown-timeout).")
    otlp_traces_endpoint: str | None = Field(
        None, description="spec.tracing.otlpEndpoint: vLLM exports an llm_request span per request there "
                          "(OTLP/gRPC), parented to the router's traceparent; off if unset.")
    trace_sampling_ratio: float = Field(
        1.0, ge=0, le=1, description="spec.tracing.samplingRatio: for requests that come without a traceparent "
                                     "(the router's always carry its decision, which vLLM follows).")
    engine_args: list[str] = Field(default_factory=list, description="Extra vLLM arguments, in order.")

    def resolved_buffer_device(self) -> str:
        """The buffer device vLLM is given. `auto` follows the build, so one spec serves on GPU and CPU
        clusters alike; an explicit `cuda` on the CPU build stays `cuda`, and vLLM refuses it by name."""
        if self.kv_buffer_device == "auto":
            return "cpu" if self.cpu else "cuda"
        return self.kv_buffer_device

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides) -> WorkerSettings:
        """Settings from ``DISAGG_<FIELD>`` variables (lists and booleans as JSON), then ``overrides``."""
        environ = os.environ if environ is None else environ
        values: dict = {}
        for name, field in cls.model_fields.items():
            raw = environ.get(f"DISAGG_{name.upper()}")
            if raw is None:
                continue
            if name in ("engine_args", "nixl_backends"):
                values[name] = json.loads(raw)
            elif name in ("cpu", "kv_transfer"):
                values[name] = raw.lower() in ("1", "true", "yes")
            else:
                values[name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)

    def to_env(self) -> dict[str, str]:
        """The inverse of :meth:`from_env` (what the operator puts in a pod spec)."""
        out = {}
        for name, value in self.model_dump(exclude_none=True).items():
            out[f"DISAGG_{name.upper()}"] = (json.dumps(value) if isinstance(value, (list, bool))
                                             else str(value))
        return out
