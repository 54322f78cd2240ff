"""The DisaggDeployment API, serving.disagg.dev/v1alpha1: the single source of truth.

The CRD in ``crds/`` is generated from these models (``disagg crds``), including
the CEL rules declared here with :func:`cel`. Each cross-field rule is declared
once as CEL for admission and once as a pydantic validator for Python callers
(the configurator, the operator reading objects); ``tests/test_api.py`` checks
both refuse the same specs.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from . import contract
from . import parallelism as par
from .names import (DNS1035_LABEL, DNS1123_SUBDOMAIN, GROUP, LABEL_SERVING_ROLE, MAX_GROUP_REPLICAS,
                    MAX_NAME_LENGTH)

VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DisaggDeployment"
PLURAL = "disaggdeployments"
SINGULAR = "disaggdeployment"
SHORT_NAMES = ["dd"]
GPU_RESOURCE = "nvidia.com/gpu"


def cel(rule: str, message: str, field_path: str | None = None, reason: str = "FieldValueInvalid") -> dict[str, Any]:
    """One ``x-kubernetes-validations`` entry. Messages are static: the API server's
    cost estimator treats string(int) in a messageExpression as unbounded."""
    entry: dict[str, Any] = {"rule": rule, "message": message, "reason": reason}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


def _validations(*rules: dict[str, Any]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


# On an optional object field whose own fields all have defaults: the CRD gives it no `default: {}` (which
# the generator gives such objects so their defaults apply), so it stays absent unless written and a CEL
# rule can tell whether it was (disagg.api.crd reads and drops the marker).
NO_DEFAULT = "x-disagg-no-default"


class _Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields refused."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              use_enum_values=True)


# A Kubernetes resource quantity ("8", 8, "500m", "64Gi").
Quantity = Annotated[
    int | str,
    Field(json_schema_extra={"x-kubernetes-int-or-string": True, "maxLength": 64}),
]


class GangBackend(StrEnum):
    WORKLOAD_API = "workload-api"
    COSCHEDULING = "coscheduling"
    VOLCANO = "volcano"
    NONE = "none"


class TopologyMode(StrEnum):
    REQUIRED = "required"
    PREFERRED = "preferred"


class RoutingPolicy(StrEnum):
    KV_AWARE = "kv-aware"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"


class Disaggregation(StrEnum):
    ALWAYS = "always"
    CONDITIONAL = "conditional"
    NEVER = "never"


class RouterMode(StrEnum):
    PROXY = "proxy"
    PICKER = "picker"


class PickerFailureMode(StrEnum):
    """What a gateway does when the endpoint picker does not answer (the InferencePool's failureMode)."""

    FAIL_OPEN = "FailOpen"
    FAIL_CLOSE = "FailClose"


class Predictor(StrEnum):
    LAST_VALUE = "last-value"
    MOVING_AVERAGE = "moving-average"
    HOLT_WINTERS = "holt-winters"


class Phase(StrEnum):
    PENDING = "Pending"
    PROGRESSING = "Progressing"
    READY = "Ready"
    DEGRADED = "Degraded"
    FAILED = "Failed"


class ConditionType(StrEnum):
    READY = "Ready"
    GANG_SCHEDULED = "GangScheduled"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    SLO_MET = "SLOMet"
    PLANNER_ACTIVE = "PlannerActive"  # written by the planner: False when it holds for want of metrics
    # spec.router.mode picker: whether the deployment's InferencePool exists (False: its CRD is missing)
    INFERENCE_POOL_APPLIED = "InferencePoolApplied"


# ---------------------------------------------------------------- spec

class SecretRef(_Model):
    name: str = Field(min_length=1, max_length=253,
                      description="Name of a Secret in the deployment's namespace.")
    key: str = Field("token", min_length=1, max_length=253,
                     description="Key in the Secret holding the credential (for example a Hugging Face token).")


ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][-._A-Za-z0-9]*$"
ADAPTERS_NEED_LORA = ("adapters need maxLoras (LoRA on in every worker; set it before the first adapter, since "
                      "turning LoRA on restarts the workers and adding an adapter does not)")
ADAPTER_NAMES_UNIQUE = "adapters: each name must be unique"
ADAPTER_NOT_BASE = "adapters: a name must differ from the base model's name (clients pick an adapter by name)"
MAX_ADAPTERS = 64
DEFAULT_MAX_LORA_RANK = 16


class AdapterSpec(_Model):
    """One LoRA adapter of the base model, served under its own name; loaded into every running worker of both
    roles at run time (no restart) by the routers (router/adapters.py)."""

    name: str = Field(min_length=1, max_length=253, pattern=ADAPTER_NAME_PATTERN,
                      description="Name clients send as `model` to be served by this adapter.")
    source: str = Field(max_length=1024, pattern=r"^(hf://|pvc://|/).+",
                        description="Where the adapter (adapter_config.json + adapter_model.safetensors) comes "
                                    "from, as the base model's: hf://<repo>, pvc://<claim>/<path> (the claim is "
                                    "mounted read-only into the workers; a claim the workers do not mount yet "
                                    "restarts them once), or an absolute path inside the image. Not s3://: "
                                    "vLLM loads adapters from a local path or the hub.")


class ModelSpec(_Model):
    model_config = ConfigDict(json_schema_extra=_validations(
        cel("!self.source.startsWith('s3://') || (has(self.tokenizer) && !self.tokenizer.startsWith('s3://'))",
            "a model read from s3:// needs tokenizer set to an hf://, pvc:// or image path (the router "
            "tokenizes prompts itself)", field_path=".tokenizer"),
        cel("!has(self.adapters) || size(self.adapters) == 0 || has(self.maxLoras)", ADAPTERS_NEED_LORA,
            field_path=".maxLoras", reason="FieldValueRequired"),
        cel("!has(self.adapters) || self.adapters.all(a, self.adapters.exists_one(b, b.name == a.name))",
            ADAPTER_NAMES_UNIQUE, field_path=".adapters", reason="FieldValueDuplicate"),
        cel("!has(self.adapters) || self.adapters.all(a, a.name != self.name)", ADAPTER_NOT_BASE,
            field_path=".adapters"),
    ))

    name: str = Field(min_length=1, max_length=253,
                      description="Model name served on the OpenAI API (the `model` field clients send).")
    source: str = Field(max_length=1024, pattern=r"^(hf://|pvc://|s3://|/).+",
                        description="Where the weights come from: hf://<repo>, pvc://<claim>/<path>, "
                                    "s3://<bucket>/<path>, or an absolute path inside the image.")
    revision: str | None = Field(None, max_length=253, description="Revision (branch, tag or commit) of the source.")
    tokenizer: str | None = Field(None, max_length=1024,
                                  description="Tokenizer location when it differs from the model source.")
    secret_ref: SecretRef | None = Field(None, description="Credentials for reading the model source.")
    adapters: list[AdapterSpec] = Field(
        default_factory=list, max_length=MAX_ADAPTERS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="LoRA adapters of this model, each served under its own name. Adding or removing one loads or "
                    "unloads it on the running workers of both roles, without a restart; status.adapters says on "
                    "how many workers of each role each is ready. The prefill and the decode of a request always "
                    "run the same adapter.")
    max_loras: int | None = Field(None, ge=1, le=256,
                                  description="LoRA on (vLLM --enable-lora) in every worker of both roles, with at "
                                              "most this many adapters in one batch (--max-loras); more may be "
                                              "loaded, and wait for a slot. Unset: LoRA off. Changing it restarts "
                                              "the workers; adding adapters does not.")
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] | None = Field(
        None, description=f"Largest adapter rank the workers accept (--max-lora-rank; vLLM's allowed values; "
                          f"unset: {DEFAULT_MAX_LORA_RANK}); an adapter of a higher rank fails to load and is "
                          "reported not ready.")

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.source.startswith("s3://") and (not self.tokenizer or self.tokenizer.startswith("s3://")):
            raise ValueError("tokenizer: a model read from s3:// needs tokenizer set to an hf://, pvc:// or image "
                             "path (the router tokenizes prompts itself)")
        if self.adapters and self.max_loras is None:
            raise ValueError(f"maxLoras: {ADAPTERS_NEED_LORA}")
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(ADAPTER_NAMES_UNIQUE)
        if self.name in names:
            raise ValueError(ADAPTER_NOT_BASE)
        return self


