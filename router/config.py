"""The router's configuration: the deployment's RouterSpec plus what it serves and where."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from disagg.api.contract import KV_EVENTS_TOPIC, KV_LEASE_SECONDS
from disagg.api.v1alpha1 import RouterSpec, TracingSpec

# What the router reads from a worker into memory, at most. A worker is trusted to serve, not to be
# small: a buggy or compromised one answering without end would otherwise take the router (and every
# client's stream on it) down with it.
# A worker's error body (4xx, 5xx): only its message is passed on, and a message is short; beyond this
# the body is cut (a 4xx then gets a message of the router's own).
MAX_ERROR_BODY_BYTES = 64 * 1024
# A non-streamed answer (a completion, a prefill's kv_transfer_params, /v1/models): far above any a
# worker sends (32k tokens with 20 logprobs each is ~30 MiB of JSON); beyond it the client gets a 502.
MAX_ANSWER_BYTES = 64 * 2**20
# One KV event replay (every batch a worker's replay socket resends, 10,000 at most: a few KiB each, more
# only under long prompts); beyond it the replay counts as none and the worker's index entries are rebuilt
# from new events. A restarted router asks every worker at once, so this times the workers is the peak.
MAX_KV_REPLAY_BYTES = 64 * 2**20
# One ZMQ message of KV events (a batch, live or replayed); ZMQ drops a peer sending a larger one.
MAX_KV_EVENT_MESSAGE_BYTES = 16 * 2**20


class WorkerEndpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(pattern=r"^https?://", description="vLLM's base URL, e.g. http://10.0.0.5:8000")
    kv_events: str | None = Field(None, description="ZMQ endpoint of its KV events, e.g. tcp://10.0.0.5:5557")
    kv_replay: str | None = Field(None, description="ZMQ endpoint of its KV events' replay socket, e.g. "
                                                    "tcp://10.0.0.5:5558: missed batches are asked for there "
                                                    "(without it, a gap drops the worker's index entries).")
    revision: str | None = Field(None, description="Its KV revision (disagg.api.contract.kv_revision): prefill "
                                                   "and decode are paired only within one revision. Unset "
                                                   "counts as one revision of its own.")
    revision_generation: int | None = Field(None, description="Orders revisions: new requests go to the revision "
                                                              "of the highest generation that has both roles.")


class FlexEndpoint(WorkerEndpoint):
    role: Literal["prefill", "decode"] = Field(description="The role it serves now (spec.flex: its pod's "
                                                           "serving-role label). A change is a switch: the router "
                                                           "drains the worker of its old role's work first.")


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="Served model name (the `model` clients send).")
    tokenizer: str = Field(min_length=1, description="Directory of the model's tokenizer and chat template.")
    spec: RouterSpec = Field(default_factory=RouterSpec)
    tracing: TracingSpec | None = Field(None, description="OpenTelemetry traces of each request, exported over "
                                                          "OTLP/gRPC (the deployment's spec.tracing); off when "
                                                          "unset (router/tracing.py).")
    prefill: list[WorkerEndpoint] = Field(default_factory=list)
    decode: list[WorkerEndpoint] = Field(default_factory=list)
    flex: list[FlexEndpoint] = Field(default_factory=list, description="Flex workers (spec.flex), each in its "
                                                                       "serving role.")
    flex_roles_file: str | None = Field(None, description="Local runs: a JSON file {worker URL: role} of the flex "
                                                          "workers' serving roles, re-read every "
                                                          "health_interval_s (in Kubernetes the pods' labels "
                                                          "say it).")
    flex_drain_seconds: float = Field(120, gt=0, description="Longest a flex worker's switch waits for its drain "
                                                             "(spec.flex.switchDrainSeconds).")
    kv_lease_seconds: float = Field(KV_LEASE_SECONDS, gt=0, description="How long a prefill keeps KV nobody pulled "
                                                                        "(the workers' kv_lease_seconds).")
    # Both from the same source as the workers' (see disagg.api.contract), never a default of the router's own.
    block_size: int = Field(ge=1, description="KV block size of the workers, in tokens (vLLM's --block-size): "
                                              "prompts are hashed in blocks of this size.")
    max_model_len: int | None = Field(None, ge=1, description="Context length; longer requests are refused (400). "
                                                              "Unset: learned from the workers' /v1/models "
                                                              "(max_model_len), what vLLM derived itself.")
    max_prefill_active: int = Field(8, ge=1, description="Active prefills per prefill worker above which "
                                                         "prefill counts as saturated (conditional mode).")
    decode_attempts: int = Field(2, ge=1, description="Decode workers tried before the first token.")
    prefix_prediction_s: float = Field(30, ge=0, description="kv-aware: how long a prefix counts as held by the "
                                                            "worker it was just sent to, before (and beside) "
                                                            "that worker's KV events (router/decision.py); "
                                                            "0: only the events count.")
    health_interval_s: float = Field(2, gt=0, description="How often each worker's /health is checked.")
    kv_events_topic: str = Field(KV_EVENTS_TOPIC, description="ZMQ topic of the workers' KV events.")
    worker_ca_file: str | None = Field(None, description="PEM file of the certificate authorities the workers' "
                                                         "HTTPS certificates are checked against (https:// "
                                                         "worker URLs), in place of the system's trust store; "
                                                         "unset: the system's.")
    api_keys_file: str | None = Field(None, description="File of API keys, one a line (spec.router.auth, "
                                                         "mounted from its Secret); unset: no authentication.")
    adapters: dict[str, str] = Field(default_factory=dict,
                                     description="LoRA adapters served, name -> source (spec.model.adapters); "
                                                 "loaded onto every worker at run time (router/adapters.py).")
    adapters_file: str | None = Field(None, description="A JSON file of name -> source, re-read when it changes, "
                                                         "in place of `adapters` (local runs; with discovery, "
                                                         "the DisaggDeployment's spec.model.adapters).")
    max_loras: int | None = Field(None, ge=1, description="The workers' adapter slots (spec.model.maxLoras, "
                                                          "vLLM --max-loras): the lora_affinity scorer's.")
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535)
    metrics_port: int | None = Field(None, ge=1, le=65535,
                                     description="Also serve /metrics and /livez alone on this port: with several "
                                                 "processes on one serving port, each scraped on its own.")