class EnvVar(_Model):
    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
                      description="Environment variable name.")
    value: str = Field("", max_length=32768, description="Value, passed literally (no shell expansion).")


class EngineSpec(_Model):
    image: str = Field("disagg/worker:0.1.0", min_length=1, max_length=512,
                       description="Worker image: vLLM with NIXL and the disagg worker entrypoint.")
    image_pull_policy: str = Field("IfNotPresent", json_schema_extra={"enum": ["Always", "IfNotPresent", "Never"]},
                                   description="Image pull policy of the worker containers.")
    args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=128,
        description="Extra vLLM arguments for both roles, passed as an argument list (never through a shell).")
    env: list[EnvVar] = Field(default_factory=list, max_length=64,
                              json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
                              description="Extra environment variables for both roles.")

    @model_validator(mode="after")
    def _check(self) -> EngineSpec:
        try:  # the operator hands both values to the router as numbers
            contract.block_size(self.args)
            contract.max_model_len(self.args)
        except ValueError as e:
            raise ValueError(f"args: {e}") from None
        return self


class KVTransferSpec(_Model):
    connector: str = Field("NixlConnector", json_schema_extra={"enum": ["NixlConnector"]},
                           description="vLLM KV connector moving KV cache from prefill to decode.")
    backends: list[Annotated[str, Field(json_schema_extra={"enum": ["UCX", "LIBFABRIC", "GDS", "POSIX"]})]] = Field(
        default=["UCX"], min_length=1, max_length=4,
        description="NIXL backends, in order of preference.")
    buffer_device: str = Field("auto", json_schema_extra={"enum": ["auto", "cuda", "cpu"]},
                               description="Where KV blocks are staged for transfer: GPU memory (cuda) or host "
                                           "memory (cpu). auto: host memory where the worker image is vLLM's "
                                           "CPU build, GPU memory otherwise, so one manifest serves on GPU and CPU "
                                           "clusters alike.")
    ipc_lock: bool = Field(False, description="Give worker containers the IPC_LOCK capability (all others stay "
                                              "dropped): NIXL over RDMA (UCX on InfiniBand or RoCE) pins memory, "
                                              "and on nodes whose container runtime keeps the default locked-memory "
                                              "limit registration fails without it. Pod Security Admission's "
                                              "baseline and restricted levels refuse it: the namespace must "
                                              "enforce privileged.")


class ResourceRequirements(_Model):
    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16,
                                          description="Minimum resources of each pod of a replica (Kubernetes "
                                                      "quantities); a one-pod replica's are the replica's.")
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16,
                                        description="Maximum resources of each pod of a replica (Kubernetes "
                                                    f"quantities). {GPU_RESOURCE} here must equal the GPUs of "
                                                    "each pod, tensor x pipeline x data / podsPerReplica "
                                                    "(tensorParallelSize on a one-pod tensor-parallel replica); "
                                                    "when absent, that many GPUs are requested.")


class Toleration(_Model):
    key: str | None = Field(None, max_length=316, description="Taint key the toleration applies to.")
    operator: str = Field("Equal", json_schema_extra={"enum": ["Equal", "Exists"]},
                          description="Equal matches key and value; Exists matches any value.")
    value: str | None = Field(None, max_length=63, description="Taint value to match with Equal.")
    effect: str | None = Field(None, json_schema_extra={"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
                               description="Taint effect to match; empty matches all effects.")
    toleration_seconds: int | None = Field(None, ge=0, description="How long a NoExecute taint is tolerated.")


# CEL for a role's layout (``role``: "self" inside RoleSpec, "self.prefill" above it). Every field is
# read behind has(), its default standing in: the API server checks each rule against the role's own
# default ({}) without filling in the defaults nested in it, and an absent key is an error in CEL.
def _cel_has(role: str, field: str) -> str:
    return f"has({role}.parallelism) && has({role}.parallelism.{field})"


def _cel_tensor(role: str) -> str:
    """parallelism.tensor, else tensorParallelSize, else 1, as :func:`parallelism.layout` reads it."""
    return (f"({_cel_has(role, 'tensor')} ? {role}.parallelism.tensor : "
            f"(has({role}.tensorParallelSize) ? {role}.tensorParallelSize : 1))")


def _cel_size(role: str, field: str) -> str:
    return f"({_cel_has(role, field)} ? {role}.parallelism.{field} : 1)"


def _cel_pods(role: str) -> str:
    return f"(has({role}.podsPerReplica) ? {role}.podsPerReplica : 1)"


def _cel_world(role: str) -> str:
    """The GPUs of one replica of a role: tensor x pipeline x data."""
    return f"({_cel_tensor(role)} * {_cel_size(role, 'pipeline')} * {_cel_size(role, 'data')})"


_PIPELINE, _DATA, _PODS = _cel_size("self", "pipeline"), _cel_size("self", "data"), _cel_pods("self")
_EXPERT = f"({_cel_has('self', 'expert')} && self.parallelism.expert)"
_DATA_LOCAL = "self.parallelism.dataLocal"
# A replica laid out as before parallelism existed: one pod, tensor parallel only, sized by
# tensorParallelSize. Its GPU rule keeps the words it always had.
_CEL_PLAIN = f"(!({_cel_has('self', 'tensor')}) && {_PODS} == 1 && {_PIPELINE} == 1 && {_DATA} == 1)"


def _gpu_rules(section: str) -> list[dict[str, Any]]:
    # Static messages only: string(int) in a messageExpression (or rule) is
    # estimated as unbounded by the API server's CEL cost check.
    v = f"self.resources.{section}['{GPU_RESOURCE}']"
    absent = (f"!has(self.resources) || !has(self.resources.{section}) || "
              f"!('{GPU_RESOURCE}' in self.resources.{section})")

    def equals(x: str) -> str:
        return (f"(type({v}) == int ? {v} == {x} : (isQuantity({v}) && quantity({v}).isInteger()"
                f" && quantity({v}).asInteger() == {x}))")

    plain_tp = "(has(self.tensorParallelSize) ? self.tensorParallelSize : 1)"
    per_pod = f"({_cel_world('self')} / {_PODS})"
    return [
        cel(f"!{_CEL_PLAIN} || {absent} || {equals(plain_tp)}",
            message=f"tensorParallelSize must equal the {GPU_RESOURCE} each replica requests in resources.{section}",
            field_path=".tensorParallelSize"),
        cel(f"{_CEL_PLAIN} || {absent} || {equals(per_pod)}",
            message=_per_pod_gpu_message(section), field_path=f".resources.{section}"),
    ]


def _per_pod_gpu_message(section: str) -> str:
    return (f"resources.{section}: {GPU_RESOURCE} must equal the GPUs of each pod of a replica, "
            "parallelism.tensor x parallelism.pipeline x parallelism.data / podsPerReplica")


_GROUP_NAMES_MESSAGE = (f"replicas and maxReplicas may be at most {MAX_GROUP_REPLICAS} when podsPerReplica is above "
                        "1: each pod of such a replica is named <name>-<role>-<replica>-<pod>, which must stay a "
                        "DNS label of at most 63 characters")


class ParallelismSpec(_Model):
    """The parallel layout of one replica (disagg.api.parallelism does its arithmetic)."""

    tensor: int | None = Field(None, ge=1, le=par.MAX_TENSOR,
                               description="Tensor parallel size (vLLM --tensor-parallel-size): GPUs each layer "
                                           "is sharded over. The same setting as tensorParallelSize, its older "
                                           "spelling: set either, or both to the same value (different values "
                                           "are refused); with neither set it is 1. It may span the pods of a "
                                           "replica (podsPerReplica), which pays only inside one NVLink domain.")
    pipeline: int = Field(1, ge=1, le=par.MAX_PIPELINE,
                          description="Pipeline parallel size (vLLM --pipeline-parallel-size): the layers are cut "
                                      "into this many consecutive stages on different GPUs, typically one stage "
                                      "per pod. Must be 1 on both roles while vLLM's NIXL connector moves KV only "
                                      "between engines that each hold every layer (a decode refuses a "
                                      "pipeline-parallel prefill's KV); span nodes with tensor parallel.")
    data: int = Field(1, ge=1, le=par.MAX_DATA,
                      description="Data-parallel engines in one replica (vLLM --data-parallel-size), each of "
                                  "tensor x pipeline GPUs, together holding one mixture-of-experts model's "
                                  "experts: above 1 needs expert: true. Dense models scale with replicas instead.")
    data_local: int | None = Field(None, ge=1, le=par.MAX_DATA_LOCAL,
                                   description="Data-parallel engines on each pod (vLLM "
                                               "--data-parallel-size-local): data / podsPerReplica, which is "
                                               "also the default; 1 without data parallel.")
    expert: bool = Field(False, description="Expert parallel (vLLM --enable-expert-parallel): a mixture-of-experts "
                                            "model's experts are spread over the replica's GPUs instead of each "
                                            "GPU holding a slice of every expert.")


_SHARED_FLAGS_MESSAGE = ("extraArgs may not set --block-size or --max-model-len: prefill and decode (and the "
                         "router) must agree on them; set them in engine.args")


class RoleSpec(_Model):
    model_config = ConfigDict(json_schema_extra=_validations(
        cel("!has(self.minReplicas) || self.minReplicas <= self.replicas",
            "minReplicas must not exceed replicas",
            field_path=".minReplicas"),
        cel("!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
            "replicas must not exceed maxReplicas",
            field_path=".replicas"),
        cel("!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
            "minReplicas must not exceed maxReplicas", field_path=".minReplicas"),
        cel(f"!has(self.tensorParallelSize) || !({_cel_has('self', 'tensor')}) "
            "|| self.tensorParallelSize == self.parallelism.tensor",
            par.TENSOR_CONFLICT, field_path=".parallelism.tensor"),
        cel(f"{_DATA} == 1 || {_EXPERT}", par.DATA_NEEDS_EXPERT, field_path=".parallelism.data"),
        cel(f"{_DATA} > 1 || ({_cel_tensor('self')} * {_PIPELINE}) % {_PODS} == 0",
            par.PODS_DIVIDE_RANKS, field_path=".podsPerReplica"),
        cel(f"{_DATA} == 1 || {_DATA} % {_PODS} == 0", par.PODS_DIVIDE_DATA, field_path=".podsPerReplica"),
        cel(f"!({_cel_has('self', 'dataLocal')}) || "
            f"({_DATA} == 1 ? {_DATA_LOCAL} == 1 : {_DATA_LOCAL} * {_PODS} == {_DATA})",
            par.DATA_LOCAL_MISMATCH, field_path=".parallelism.dataLocal"),
        *_gpu_rules("limits"),
        *_gpu_rules("requests"),
        cel(f"{_PODS} == 1 || ((!has(self.replicas) || self.replicas <= {MAX_GROUP_REPLICAS}) && "
            f"(!has(self.maxReplicas) || self.maxReplicas <= {MAX_GROUP_REPLICAS}))",
            _GROUP_NAMES_MESSAGE, field_path=".replicas"),
        cel("!has(self.extraArgs) || !self.extraArgs.exists(a, "
            + " || ".join(f"a == '{f}' || a.startsWith('{f}=')" for f in contract.SHARED_ENGINE_FLAGS) + ")",
            _SHARED_FLAGS_MESSAGE, field_path=".extraArgs"),
    ))

    replicas: int = Field(1, ge=0, le=1024,
                          description="Desired replicas. Owned by the planner's field manager when "
                                      "spec.planner.enabled is true.")
    min_replicas: int | None = Field(None, ge=0, le=1024,
                                     description="Lowest replica count the planner may choose.")
    max_replicas: int | None = Field(None, ge=1, le=1024,
                                     description="Highest replica count the planner may choose.")
    # Optional on the wire, so that setting only parallelism.tensor is not contradicted by a default
    # of 1 the API server would store; after validation it always holds the effective tensor size,
    # which Python callers read.
    tensor_parallel_size: int | None = Field(None, ge=1, le=par.MAX_TENSOR,
                                             description="Tensor parallel size of one replica (vLLM "
                                                         "--tensor-parallel-size): the GPUs each layer is "
                                                         "sharded over; 1 when unset. The original "
                                                         "spelling of parallelism.tensor, kept so existing "
                                                         "manifests work unchanged: set either, or both to the "
                                                         "same value (different values are refused). On a "
                                                         "one-pod replica without pipeline or data parallel it "
                                                         "is the replica's GPU request.")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec,
                                         description="Parallel layout of one replica: tensor, pipeline, data and "
                                                     "expert parallel. A replica uses tensor x pipeline x data "
                                                     "GPUs, split evenly over its podsPerReplica pods.")
    pods_per_replica: int = Field(1, ge=1, le=par.MAX_PODS_PER_REPLICA,
                                  description="Pods one replica spans (1 by default), each with tensor x "
                                              "pipeline x data / podsPerReplica GPUs; resources apply to each "
                                              "pod. Pod 0 is the leader: it serves HTTP, metrics and the NIXL "
                                              "side channel, and the others run their ranks headless. Tensor "
                                              "and pipeline parallel split one engine's ranks over the pods; "
                                              "with data above 1 each pod runs parallelism.dataLocal whole "
                                              "data-parallel engines. A replica is placed and restarted as a "
                                              "whole: all of its pods or none.")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements,
                                            description="Resources of the worker container of each pod of a "
                                                        "replica.")
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, max_length=32, description="Node labels the nodes of a replica's pods must carry.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32,
                                          description="Taints a replica's pods tolerate.")
    extra_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=128,
        description="vLLM arguments for this role only, after engine.args, as an argument list.")

    def layout(self) -> par.Layout:
        """Pods, GPUs and ranks of one replica (disagg.api.parallelism)."""
        return par.layout(self)

    def gpus(self) -> int:
        """GPUs one pod of a replica requests: a node must hold this many for the pod to fit. On a
        one-pod replica that is the replica's count; layout().gpus_per_replica is the replica's always."""
        for section in (self.resources.limits, self.resources.requests):
            if GPU_RESOURCE in section:
                return int(str(section[GPU_RESOURCE]))
        return self.layout().gpus_per_pod

    @model_validator(mode="after")
    def _check(self) -> RoleSpec:
        if self.min_replicas is not None and self.min_replicas > self.replicas:
            raise ValueError(f"minReplicas ({self.min_replicas}) must not exceed replicas ({self.replicas})")
        if self.max_replicas is not None and self.replicas > self.max_replicas:
            raise ValueError(f"replicas ({self.replicas}) must not exceed maxReplicas ({self.max_replicas})")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError("minReplicas must not exceed maxReplicas")
        p = self.parallelism
        if self.tensor_parallel_size is not None and p.tensor is not None and self.tensor_parallel_size != p.tensor:
            raise ValueError(f"{par.TENSOR_CONFLICT} (tensorParallelSize {self.tensor_parallel_size}, "
                             f"parallelism.tensor {p.tensor})")
        lay = self.layout()
        problems = par.problems(lay, data_local_set=p.data_local is not None)
        if problems:
            raise ValueError("; ".join(problems))
        plain = p.tensor is None and self.pods_per_replica == 1 and p.pipeline == 1 and p.data == 1
        for name, section in (("limits", self.resources.limits), ("requests", self.resources.requests)):
            if GPU_RESOURCE not in section:
                continue
            if plain and str(section[GPU_RESOURCE]) != str(lay.tensor):
                raise ValueError(f"tensorParallelSize ({lay.tensor}) must equal the {GPU_RESOURCE} "
                                 f"each replica requests in resources.{name} ({section[GPU_RESOURCE]})")
            if not plain and str(section[GPU_RESOURCE]) != str(lay.gpus_per_pod):
                raise ValueError(f"{_per_pod_gpu_message(name)} ({lay.tensor} x {lay.pipeline} x {lay.data} / "
                                 f"{lay.pods} = {lay.gpus_per_pod}, not {section[GPU_RESOURCE]})")
        if self.pods_per_replica > 1 and max(self.replicas, self.max_replicas or 0) > MAX_GROUP_REPLICAS:
            raise ValueError(_GROUP_NAMES_MESSAGE)
        if contract.names_shared_flag(self.extra_args):
            raise ValueError(_SHARED_FLAGS_MESSAGE)
        # Python callers (the renderer, the planner) read the effective tensor size here.
        self.tensor_parallel_size = lay.tensor
        return self


class RouterAuth(_Model):
    secret_name: str = Field(min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN,
                             description="Secret in the deployment's namespace holding the API keys. The router "
                                         "reads it as a mounted file and picks up a changed Secret without a "
                                         "restart (within the kubelet's sync period, about a minute).")
    key: str = Field("keys", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="Key in the Secret: one API key a line (several for rotation); blank lines and "
                                 "lines starting with # are ignored. Clients send Authorization: Bearer <key>.")


ROUTER_PROCESSES_MAX = 16
PICKER_DEFAULT_PORT = 9002


LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_SELECTOR_VALUES = "values must be given with In and NotIn, and only with them"


class LabelSelectorRequirement(_Model):
    model_config = ConfigDict(json_schema_extra=_validations(
        cel("(self.operator == 'In' || self.operator == 'NotIn') == (has(self.values) && size(self.values) > 0)",
            _SELECTOR_VALUES, field_path=".values"),
    ))

    key: str = Field(min_length=1, max_length=316, description="Label key the requirement applies to.")
    operator: str = Field(json_schema_extra={"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                          description="In, NotIn, Exists or DoesNotExist.")
    values: list[Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]] = Field(
        default_factory=list, max_length=64,
        description="Values for In and NotIn (non-empty there); empty for Exists and DoesNotExist.")

    @model_validator(mode="after")
    def _check(self) -> LabelSelectorRequirement:
        if (self.operator in ("In", "NotIn")) != bool(self.values):
            raise ValueError(f"values: {_SELECTOR_VALUES}")
        return self


class LabelSelector(_Model):
    """A Kubernetes label selector; empty selects everything."""

    match_labels: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]] = Field(
        default_factory=dict, max_length=64, description="Labels that must all be present with these values.")
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=32, description="Requirements that must all hold.")

    def manifest(self) -> dict[str, Any]:
        """As a Kubernetes LabelSelector: only what is set (``{}`` selects everything)."""
        return self.model_dump(by_alias=True, exclude_defaults=True, mode="json")


PICKER_PORT_CLASH = (f"picker.port must differ from the router's HTTP port ({contract.HTTP_PORT}) and its "
                     f"metrics ports ({contract.ROUTER_METRICS_PORT} + the index of each of its processes)")
PICKER_NEEDS_PICKER_MODE = ("picker applies only with mode: picker (the router as a gateway's endpoint picker); "
                            "set spec.router.mode to picker or remove spec.router.picker")


class PickerSpec(_Model):
    port: int = Field(PICKER_DEFAULT_PORT, ge=1024, le=65535,
                      description="Port of the router's endpoint picker (Envoy's ext_proc protocol over gRPC, with "
                                  "gRPC health), on its pods and as the port named grpc of its Service, which the "
                                  "InferencePool names as its endpoint picker.")
    failure_mode: PickerFailureMode = Field(
        PickerFailureMode.FAIL_CLOSE,
        description="What the gateway does when the picker does not answer (the InferencePool's "
                    "endpointPickerRef.failureMode): FailClose refuses the request, FailOpen sends it to a decode "
                    "pod of the gateway's own choosing, which then prefills it itself (no prefill worker, no "
                    "prefix-aware choice).")
    gateway_namespace_selector: LabelSelector = Field(
        default_factory=LabelSelector,
        description="Namespaces whose pods (the gateway's Envoy proxies) the deployment's NetworkPolicies admit "
                    "to the decode workers' serving port and to the picker port. Empty (the default): every "
                    "namespace, since a gateway's pods live wherever the platform put them; for example "
                    "{matchLabels: {kubernetes.io/metadata.name: gateway-system}} for one namespace.")


class RouterSpec(_Model):
    model_config = ConfigDict(json_schema_extra=_validations(
        cel("!has(self.processes) || !has(self.maxInFlight) || self.maxInFlight >= self.processes",
            "maxInFlight must be at least processes: each router process admits its share of it",
            field_path=".maxInFlight"),
        cel("!has(self.picker) || (has(self.mode) && self.mode == 'picker')", PICKER_NEEDS_PICKER_MODE,
            field_path=".picker", reason="FieldValueForbidden"),
        cel(f"!has(self.picker) || !has(self.picker.port) || (self.picker.port != {contract.HTTP_PORT} && "
            f"(self.picker.port < {contract.ROUTER_METRICS_PORT} || self.picker.port >= "
            f"{contract.ROUTER_METRICS_PORT} + (has(self.processes) ? self.processes : 1)))",
            PICKER_PORT_CLASH, field_path=".picker.port"),
    ))

    mode: RouterMode = Field(
        RouterMode.PROXY,
        description="proxy: the router's Service carries the streams (clients call it; it calls the prefill and "
                    "decode workers). picker: the router also serves as the endpoint picker of an InferencePool "
                    "(the operator creates it, named after the deployment) for a Gateway API Inference Extension "
                    "gateway, which then carries the streams to the decode pods the router picks, after the "
                    "router had the prompt prefilled; its Service keeps serving the OpenAI API as in proxy mode.")
    picker: PickerSpec | None = Field(
        None, json_schema_extra={NO_DEFAULT: True},
        description="Endpoint picker settings, with mode picker only (defaults apply when it is omitted there).")

    replicas: int = Field(1, ge=1, le=64, description="Router replicas behind the deployment's Service.")
    processes: int = Field(
        1, ge=1, le=ROUTER_PROCESSES_MAX,
        description="Router processes in each replica, sharing its serving port (SO_REUSEPORT: the kernel "
                    "spreads new connections over them), each with its own event loop (one Python process "
                    "uses about one core), load view and prefix index, and its own metrics port. maxInFlight "
                    "and maxQueued are divided between them.")
    policy: RoutingPolicy = Field(RoutingPolicy.KV_AWARE,
                                  description="How a worker is picked: by cached prefix and load (kv-aware), "
                                              "by load alone (least-loaded), or in turn (round-robin).")
    overlap_weight: float = Field(1.0, ge=0, le=100,
                                  description="kv-aware cost = overlapWeight x uncached prefill blocks + load.")
    max_load_skew: float = Field(2.0, ge=1, le=100,
                                 description="A worker more loaded than maxLoadSkew x the least-loaded one (+1) is "
                                             "not picked for prefix affinity, so a shared prompt cannot pile "
                                             "every request onto one worker.")
    disaggregation: Disaggregation = Field(Disaggregation.CONDITIONAL,
                                           description="always: every request prefills on a prefill worker; "
                                                       "never: decode workers prefill locally; conditional: "
                                                       "remote prefill only for long uncached prompts while "
                                                       "prefill is not saturated.")
    local_prefill_threshold_tokens: int = Field(
        256, ge=0, le=1_000_000,
        description="With conditional disaggregation, prompts with fewer uncached tokens prefill on decode.")
    max_in_flight: int = Field(
        4096, ge=1, le=1_000_000,
        description="Requests one router replica serves at once (streams included), divided evenly between its "
                    "processes (rounded up); more wait in its queue.")
    max_queued: int = Field(
        1024, ge=0, le=1_000_000,
        description="Requests one replica holds waiting for admission, divided evenly between its processes "
                    "(rounded up); beyond, it answers 429 with Retry-After.")
    queue_timeout_seconds: float = Field(
        5, ge=0, le=3600,
        description="How long a request may wait for admission before a 429 with Retry-After.")
    connect_timeout_seconds: float = Field(5, gt=0, le=3600,
                                           description="Connecting to a worker; then the next worker is tried.")
    prefill_timeout_seconds: float = Field(
        30, gt=0, le=3600,
        description="How long the router waits for a prefill worker's answer (its KV ready to pull) before the "
                    "decode worker prefills the prompt itself, counted as a prefill_timeout fallback. Raise it "
                    "for long prompts on slow prefill workers; the request is served either way.")
    first_token_timeout_seconds: float = Field(
        600, gt=0, le=86400,
        description="A decode stream that sends no token this long after the request is cut with an error "
                    "event (covers the engine's queue and a local prefill).")
    idle_timeout_seconds: float = Field(
        60, gt=0, le=86400,
        description="A decode stream silent this long between chunks is cut with an error event.")
    max_migrations: int = Field(
        2, ge=0, le=16,
        description="A decode stream that fails after tokens reached the client (its worker died, stalled past "
                    "idleTimeoutSeconds or sent an error) is continued on another decode worker from the tokens "
                    "generated so far, at most this many times per request; 0: the client gets an error event.")
    request_timeout_seconds: float = Field(
        1800, gt=0, le=86400,
        description="A non-streaming request to a worker is cut (504) after this long in total.")
    max_body_bytes: int = Field(
        8 * 2**20, ge=1024, le=2**30,
        description="Largest request body a router accepts; a larger one gets 413 in OpenAI's error shape.")
    body_timeout_seconds: float = Field(
        30, gt=0, le=3600,
        description="How long an admitted request may take to send its body; a slower one gets 408 and gives "
                    "its slot back (a client dripping its body cannot hold a slot forever).")
    auth: RouterAuth | None = Field(None, description="API keys clients must send (Authorization: Bearer) on "
                                                      "every route but the probes and /metrics. Without it the "
                                                      "endpoint is open to whoever reaches it.")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements,
                                            description="Resources of one router replica.")
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, max_length=32,
        description="Node labels a router replica's node must carry. Without one, routers prefer nodes "
                    "without GPUs.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32,
                                          description="Taints a router replica tolerates.")

    @model_validator(mode="after")
    def _check(self) -> RouterSpec:
        if self.max_in_flight < self.processes:
            raise ValueError(f"maxInFlight ({self.max_in_flight}) must be at least processes ({self.processes}): "
                             "each router process admits its share of it")
        if self.picker is not None and self.mode != RouterMode.PICKER:
            raise ValueError(f"picker: {PICKER_NEEDS_PICKER_MODE}")
        if self.picker is not None and (self.picker.port == contract.HTTP_PORT or contract.ROUTER_METRICS_PORT
                                        <= self.picker.port < contract.ROUTER_METRICS_PORT + self.processes):
            raise ValueError(f"picker.port ({self.picker.port}): {PICKER_PORT_CLASH}")
        return self

    def picker_settings(self) -> PickerSpec | None:
        """The endpoint picker's settings in picker mode (its defaults where picker is omitted), else None."""
        if self.mode != RouterMode.PICKER:
            return None
        return self.picker or PickerSpec()


class GangSpec(_Model):
    backend: GangBackend = Field(GangBackend.WORKLOAD_API,
                                 description="Who places the gang: the Kubernetes Workload/PodGroup API "
                                             "(workload-api), scheduler-plugins coscheduling, Volcano, or nobody.")
    min_prefill: int = Field(1, ge=0, le=1024,
                             description="Prefill replicas that must be placed together with minDecode decode "
                                         "replicas, all or none.")
    min_decode: int = Field(1, ge=0, le=1024, description="Decode replicas in the gang's minimum set.")
    timeout_seconds: int = Field(600, ge=0, le=86400,
                                 description="How long the gang may wait for placement before the deployment "
                                             "reports GangScheduled=False with reason GangTimeout.")


class TopologySpec(_Model):
    key: str = Field(min_length=1, max_length=316,
                     description="Node label whose value names one fast-interconnect domain, for example "
                                 "nvidia.com/gpu.clique, a rack label or topology.kubernetes.io/zone.")
    mode: TopologyMode = Field(TopologyMode.REQUIRED,
                               description="required: the gang is placed in one domain or not at all; "
                                           "preferred: packed when possible, spread otherwise.")


class SchedulingSpec(_Model):
    gang: GangSpec = Field(default_factory=GangSpec, description="Gang scheduling of the minimum set.")
    topology: TopologySpec | None = Field(None, description="Pack one gang's pods into one topology domain.")
    priority_class_name: str | None = Field(None, max_length=253,
                                            description="PriorityClass of the workers.")


class SLOSpec(_Model):
    ttft_ms: float = Field(gt=0, le=3_600_000, description="Time-to-first-token target, milliseconds.")
    itl_ms: float = Field(gt=0, le=600_000, description="Inter-token latency target, milliseconds.")
    percentile: float = Field(90, gt=0, lt=100,
                              description="Percentile at which both targets must hold, for example 90 or 99.")


class ProfileRef(_Model):
    name: str = Field(min_length=1, max_length=253,
                      description="ConfigMap holding a measured performance profile (from `disagg profile`).")


PROMETHEUS_URL_REMOVED = ("spec.planner.prometheusUrl is no longer accepted: name one of the operator's allowed "
                          "Prometheus endpoints in spec.planner.prometheus instead (the chart's "
                          "planner.prometheusEndpoints)")


class PlannerSpec(_Model):
    model_config = ConfigDict(json_schema_extra=_validations(
        cel("!has(self.prometheusUrl)", PROMETHEUS_URL_REMOVED, field_path=".prometheusUrl",
            reason="FieldValueForbidden"),
    ))

    enabled: bool = Field(False, description="Let the planner own prefill/decode replicas.")
    interval_seconds: int = Field(30, ge=5, le=3600, description="Seconds between planning decisions.")
    gpu_budget: int | None = Field(None, ge=1, le=100_000,
                                   description="Most GPUs prefill and decode may use together.")
    prometheus: str | None = Field(None, min_length=1, max_length=63, pattern=DNS1035_LABEL,
                                   description="Name of the Prometheus endpoint the planner reads: one of the "
                                               "operator's allowlist (the chart's planner.prometheusEndpoints), "
                                               "whose URL and TLS settings the operator's configuration holds; "
                                               "the operator's default when unset. A name not in the list is "
                                               "refused at admission.")
    prometheus_url: str | None = Field(None, max_length=2048,
                                       description="Removed (refused at admission): a URL here let any namespace "
                                                   "user make the planner fetch it. Use prometheus.")
    predictor: Predictor = Field(Predictor.MOVING_AVERAGE, description="Load predictor for the next interval.")
    scale_down_cooldown_seconds: int = Field(300, ge=0, le=86400,
                                             description="Seconds after a scale-up before any scale-down.")
    profile_ref: ProfileRef | None = Field(None, description="Measured performance profile to plan with.")
    replica_startup_seconds: int = Field(90, ge=0, le=3600,
                                         description="Seconds a new replica takes to serve (scheduling, image, "
                                                     "model load); the planner sizes for the load over this "
                                                     "horizon and for the backlog that builds meanwhile.")
    season_seconds: int | None = Field(None, ge=60, le=604_800,
                                       description="Period of the traffic's cycle (for example 86400 for daily) "
                                                   "for the holt-winters predictor; unset: level and trend only.")

    @model_validator(mode="after")
    def _no_url(self) -> PlannerSpec:
        if self.prometheus_url is not None:
            raise ValueError(PROMETHEUS_URL_REMOVED)
        return self


class TracingSpec(_Model):
    otlp_endpoint: str = Field(
        min_length=1, max_length=2048, pattern=r"^https?://[^/\s]+/?$",
        description="OTLP/gRPC endpoint every component of the deployment exports its traces to, e.g. "
                    "http://otel-collector.monitoring:4317 (an OpenTelemetry Collector, Jaeger, Tempo): the router's "
                    "spans (admission, routing decision, prefill, the wait for the decode's first token, the "
                    "decode stream, fallbacks and migrations) and vLLM's llm_request span of each prefill and "
                    "decode, joined into one trace by the W3C traceparent the router sends both workers. "
                    "https:// is checked against the system's trust store.")
    sampling_ratio: float = Field(
        1.0, ge=0, le=1,
        description="Share of requests traced (parent-based: a client's sampled traceparent is always "
                    "followed). A request's trace id comes back in the x-disagg-trace-id response header "
                    "when it was sampled.")


class OffloadSpec(_Model):
    cpu_gib: int = Field(0, alias="cpuGiB", ge=0, le=65536,
                         description="Host-memory KV cache tier per replica, GiB (0: off).")
    disk_gib: int = Field(0, alias="diskGiB", ge=0, le=1_048_576,
                          description="Local-disk KV cache tier per replica, GiB (0: off).")


# What a flex pool needs of prefill and decode (spec.flex): one engine serves both roles, so both must be
# one shape. Why not a shape of its own: the planner sizes a flex worker as a replica of either role with
# that role's performance model, the router pairs a prefill with a decode only within one KV layout
# revision, and one set of engine arguments must serve both roles (planner/README, flex workers).
FLEX_SHAPE_MESSAGE = ("spec.flex needs prefill and decode of one shape, since a flex worker serves either "
                      "with one engine: spec.prefill and spec.decode differ in {what}")
FLEX_MULTI_POD_MESSAGE = ("spec.flex: flex workers of replicas that span several pods (podsPerReplica above 1) "
                          "are not supported yet")
# Removing spec.flex would leave its Deployment and Service behind: the operator deletes no Deployment or
# Service (it has no such grant); replicas: 0 stops the workers.
FLEX_REMOVED_MESSAGE = "spec.flex cannot be removed once set: set spec.flex.replicas to 0 to stop its workers"
FLEX_NEEDS_PREFILL_MESSAGE = ("spec.flex needs a prefill role to switch to: router.disaggregation never "
                              "sends no work to prefill workers")


class FlexSpec(_Model):
    """A third pool whose workers serve prefill or decode, one at a time, switched at run time."""

    model_config = ConfigDict(json_schema_extra=_validations(
        cel("!has(self.minReplicas) || self.minReplicas <= self.replicas",
            "minReplicas must not exceed replicas", field_path=".minReplicas"),
        cel("!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
            "replicas must not exceed maxReplicas", field_path=".replicas"),
        cel("!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
            "minReplicas must not exceed maxReplicas", field_path=".minReplicas"),
    ))

    replicas: int = Field(1, ge=0, le=1024,
                          description="Flex workers. Owned by the planner's field manager when "
                                      "spec.planner.enabled is true. Each runs one engine with kv_role kv_both "
                                      "in the shape prefill and decode share, and serves one role at a time: "
                                      f"its pod's label {LABEL_SERVING_ROLE}.")
    min_replicas: int | None = Field(None, ge=0, le=1024, description="Fewest flex workers the planner may keep.")
    max_replicas: int | None = Field(None, ge=1, le=1024, description="Most flex workers the planner may keep.")
    switch_drain_seconds: int = Field(120, ge=1, le=3600,
                                      description="Longest a role switch waits for the worker's drain (its "
                                                  "in-flight requests of the old role, and the KV blocks it "
                                                  "holds for decodes, until pulled or their lease ran out). "
                                                  "Past it the switch goes ahead, counted "
                                                  "(disagg_router_role_switches_total outcome abandoned): the "
                                                  "engine serves both roles, so what was left still completes.")

    @model_validator(mode="after")
    def _check(self) -> FlexSpec:
        if self.min_replicas is not None and self.min_replicas > self.replicas:
            raise ValueError(f"flex.minReplicas ({self.min_replicas}) must not exceed flex.replicas "
                             f"({self.replicas})")
        if self.max_replicas is not None and self.replicas > self.max_replicas:
            raise ValueError(f"flex.replicas ({self.replicas}) must not exceed flex.maxReplicas "
                             f"({self.max_replicas})")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError("flex.minReplicas must not exceed flex.maxReplicas")
        return self


def _cel_opt(path: str, field: str, empty: str) -> str:
    return f"(has({path}.{field}) ? {path}.{field} : {empty})"


# (what differs, as the message says it; the CEL that holds when both roles agree on it)
_FLEX_SHAPE = [
    ("tensor parallel size (parallelism.tensor / tensorParallelSize)",
     f"{_cel_tensor('self.prefill')} == {_cel_tensor('self.decode')}"),
    ("parallelism.data", f"{_cel_size('self.prefill', 'data')} == {_cel_size('self.decode', 'data')}"),
    ("parallelism.expert",
     f"({_cel_has('self.prefill', 'expert')} && self.prefill.parallelism.expert) == "
     f"({_cel_has('self.decode', 'expert')} && self.decode.parallelism.expert)"),
    ("podsPerReplica", f"{_cel_pods('self.prefill')} == {_cel_pods('self.decode')}"),
    # each role's resources is an object type of its own to CEL, which has no equality between two such:
    # their maps are compared
    ("resources", " && ".join(
        f"(has(self.prefill.resources) && has(self.prefill.resources.{k}) ? self.prefill.resources.{k} : "
        "{}) == "
        f"(has(self.decode.resources) && has(self.decode.resources.{k}) ? self.decode.resources.{k} : "
        "{})" for k in ("limits", "requests"))),
    ("extraArgs", "has(self.prefill.extraArgs) == has(self.decode.extraArgs) && "
                  "(!has(self.prefill.extraArgs) || self.prefill.extraArgs == self.decode.extraArgs)"),
]


def flex_shape_differences(prefill: RoleSpec, decode: RoleSpec) -> list[str]:
    """What keeps prefill and decode from being one shape (the same checks as the CEL rules)."""
    p, d = prefill.layout(), decode.layout()
    out = []
    if p.tensor != d.tensor:
        out.append(_FLEX_SHAPE[0][0])
    if p.data != d.data:
        out.append("parallelism.data")
    if prefill.parallelism.expert != decode.parallelism.expert:
        out.append("parallelism.expert")
    if prefill.pods_per_replica != decode.pods_per_replica:
        out.append("podsPerReplica")
    if prefill.resources != decode.resources:
        out.append("resources")
    if prefill.extra_args != decode.extra_args:
        out.append("extraArgs")
    return out


class KVCacheSpec(_Model):
    offload: OffloadSpec = Field(default_factory=OffloadSpec, description="KV cache offload tiers.")


class DisaggDeploymentSpec(_Model):
    model_config = ConfigDict(json_schema_extra=_validations(
        cel("self.scheduling.gang.minPrefill <= self.prefill.replicas",
            "scheduling.gang.minPrefill must not exceed prefill.replicas",
            field_path=".scheduling.gang.minPrefill"),
        cel("self.scheduling.gang.minDecode <= self.decode.replicas",
            "scheduling.gang.minDecode must not exceed decode.replicas",
            field_path=".scheduling.gang.minDecode"),
        cel("!self.planner.enabled || has(self.slo)", "planner.enabled needs slo targets (spec.slo)",
            field_path=".planner.enabled", reason="FieldValueRequired"),
        cel("!has(self.planner.gpuBudget) || self.planner.gpuBudget >= "
            f"self.scheduling.gang.minPrefill * {_cel_world('self.prefill')} + "
            f"self.scheduling.gang.minDecode * {_cel_world('self.decode')}",
            "planner.gpuBudget is below the GPUs the gang minimum needs", field_path=".planner.gpuBudget"),
        *(cel(f"{_cel_size(f'self.{role}', 'pipeline')} == 1", par.PIPELINE,
              field_path=f".{role}.parallelism.pipeline") for role in ("prefill", "decode")),
        *(cel(f"!has(self.flex) || ({rule})", FLEX_SHAPE_MESSAGE.format(what=what), field_path=".flex")
          for what, rule in _FLEX_SHAPE),
        cel("!has(oldSelf.flex) || has(self.flex)", FLEX_REMOVED_MESSAGE, field_path=".flex",
            reason="FieldValueForbidden"),
        cel(f"!has(self.flex) || {_cel_pods('self.prefill')} == 1", FLEX_MULTI_POD_MESSAGE, field_path=".flex",
            reason="FieldValueForbidden"),
        cel("!has(self.flex) || !has(self.router.disaggregation) || self.router.disaggregation != 'never'",
            FLEX_NEEDS_PREFILL_MESSAGE, field_path=".flex", reason="FieldValueForbidden"),
    ))

    model: ModelSpec = Field(description="The model to serve.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="The vLLM engine both roles run.")
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec,
                                        description="KV cache transfer from prefill to decode.")
    prefill: RoleSpec = Field(default_factory=RoleSpec, description="Prefill workers.")
    decode: RoleSpec = Field(default_factory=RoleSpec, description="Decode workers.")
    router: RouterSpec = Field(default_factory=RouterSpec, description="The OpenAI-compatible router.")
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, description="Gang and topology placement.")
    slo: SLOSpec | None = Field(None, description="Latency targets the planner holds.")
    planner: PlannerSpec = Field(default_factory=PlannerSpec, description="The SLO planner.")
    kv_cache: KVCacheSpec = Field(default_factory=KVCacheSpec, description="KV cache tiers.")
    tracing: TracingSpec | None = Field(None, description="OpenTelemetry traces of each request across the "
                                                          "router and both workers; off when unset.")
    flex: FlexSpec | None = Field(None, json_schema_extra={NO_DEFAULT: True},
                                  description="Flex workers: a third pool whose engines (kv_role kv_both) serve "
                                              "prefill or decode, one role at a time, switched at run time "
                                              "after a drain. Absent: no flex pool. Needs prefill and decode "
                                              "of one shape.")

    @model_validator(mode="after")
    def _check(self) -> DisaggDeploymentSpec:
        gang = self.scheduling.gang
        if gang.min_prefill > self.prefill.replicas:
            raise ValueError(f"scheduling.gang.minPrefill ({gang.min_prefill}) must not exceed prefill.replicas "
                             f"({self.prefill.replicas})")
        if gang.min_decode > self.decode.replicas:
            raise ValueError(f"scheduling.gang.minDecode ({gang.min_decode}) must not exceed decode.replicas "
                             f"({self.decode.replicas})")
        if self.planner.enabled and self.slo is None:
            raise ValueError("planner.enabled needs slo targets (spec.slo)")
        if self.planner.gpu_budget is not None and self.planner.gpu_budget < self.gang_min_gpus():
            raise ValueError("planner.gpuBudget is below the GPUs the gang minimum needs")
        for role in ("prefill", "decode"):
            if getattr(self, role).parallelism.pipeline != 1:
                raise ValueError(f"{role}: {par.PIPELINE} (pipeline {getattr(self, role).parallelism.pipeline})")
        if self.flex is not None:
            differ = flex_shape_differences(self.prefill, self.decode)
            if differ:
                raise ValueError(FLEX_SHAPE_MESSAGE.format(what=", ".join(differ)))
            if self.prefill.pods_per_replica > 1:
                raise ValueError(FLEX_MULTI_POD_MESSAGE)
            if self.router.disaggregation == Disaggregation.NEVER:
                raise ValueError(FLEX_NEEDS_PREFILL_MESSAGE)
        return self

    def gang_min_gpus(self) -> int:
        """GPUs of the gang's minimum set: whole replicas, each of all its pods' GPUs."""
        gang = self.scheduling.gang
        return (gang.min_prefill * self.prefill.layout().gpus_per_replica
                + gang.min_decode * self.decode.layout().gpus_per_replica)


# ---------------------------------------------------------------- status

class Condition(_Model):
    type: str = Field(max_length=316, description="Ready, GangScheduled, Progressing, Degraded, SLOMet, PlannerActive "
                                                  "or InferencePoolApplied.")
    status: str = Field(json_schema_extra={"enum": ["True", "False", "Unknown"]}, description="True, False or Unknown.")
    reason: str = Field(max_length=1024, description="CamelCase reason for the last transition.")
    message: str = Field("", max_length=32768, description="Human-readable details, with the numbers involved.")
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"},
                                      description="When the status last changed.")
    observed_generation: int | None = Field(None, ge=0, description="Generation the condition was computed for.")


class RoleStatus(_Model):
    desired: int = Field(0, ge=0, description="Replicas wanted now.")
    scheduled: int = Field(0, ge=0, description="Replicas bound to a node (a multi-pod replica by its leader).")
    ready: int = Field(0, ge=0, description="Replicas ready to serve (a multi-pod replica by its leader, "
                                            "which is ready once every rank joined).")
    updated: int = Field(0, ge=0, description="Replicas running the current template.")
    summary: str = Field("0/0", max_length=32, description="ready/desired, for kubectl's columns.")
    pods_per_replica: int | None = Field(None, ge=1, description="Pods of each replica, when it spans several.")
    pods_scheduled: int | None = Field(None, ge=0, description="Pods of every replica bound to a node, when "
                                                                "replicas span several pods.")
    group_restarts: int | None = Field(None, ge=0, description="Multi-pod replicas recreated as a whole since this "
                                                                "DisaggDeployment was created (one of their pods "
                                                                "failed or went; events GroupRestarted say which).")


class FlexStatus(_Model):
    desired: int = Field(0, ge=0, description="Flex workers wanted now.")
    ready: int = Field(0, ge=0, description="Flex workers ready to serve.")
    prefill: int = Field(0, ge=0, description="Flex workers whose serving role is prefill.")
    decode: int = Field(0, ge=0, description="Flex workers whose serving role is decode.")
    role_switches: int = Field(0, ge=0, description="Role switches the operator has seen since it started "
                                                    "(events RoleSwitched say which).")
    summary: str = Field("0/0", max_length=32, description="ready/desired, for kubectl's columns.")


class LatencyStatus(_Model):
    ttft_ms: float | None = Field(None, ge=0, description="Observed time to first token at the SLO percentile, ms.")
    itl_ms: float | None = Field(None, ge=0, description="Observed inter-token latency at the SLO percentile, ms.")
    percentile: float | None = Field(None, description="Percentile the figures are taken at.")


class PlannerStatus(_Model):
    replicas_managed_by: str = Field("", max_length=128,
                                     description="Field manager that owns prefill/decode replicas.")
    last_decision_time: str | None = Field(None, json_schema_extra={"format": "date-time"},
                                           description="When the planner last decided.")
    prefill_replicas: int | None = Field(None, ge=0, description="Prefill replicas the planner chose.")
    decode_replicas: int | None = Field(None, ge=0, description="Decode replicas the planner chose.")
    flex_replicas: int | None = Field(None, ge=0, description="Flex workers the planner chose (spec.flex).")
    flex_prefill: int | None = Field(None, ge=0, description="Flex workers the planner gave the prefill role.")
    flex_decode: int | None = Field(None, ge=0, description="Flex workers the planner gave the decode role.")
    reason: str = Field("", max_length=1024, description="CamelCase reason for the last decision.")
    message: str = Field("", max_length=32768, description="Why, with the numbers involved.")
    inputs: dict[str, float] = Field(default_factory=dict, max_length=64,
                                     description="Observed metrics the decision used.")
    prediction: dict[str, float] = Field(default_factory=dict, max_length=64,
                                         description="Predicted load for the next interval.")


class RouterStatus(RoleStatus):
    inference_pool: str | None = Field(None, max_length=253,
                                       description="The InferencePool (inference.networking.k8s.io/v1) whose "
                                                   "endpoint picker these routers are, while it exists (mode "
                                                   "picker).")


class AdapterStatus(_Model):
    name: str = Field(max_length=253, description="The adapter (spec.model.adapters[].name).")
    prefill: int = Field(0, ge=0, description="Prefill workers it is loaded on and ready.")
    decode: int = Field(0, ge=0, description="Decode workers it is loaded on and ready.")
    ready: bool = Field(False, description="Servable: loaded on at least one decode worker (a prefill without it "
                                           "leaves its requests to be prefilled by their decode).")
    message: str = Field("", max_length=4096, description="Why it is not ready on some worker (the engine's load "
                                                         "error), if so.")


class DisaggDeploymentStatus(_Model):
    observed_generation: int | None = Field(None, ge=0, description="Generation this status describes.")
    phase: Phase = Field(Phase.PENDING, description="Summary of the conditions.")
    conditions: list[Condition] = Field(default_factory=list, max_length=16,
                                        json_schema_extra={"x-kubernetes-list-type": "map",
                                                           "x-kubernetes-list-map-keys": ["type"]},
                                        description="Ready, GangScheduled, Progressing, Degraded, SLOMet, "
                                                    "PlannerActive, InferencePoolApplied.")
    prefill: RoleStatus = Field(default_factory=RoleStatus, description="Prefill replicas.")
    decode: RoleStatus = Field(default_factory=RoleStatus, description="Decode replicas.")
    router: RouterStatus = Field(default_factory=RouterStatus, description="Router replicas.")
    flex: FlexStatus | None = Field(None, description="Flex workers, per serving role (spec.flex).")
    endpoint: str = Field("", max_length=2048, description="OpenAI-compatible base URL inside the cluster.")
    latency: LatencyStatus = Field(default_factory=LatencyStatus, description="Observed latency.")
    planner: PlannerStatus | None = Field(None, description="The planner's last decision.")
    adapters: list[AdapterStatus] = Field(default_factory=list, max_length=MAX_ADAPTERS,
                                          json_schema_extra={"x-kubernetes-list-type": "map",
                                                             "x-kubernetes-list-map-keys": ["name"]},
                                          description="Per LoRA adapter, the workers of each role it is ready on, "
                                                      "as the routers load and see them (written by the routers).")


# ---------------------------------------------------------------- the object

class ObjectMeta(_Model):
    """The parts of metadata the project reads; the rest is kept as it is."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=DNS1035_LABEL)
    namespace: str | None = None


class DisaggDeployment(_Model):
    api_version: str = Field(API_VERSION, alias="apiVersion")
    kind: str = Field(KIND)
    metadata: ObjectMeta
    spec: DisaggDeploymentSpec = Field(description="What to serve and how: model, engine, the prefill and decode "
                                                   "roles, router, placement, SLOs and planner.")
    status: DisaggDeploymentStatus | None = Field(None, description="What the operator and planner observe; "
                                                                    "written by them only.")

    def to_manifest(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# Root-level CEL rule: names of derived objects must stay valid.
NAME_RULE = cel(
    f"size(self.metadata.name) <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{DNS1035_LABEL}')",
    f"metadata.name must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters, so the names derived "
    "from it (<name>-prefill, <name>-decode, <name>-router, ...) stay valid",
)
