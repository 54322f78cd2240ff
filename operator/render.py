"""Desired state: a DisaggDeployment -> the manifests of every child object.

Pure functions (no cluster): the executor applies what they return, the tests
read it. Every child is owned by the DisaggDeployment and labelled with it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from disagg.api import contract, parallelism
from disagg.api import inferencepool as pools
from disagg.api.names import (
    DISK_OFFLOAD_PATH,
    GROUP,
    LABEL_DEPLOYMENT,
    LABEL_GROUP,
    LABEL_GROUP_POD,
    LABEL_HEADLESS,
    LABEL_MANAGED_BY,
    LABEL_ROLE,
    MANAGED_BY,
    MODEL_MOUNT_ROOT,
    ROLE_DECODE,
    ROLE_FLEX,
    ROLE_PREFILL,
    ROLE_ROUTER,
    ROUTER_API_KEYS_FILE,
    ROUTER_AUTH_DIR,
    child_name,
    group_name,
    group_pod_name,
    model_claim,
    ranks_service,
)
from disagg.api.v1alpha1 import (
    API_VERSION,
    DEFAULT_MAX_LORA_RANK,
    GPU_RESOURCE,
    KIND,
    PLURAL,
    DisaggDeployment,
    GangBackend,
    RoleSpec,
    PickerSpec,
    RouterAuth,
    Toleration,
    TracingSpec,
    TopologyMode,
)

from . import gang as gangs

HASH_ANNOTATION = "serving.disagg.dev/applied-hash"
CONTROL_PLANE_IMAGE = "disagg/control-plane:0.1.0"
# The router runs the operator's own image: the chart sets these to its image and pull policy, so a
# release from a mirror or a pinned digest never renders routers from an image nobody installed.
ROUTER_IMAGE_ENV, ROUTER_PULL_POLICY_ENV = "DISAGG_ROUTER_IMAGE", "DISAGG_ROUTER_IMAGE_PULL_POLICY"


def router_image() -> tuple[str, str | None]:
    """(image, pull policy or None for the cluster's default) of router pods."""
    return os.environ.get(ROUTER_IMAGE_ENV) or CONTROL_PLANE_IMAGE, os.environ.get(ROUTER_PULL_POLICY_ENV) or None
HTTP_PORT = contract.HTTP_PORT
NIXL_PORT = 5600
KV_EVENTS_PORT = 5557

# The NetworkPolicy of each DisaggDeployment (network_policy below): on unless the chart's
# networkPolicy.enabled is false; who may scrape the workers' metrics is the chart's
# networkPolicy.prometheus, a list of NetworkPolicyPeers as JSON. Read at each render, as the router image is.
NETWORK_POLICY_ENV, NETWORK_POLICY_PROMETHEUS_ENV = "DISAGG_NETWORK_POLICY", "DISAGG_NETWORK_POLICY_PROMETHEUS"
# The chart's default: Prometheus pods (kube-prometheus-stack, the Prometheus Operator and the
# community chart all label them so) in any namespace.
DEFAULT_PROMETHEUS_PEERS: list[dict[str, Any]] = [
    {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]


def network_policy_enabled() -> bool:
    return os.environ.get(NETWORK_POLICY_ENV, "true").strip().lower() not in ("false", "0", "no", "off")


def prometheus_peers() -> list[dict[str, Any]]:
    raw = os.environ.get(NETWORK_POLICY_PROMETHEUS_ENV)
    if not raw:
        return DEFAULT_PROMETHEUS_PEERS
    peers = json.loads(raw)
    if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
        raise ValueError(f"{NETWORK_POLICY_PROMETHEUS_ENV} must be a JSON list of NetworkPolicyPeer objects")
    return peers


def names(dd_name: str) -> dict[str, str]:
    return {
        ROLE_PREFILL: child_name(dd_name, ROLE_PREFILL),
        ROLE_DECODE: child_name(dd_name, ROLE_DECODE),
        ROLE_FLEX: child_name(dd_name, ROLE_FLEX),
        ROLE_ROUTER: child_name(dd_name, ROLE_ROUTER),
        "service": dd_name,  # the endpoint users call
        "network-policy": child_name(dd_name, "workers"),  # what it guards
        # spec.router.mode picker: the InferencePool (the gateway's backend) and the two policies that admit
        # the gateway's pods to the decode workers' serving port and to the routers' picker port
        "inference-pool": dd_name,
        "gateway-policy": child_name(dd_name, "gateway"),
        "router-policy": child_name(dd_name, ROLE_ROUTER),
    }


def selector(dd_name: str, role: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: dd_name, LABEL_ROLE: role}


def serving_selector(dd: DisaggDeployment, role: str) -> dict[str, str]:
    """The pods of a role that serve its API: every pod of a one-pod role; of a multi-pod role, each replica's
    leader (index 0), since its other pods run the engine's ranks headless (the role's Service selects them
    all, and the router's discovery leaves out the headless ones: a label selector of matchLabels alone, as
    the InferencePool's is, can only name the leaders)."""
    out = selector(dd.metadata.name, role)
    if multi_pod(dd, role):
        out[LABEL_GROUP_POD] = "0"
    return out


def _owner(dd: DisaggDeployment, uid: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": dd.metadata.name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def _meta(dd: DisaggDeployment, uid: str, name: str, role: str | None = None) -> dict[str, Any]:
    labels = {LABEL_DEPLOYMENT: dd.metadata.name, LABEL_MANAGED_BY: MANAGED_BY}
    if role:
        labels[LABEL_ROLE] = role
    return {"name": name, "namespace": dd.metadata.namespace, "labels": labels, "ownerReferences": [_owner(dd, uid)]}


def shape(dd: DisaggDeployment, role: str) -> RoleSpec:
    """The replica shape of a worker role: a flex worker's is the one prefill and decode share (the API
    refuses a spec.flex where they differ), so it is prefill's."""
    return dd.spec.prefill if role == ROLE_FLEX else getattr(dd.spec, role)


def worker_roles(dd: DisaggDeployment) -> tuple[str, ...]:
    """The worker pools: prefill, decode, and flex when spec.flex is set."""
    return (ROLE_PREFILL, ROLE_DECODE, *((ROLE_FLEX,) if dd.spec.flex is not None else ()))


def multi_pod(dd: DisaggDeployment, role: str) -> bool:
    """Whether a role's replicas span several pods (groups, operator/groups.py) instead of one Deployment."""
    return shape(dd, role).pods_per_replica > 1


def unrendered_layout(dd: DisaggDeployment) -> str | None:
    """Why this operator cannot render the deployment's workers, or None. Replicas of several pods are
    gangs of their own, which the workload API's nested groups express (operator/gang.py); the
    scheduler-plugins and Volcano PodGroups this operator renders have no per-replica level, so rather than
    start replicas that could be half placed (an engine waiting forever for ranks that never come), it
    applies nothing and says so."""
    wide = [f"{role}.podsPerReplica is {getattr(dd.spec, role).pods_per_replica}"
            for role in (ROLE_PREFILL, ROLE_DECODE) if multi_pod(dd, role)]
    backend = dd.spec.scheduling.gang.backend
    if not wide or backend in (GangBackend.WORKLOAD_API, GangBackend.NONE):
        return None
    return (f"{' and '.join(wide)} with scheduling.gang.backend {backend}: replicas spanning several pods "
            "need the workload-api backend (each replica its own gang) or none; nothing was applied")


def leader_address(dd: DisaggDeployment, role: str, replica: int) -> str:
    """How a multi-pod replica's pods name its leader: host name under the role's ranks Service, relative to
    the namespace (the pods' DNS search path completes it; the cluster domain is not assumed)."""
    return f"{group_pod_name(dd.metadata.name, role, replica, 0)}.{ranks_service(dd.metadata.name, role)}"


def tracing_args(tracing: TracingSpec) -> list[str]:
    """spec.tracing as the router's and the workers' flags (the same two on both)."""
    return ["--otlp-traces-endpoint", tracing.otlp_endpoint, "--trace-sampling-ratio", repr(tracing.sampling_ratio)]


def worker_args(dd: DisaggDeployment, role: str, rank: tuple[int, int] | None = None) -> list[str]:
    """The worker entrypoint's argument list: settings as flags, then the engine's
    own arguments after `--`, each passed literally (no shell ever sees them).
    Block size, context length and drain are set explicitly, from the same source
    as the router's (``disagg.api.contract``), never left to vLLM's defaults.
    ``rank``: (replica, pod index) of a pod of a multi-pod replica, whose flags place it in its group
    (``disagg.api.parallelism.rank_flags``); the pods other than the leader serve no metrics."""
    spec = dd.spec
    role_spec = shape(dd, role)
    max_len = contract.max_model_len(spec.engine.args)
    # a one-pod replica's other parallel dimensions (pipeline, data with expert parallel) inside its pod;
    # tensor parallel has its own flag, as it always had
    inside = parallelism.parallel_flags(parallelism.layout(role_spec))[2:]
    args = [
        "--role", role,
        "--model", spec.model.source,
        "--served-model-name", spec.model.name,
        "--tensor-parallel-size", str(role_spec.tensor_parallel_size),
        "--port", str(HTTP_PORT),
        "--metrics-port", str(contract.WORKER_METRICS_PORT),
        "--kv-connector", spec.kv_transfer.connector,
        "--kv-buffer-device", spec.kv_transfer.buffer_device,
        "--nixl-backends", ",".join(spec.kv_transfer.backends),
        "--nixl-side-channel-port", str(NIXL_PORT),
        "--kv-events-port", str(KV_EVENTS_PORT),
        "--kv-replay-port", str(contract.KV_REPLAY_PORT),
        "--kv-offload-cpu-gib", str(spec.kv_cache.offload.cpu_gib),
        "--kv-offload-disk-gib", str(spec.kv_cache.offload.disk_gib),
        "--block-size", str(contract.block_size(spec.engine.args)),
        "--drain-seconds", str(contract.DRAIN_SECONDS),
    ]
    if max_len is not None:
        args += ["--max-model-len", str(max_len)]
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    if spec.model.tokenizer:
        args += ["--tokenizer", spec.model.tokenizer]
    if spec.tracing is not None:
        args += tracing_args(spec.tracing)
    # LoRA on in every worker of both roles alike (a prefill and its decode must be able to run the same
    # adapter); the adapters themselves are loaded at run time by the routers, so they are not here
    if spec.model.max_loras is not None:
        inside += ["--enable-lora", "--max-loras", str(spec.model.max_loras),
                   "--max-lora-rank", str(spec.model.max_lora_rank or DEFAULT_MAX_LORA_RANK)]
    if rank is not None:
        replica, index = rank
        inside += parallelism.rank_flags(parallelism.layout(role_spec), index, leader_address(dd, role, replica))
        if index > 0:
            i = args.index("--metrics-port")
            del args[i:i + 2]
    return args + ["--", *inside, *spec.engine.args, *role_spec.extra_args]


LORA_RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def _model_volumes(dd: DisaggDeployment, adapters: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) for pvc:// model, tokenizer and adapter sources: each claim read-only at
    MODEL_MOUNT_ROOT/<claim>, where local_model_path() points the worker and the router. Adapters on a claim
    already mounted (the model's, or another adapter's) change nothing here, so adding one rolls no pod; the
    first adapter on a new claim adds its volume (the one adapter change that restarts the workers)."""
    model = dd.spec.model
    claims = dict.fromkeys(c for c in (model_claim(model.source), model_claim(model.tokenizer)) if c)
    if adapters:   # the router tokenizes with the base model's tokenizer: adapters' claims are the workers' alone
        claims.update(dict.fromkeys(sorted({c for a in model.adapters if (c := model_claim(a.source))})))
    volumes = [{"name": f"model-{i}", "persistentVolumeClaim": {"claimName": c, "readOnly": True}}
               for i, c in enumerate(claims)]
    mounts = [{"name": f"model-{i}", "mountPath": f"{MODEL_MOUNT_ROOT}/{c}", "readOnly": True}
              for i, c in enumerate(claims)]
    return volumes, mounts


def _credentials(dd: DisaggDeployment) -> list[dict[str, Any]]:
    ref = dd.spec.model.secret_ref
    if not ref:
        return []
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


# Restricted by Pod Security Standards (tests/test_operator_security.py applies them on the API
# server): the images' non-root user, the runtime's default seccomp profile, no privilege escalation,
# no capabilities, a read-only root filesystem with one writable emptyDir (contract.SCRATCH_DIR).
# fsGroup lets that user read volumes provisioned for root; OnRootMismatch keeps the kubelet from
# walking every file of a large model volume at each start.
def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": contract.RUN_AS_USER, "runAsGroup": contract.RUN_AS_USER,
            "fsGroup": contract.RUN_AS_USER, "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security(add: tuple[str, ...] = ()) -> dict[str, Any]:
    caps: dict[str, Any] = {"drop": ["ALL"], **({"add": list(add)} if add else {})}
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": caps}


SCRATCH_VOLUME = "tmp"


def _scratch(user_env: set[str]) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """(env, volume, mount) of the writable scratch directory: no size limit, since an hf:// model's
    weights are downloaded there (the node's ephemeral storage, as the container's own layer was)."""
    env = [{"name": k, "value": v} for k, v in contract.SCRATCH_ENV.items() if k not in user_env]
    return (env, {"name": SCRATCH_VOLUME, "emptyDir": {}},
            {"name": SCRATCH_VOLUME, "mountPath": contract.SCRATCH_DIR})


def _resources(role_spec: RoleSpec) -> dict[str, Any]:
    limits = {k: str(v) for k, v in role_spec.resources.limits.items()}
    requests = {k: str(v) for k, v in role_spec.resources.requests.items()}
    limits.setdefault(GPU_RESOURCE, str(parallelism.layout(role_spec).gpus_per_pod))
    out: dict[str, Any] = {"limits": limits}
    if requests:
        out["requests"] = requests
    return out


def _affinity(dd: DisaggDeployment, gang_name: str, role_spec: RoleSpec) -> dict[str, Any] | None:
    """Pod affinity on the gang label where the scheduler's own topology constraint is not used:
    `preferred` mode (any backend) and `required` mode with backends other than the Workload API."""
    topo = dd.spec.scheduling.topology
    if not topo:
        return None
    if topo.mode == TopologyMode.REQUIRED and dd.spec.scheduling.gang.backend == GangBackend.WORKLOAD_API:
        return None  # the CompositePodGroup/PodGroup carries the constraint
    term = {"labelSelector": {"matchLabels": {LABEL_DEPLOYMENT: dd.metadata.name}}, "topologyKey": topo.key}
    if topo.mode == TopologyMode.REQUIRED:
        return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": term}]}}


def _tolerations(tolerations: list[Toleration]) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]


def _gang_min(dd: DisaggDeployment, role: str) -> int:
    if dd.spec.scheduling.gang.backend == GangBackend.NONE:
        return 0
    gang = dd.spec.scheduling.gang
    return gang.min_prefill if role == ROLE_PREFILL else gang.min_decode


def kv_revision(dd: DisaggDeployment) -> str:
    """The deployment's KV revision (:func:`disagg.api.contract.kv_revision`): one for both roles."""
    spec = dd.spec
    return contract.kv_revision(
        model=spec.model.source, model_revision=spec.model.revision, tokenizer=spec.model.tokenizer,
        image=spec.engine.image, engine_args=spec.engine.args,
        engine_env={e.name: e.value for e in spec.engine.env},
        kv_transfer={"connector": spec.kv_transfer.connector, "backends": list(spec.kv_transfer.backends),
                     "buffer_device": spec.kv_transfer.buffer_device},
        roles={role: (getattr(spec, role).tensor_parallel_size,
                      [*parallelism.parallel_flags(parallelism.layout(getattr(spec, role)))[2:],
                       *getattr(spec, role).extra_args])
               for role in (ROLE_PREFILL, ROLE_DECODE)})


def revision_generation(dd: DisaggDeployment, live: tuple[str | None, int | None]) -> int:
    """The generation stamped on the pods of the deployment's KV revision: the live workers' (``live``:
    (revision, generation) from the running Deployment's pod template) while the revision is unchanged,
    else this generation, so scaling or an unrelated change never rolls pods, and a new revision always
    orders after the old."""
    revision, generation = live
    if revision == kv_revision(dd) and generation is not None:
        return generation
    return int((dd.metadata.model_extra or {}).get("generation") or 0)


def worker_pod_template(dd: DisaggDeployment, role: str, gang: gangs.Gang, generation: int | None = None,
                        rank: tuple[int, int] | None = None) -> dict[str, Any]:
    """A worker pod's metadata and spec: of every pod of a one-pod role's Deployment, or (``rank``:
    (replica, pod index)) of one pod of a multi-pod replica (operator/groups.py), whose leader (index 0)
    serves as a one-pod worker does and whose other pods run the engine's ranks headless: no API, so no
    probes on it (the leader's readiness is the replica's, as it is only ready once every rank joined)."""
    role_spec = shape(dd, role)
    pod_fields = gang.pod_fields.get(role, {"labels": {}, "annotations": {}, "spec": {}})
    revision = kv_revision(dd)
    if generation is None:
        generation = revision_generation(dd, (None, None))
    labels = {**selector(dd.metadata.name, role), LABEL_MANAGED_BY: MANAGED_BY, **pod_fields["labels"],
              contract.KV_REVISION_LABEL: revision, contract.KV_REVISION_GENERATION_LABEL: str(generation)}
    env = [{"name": contract.KV_REVISION_ENV, "value": revision},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "$(POD_IP)"},
           *({"name": e.name, "value": e.value} for e in dd.spec.engine.env)]
    if dd.spec.model.max_loras is not None and LORA_RUNTIME_ENV not in {e.name for e in dd.spec.engine.env}:
        # /v1/load_lora_adapter and /v1/unload_lora_adapter, which the routers call (router/adapters.py)
        env.append({"name": LORA_RUNTIME_ENV, "value": "True"})
    env += _credentials(dd)
    scratch_env, scratch_volume, scratch_mount = _scratch({e.name for e in dd.spec.engine.env})
    env = [*scratch_env, *env]
    model_volumes, model_mounts = _model_volumes(dd)
    http = {"httpGet": {"path": contract.WORKER_HEALTH_PATH, "port": "http"}}
    container = {
        "name": "worker",
        "image": dd.spec.engine.image,
        "imagePullPolicy": dd.spec.engine.image_pull_policy,
        "command": ["python", "-m", "disagg.workers"],
        "args": worker_args(dd, role, rank),
        "env": env,
        "ports": [{"name": "http", "containerPort": HTTP_PORT},
                  {"name": contract.WORKER_METRICS_PORT_NAME, "containerPort": contract.WORKER_METRICS_PORT},
                  {"name": "nixl", "containerPort": NIXL_PORT},
                  {"name": "kv-events", "containerPort": KV_EVENTS_PORT},
                  {"name": "kv-replay", "containerPort": contract.KV_REPLAY_PORT}],
        "resources": _resources(role_spec),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, scratch_mount, *model_mounts],
        # spec.kvTransfer.ipcLock: RDMA memory registration beyond the runtime's locked-memory limit
        "securityContext": _container_security(("IPC_LOCK",) if dd.spec.kv_transfer.ipc_lock else ()),
        # timeouts above the kubelet's 1 s default: a busy engine's /health can take seconds, and a
        # liveness probe that times out under load restarts the pod and drops every request on it
        "startupProbe": {**http, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 180},
        "readinessProbe": {**http, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**http, "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 6},
        # a terminating worker serves on until every router's discovery has seen it leave; only then
        # does vLLM start its drain (which refuses new requests)
        "lifecycle": {"preStop": {"sleep": {"seconds": contract.ENDPOINT_GRACE_SECONDS}}},
    }
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}, scratch_volume,
               *model_volumes]
    disk_gib = dd.spec.kv_cache.offload.disk_gib
    if disk_gib:
        # vLLM's fs tier (0.32) does not evict by size: the volume's limit is the bound, and the
        # ephemeral-storage request makes the scheduler pick a node with that much local disk
        volumes.append({"name": "kv-offload", "emptyDir": {"sizeLimit": f"{disk_gib}Gi"}})
        container["volumeMounts"].append({"name": "kv-offload", "mountPath": DISK_OFFLOAD_PATH})
        container["resources"].setdefault("requests", {})["ephemeral-storage"] = f"{disk_gib}Gi"
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        # the preStop sleep, the drain vLLM runs (--shutdown-timeout) and the supervisor's margin: one budget
        "terminationGracePeriodSeconds": contract.termination_grace_seconds(contract.DRAIN_SECONDS),
        "enableServiceLinks": False,
        # nothing in a worker calls the Kubernetes API: no token in its file system
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(),
        **pod_fields["spec"],
    }
    if role_spec.node_selector:
        pod_spec["nodeSelector"] = dict(role_spec.node_selector)
    if role_spec.tolerations:
        pod_spec["tolerations"] = _tolerations(role_spec.tolerations)
    if dd.spec.scheduling.priority_class_name:
        pod_spec["priorityClassName"] = dd.spec.scheduling.priority_class_name
    affinity = _affinity(dd, gang.name, role_spec)
    if affinity:
        pod_spec["affinity"] = affinity
    template_meta: dict[str, Any] = {"labels": labels}
    if pod_fields["annotations"]:
        template_meta["annotations"] = dict(pod_fields["annotations"])
    if rank is not None:
        _as_group_pod(dd, role, rank, gang, template_meta, pod_spec)
    return {"metadata": template_meta, "spec": pod_spec}


def _as_group_pod(dd: DisaggDeployment, role: str, rank: tuple[int, int], gang: gangs.Gang,
                  meta: dict[str, Any], pod_spec: dict[str, Any]) -> None:
    """Turn a worker pod template into pod ``rank`` of a multi-pod replica (operator/groups.py says why each)."""
    replica, index = rank
    name = dd.metadata.name
    group = group_name(name, role, replica)
    pods = getattr(dd.spec, role).pods_per_replica
    meta["labels"] |= {LABEL_GROUP: group, LABEL_GROUP_POD: str(index)}
    container = pod_spec["containers"][0]
    # LeaderWorkerSet's variables, under our prefix: what a user's own engine arguments may refer to
    container["env"] += [{"name": "DISAGG_GROUP", "value": group},
                         {"name": "DISAGG_GROUP_SIZE", "value": str(pods)},
                         {"name": "DISAGG_GROUP_INDEX", "value": str(index)},
                         {"name": "DISAGG_LEADER_ADDRESS", "value": leader_address(dd, role, replica)}]
    if not any(e["name"] == "VLLM_HOST_IP" for e in container["env"]):
        # the address vLLM binds its cross-pod sockets to and tells its peers: the pod's (its own guess
        # asks a route to a public address, which a cluster without egress does not have)
        container["env"].append({"name": "VLLM_HOST_IP", "value": "$(POD_IP)"})
    # a host name under the ranks Service: how the other pods find the leader (workers/leader.py waits for it)
    pod_spec["hostname"] = group_pod_name(name, role, replica, index)
    pod_spec["subdomain"] = ranks_service(name, role)
    # a torch.distributed group cannot be rejoined: a pod whose engine exits fails, and the operator
    # recreates its whole replica (a container restarted in place would wait for peers that moved on)
    pod_spec["restartPolicy"] = "Never"
    group_pg = gangs.replica_pod_group(gang, role, group)
    if group_pg is not None:
        pod_spec["schedulingGroup"] = {"podGroupName": replica_pod_group_name(gang, group)}
    if index > 0:
        meta["labels"][LABEL_HEADLESS] = "true"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            container.pop(probe, None)
        container["ports"] = []
        # the leader drains first: this pod's ranks stay until the leader's engine has finished its
        # requests, then go (its grace period bounds the wait)
        container["lifecycle"] = {"preStop": {"exec": {"command": [
            "python", "-m", "disagg.workers.leader", "wait-gone", leader_address(dd, role, replica),
            str(HTTP_PORT)]}}}
    topo = dd.spec.scheduling.topology
    if topo and not (topo.mode == TopologyMode.REQUIRED and group_pg is not None):
        # where the scheduler's constraint is not used: the replica's pods near each other
        term = {"labelSelector": {"matchLabels": {LABEL_GROUP: group}}, "topologyKey": topo.key}
        affinity = ({"requiredDuringSchedulingIgnoredDuringExecution": [term]} if topo.mode == TopologyMode.REQUIRED
                    else {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]})
        pod_spec["affinity"] = {"podAffinity": affinity}


def replica_pod_group_name(gang: gangs.Gang, group: str) -> str:
    """A replica's PodGroup: its group's name and the gang's hash (a new gang shape, new groups)."""
    return f"{group}-{gang.name.rpartition('-')[2]}"


def worker_deployment(dd: DisaggDeployment, uid: str, role: str, gang: gangs.Gang,
                      generation: int | None = None, hold: bool = False) -> dict[str, Any]:
    template = worker_pod_template(dd, role, gang, generation)
    # a flex pod's serving role (LABEL_SERVING_ROLE) is not in its template: it changes per pod at run time,
    # written on the pod (handlers._run_flex, or the planner), and a template change would roll every pod
    replicas = dd.spec.flex.replicas if role == ROLE_FLEX else getattr(dd.spec, role).replicas
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(dd, uid, names(dd.metadata.name)[role], role),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(dd.metadata.name, role)},
            # Surge, never unavailability: a rollout never leaves zero ready workers of a role.
            # The surge covers the role's gang minimum, so a new gang (after a topology or
            # minimum change) can be placed while the old pods keep serving.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {
                "maxSurge": max(1, _gang_min(dd, role)), "maxUnavailable": 0}},
            # a rollout to a new KV revision holds every old pod until the new revision has a ready
            # pair (contract.ROLLOUT_HOLD_SECONDS, operator/revisions.py)
            "minReadySeconds": contract.ROLLOUT_HOLD_SECONDS if hold else 0,
            # the API requires the progress deadline above minReadySeconds (600: Kubernetes' default)
            "progressDeadlineSeconds": 600 + (contract.ROLLOUT_HOLD_SECONDS if hold else 0),
            "template": template,
        },
    }


# The router's endpoint picker port (spec.router.mode picker), on its container and its Service.
PICKER_PORT_NAME = "grpc"

# The router needs no GPU: keep it off GPU nodes when others exist (a preference: spec.router's
# nodeSelector and tolerations decide where it may run, this only ranks those nodes).
_OFF_GPU_NODES = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
    {"weight": 100, "preference": {"matchExpressions": [
        {"key": f"{GPU_RESOURCE}.present", "operator": "DoesNotExist"}]}}]}}


def _api_keys(auth: RouterAuth) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, mount) of spec.router.auth's Secret key at ROUTER_API_KEYS_FILE. A volume, not an env
    variable: the kubelet updates a mounted Secret in place and the router re-reads it, so keys rotate
    without a restart. The whole volume is mounted (a subPath mount would never be updated); the file is
    readable by the pod's group (fsGroup) only. The operator never reads the Secret itself: a missing one
    leaves the router pod waiting in ContainerCreating with a FailedMount event naming it."""
    volume = {"name": "api-keys", "secret": {"secretName": auth.secret_name, "defaultMode": 0o440,
                                             "items": [{"key": auth.key,
                                                        "path": ROUTER_API_KEYS_FILE.rsplit("/", 1)[1]}]}}
    return volume, {"name": "api-keys", "mountPath": ROUTER_AUTH_DIR, "readOnly": True}


def router_deployment(dd: DisaggDeployment, uid: str) -> dict[str, Any]:
    n = names(dd.metadata.name)
    r = dd.spec.router
    labels = {**selector(dd.metadata.name, ROLE_ROUTER), LABEL_MANAGED_BY: MANAGED_BY}
    ready = {"httpGet": {"path": contract.ROUTER_READY_PATH, "port": "http"}}
    live = {"httpGet": {"path": contract.ROUTER_LIVE_PATH, "port": "http"}}
    engine_args = dd.spec.engine.args
    context = contract.max_model_len(engine_args)
    image, pull_policy = router_image()
    container: dict[str, Any] = {
        "name": "router", "image": image, **({"imagePullPolicy": pull_policy} if pull_policy else {}),
        "command": ["python", "-m", "disagg.router"],
        "args": ["--port", str(HTTP_PORT), "--model", dd.spec.model.name,
                 "--tokenizer", dd.spec.model.tokenizer or dd.spec.model.source,
                 "--block-size", str(contract.block_size(engine_args)),
                 *(["--max-model-len", str(context)] if context is not None else []),
                 "--kv-events-topic", contract.KV_EVENTS_TOPIC,
                 *(["--max-loras", str(dd.spec.model.max_loras)] if dd.spec.model.max_loras is not None else []),
                 "--policy", r.policy, "--overlap-weight", str(r.overlap_weight),
                 "--max-load-skew", str(r.max_load_skew), "--disaggregation", r.disaggregation,
                 "--local-prefill-threshold-tokens", str(r.local_prefill_threshold_tokens),
                 "--max-in-flight", str(r.max_in_flight), "--max-queued", str(r.max_queued),
                 "--queue-timeout-seconds", str(r.queue_timeout_seconds),
                 "--connect-timeout-seconds", str(r.connect_timeout_seconds),
                 "--prefill-timeout-seconds", str(r.prefill_timeout_seconds),
                 "--first-token-timeout-seconds", str(r.first_token_timeout_seconds),
                 "--idle-timeout-seconds", str(r.idle_timeout_seconds),
                 "--max-migrations", str(r.max_migrations),
                 "--request-timeout-seconds", str(r.request_timeout_seconds),
                 "--max-body-bytes", str(r.max_body_bytes), "--body-timeout-seconds", str(r.body_timeout_seconds),
                 *(["--api-keys-file", ROUTER_API_KEYS_FILE] if r.auth else []),
                 *(tracing_args(dd.spec.tracing) if dd.spec.tracing is not None else []),
                 "--discovery", "endpointslices", "--namespace", dd.metadata.namespace or "default",
                 "--deployment", dd.metadata.name,
                 "--prefill-service", n[ROLE_PREFILL], "--decode-service", n[ROLE_DECODE],
                 *(["--flex-service", n[ROLE_FLEX], "--flex-drain-seconds", str(dd.spec.flex.switch_drain_seconds)]
                   if dd.spec.flex is not None else []),
                 # N processes on the http port, process i scraped alone on metrics-i (router/processes.py)
                 "--processes", str(r.processes), "--metrics-port", str(contract.ROUTER_METRICS_PORT),
                 "--drain-seconds", str(contract.DRAIN_SECONDS)],
        "ports": [{"name": "http", "containerPort": HTTP_PORT},
                  *({"name": contract.router_metrics_port_name(i), "containerPort": contract.ROUTER_METRICS_PORT + i}
                    for i in range(r.processes))],
        # readiness: can serve (a healthy decode); liveness: the process answers. A decode outage
        # takes routers out of the Service and never restarts them (their prefix index survives).
        "readinessProbe": {**ready, "periodSeconds": 5, "timeoutSeconds": 5},
        "livenessProbe": {**live, "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 6},
        # the workers' drain contract: a terminating router keeps accepting until kube-proxy and any
        # gateway have dropped it from the Service, then stops accepting and lets its streams finish
        "lifecycle": {"preStop": {"sleep": {"seconds": contract.ENDPOINT_GRACE_SECONDS}}},
    }
    picker = r.picker_settings()
    if picker:
        # also the endpoint picker of the deployment's InferencePool: Envoy's ext_proc (and gRPC health) there
        container["args"] += ["--mode", "picker", "--grpc-port", str(picker.port)]
        container["ports"].append({"name": PICKER_PORT_NAME, "containerPort": picker.port})
    res = {k: {kk: str(vv) for kk, vv in v.items()}
           for k, v in (("requests", r.resources.requests), ("limits", r.resources.limits)) if v}
    if res:
        container["resources"] = res
    # the router tokenizes with the model's own tokenizer: same source, same credentials
    scratch_env, scratch_volume, scratch_mount = _scratch(set())
    container["env"] = [*scratch_env, *_credentials(dd)]
    container["securityContext"] = _container_security()
    volumes, mounts = _model_volumes(dd, adapters=False)
    # the router keeps its ServiceAccount token: it watches the workers' EndpointSlices (router_rbac)
    pod_spec: dict[str, Any] = {"serviceAccountName": n[ROLE_ROUTER], "containers": [container],
                                # preStop sleep + the streams' drain + the margin: without it, the kubelet's
                                # default 30 s cut every stream older than that at each router rollout
                                "terminationGracePeriodSeconds": contract.termination_grace_seconds(),
                                "enableServiceLinks": False, "affinity": _OFF_GPU_NODES,
                                "securityContext": _pod_security()}
    if r.node_selector:
        pod_spec["nodeSelector"] = dict(r.node_selector)
    if r.tolerations:
        pod_spec["tolerations"] = _tolerations(r.tolerations)
    container["volumeMounts"] = [scratch_mount, *mounts]
    pod_spec["volumes"] = [scratch_volume, *volumes]
    if r.auth:
        volume, mount = _api_keys(r.auth)
        container["volumeMounts"].append(mount)
        pod_spec["volumes"].append(volume)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(dd, uid, n[ROLE_ROUTER], ROLE_ROUTER),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": selector(dd.metadata.name, ROLE_ROUTER)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def services(dd: DisaggDeployment, uid: str) -> list[dict[str, Any]]:
    n = names(dd.metadata.name)
    out = [{
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(dd, uid, n["service"], ROLE_ROUTER),
        "spec": {"selector": selector(dd.metadata.name, ROLE_ROUTER),
                 "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    }]
    picker = dd.spec.router.picker_settings()
    if picker:
        # the InferencePool's endpointPickerRef names this port (its service port); gRPC in cleartext
        out[0]["spec"]["ports"].append({"name": PICKER_PORT_NAME, "port": picker.port, "targetPort": PICKER_PORT_NAME,
                                        "appProtocol": "kubernetes.io/h2c"})
    for role in worker_roles(dd):
        out.append({
            "apiVersion": "v1", "kind": "Service",
            "metadata": _meta(dd, uid, n[role], role),
            "spec": {"clusterIP": "None", "selector": selector(dd.metadata.name, role),
                     "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http"},
                               {"name": "nixl", "port": NIXL_PORT, "targetPort": "nixl"},
                               {"name": "kv-events", "port": KV_EVENTS_PORT, "targetPort": "kv-events"},
                               {"name": "kv-replay", "port": contract.KV_REPLAY_PORT,
                                "targetPort": "kv-replay"}]},
        })
        if multi_pod(dd, role):
            # host names for a multi-pod replica's pods, published before they are ready: the leader
            # is ready only after its other pods found it by that name
            out.append({
                "apiVersion": "v1", "kind": "Service",
                "metadata": _meta(dd, uid, ranks_service(dd.metadata.name, role), role),
                "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                         "selector": selector(dd.metadata.name, role)},
            })
    return out


def _workers_of(dd_name: str) -> dict[str, Any]:
    return {"matchExpressions": [{"key": LABEL_DEPLOYMENT, "operator": "In", "values": [dd_name]},
                                 {"key": LABEL_ROLE, "operator": "In",
                                  "values": [ROLE_PREFILL, ROLE_DECODE, ROLE_FLEX]}]}


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def network_policy(dd: DisaggDeployment, uid: str) -> dict[str, Any]:
    """Ingress to the deployment's prefill and decode pods, which serve vLLM's API, the NIXL side channel
    and the KV events without authentication: from its own workers on every port (NIXL's side channel,
    and the ports UCX's TCP transport picks for the KV itself, which are not fixed), from its own routers
    to vLLM's HTTP port, the KV events and their replay socket, from Prometheus (prometheus_peers) to the
    workers' metrics port only (contract.WORKER_METRICS_PORT: vLLM's /metrics relayed alone, since its API
    port also serves the model to anyone admitted there). Nothing else, including other deployments in the
    namespace. Router pods are not selected: their port stays as open as it is without this policy. Egress
    is not restricted (model downloads). Only enforced by a CNI that implements NetworkPolicy
    (tests/test_network_policy.py proves it with traffic under a real enforcer)."""
    name = dd.metadata.name
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": _workers_of(name)}]},
        {"from": [{"podSelector": {"matchLabels": selector(name, ROLE_ROUTER)}}],
         "ports": _tcp(HTTP_PORT, KV_EVENTS_PORT, contract.KV_REPLAY_PORT)},
    ]
    peers = prometheus_peers()
    if peers:  # an empty `from` would admit every source: no peers, no rule
        ingress.append({"from": peers, "ports": _tcp(contract.WORKER_METRICS_PORT)})
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(dd, uid, names(name)["network-policy"]),
        "spec": {"podSelector": _workers_of(name), "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _gateway_peers(picker: PickerSpec) -> list[dict[str, Any]]:
    """The gateway's pods: every pod in the namespaces spec.router.picker.gatewayNamespaceSelector matches
    (``{}``: every namespace; a gateway's Envoy pods live wherever the platform put them)."""
    return [{"namespaceSelector": picker.gateway_namespace_selector.manifest()}]


def picker_network_policies(dd: DisaggDeployment, uid: str) -> list[dict[str, Any]]:
    """In picker mode the gateway's Envoy pods send each request to the decode pod the router picked, and ask
    the router's picker port which: two policies admit them there and nowhere else. ``<name>-gateway``: the
    decode pods that serve (the InferencePool's members) admit the gateway's pods on vLLM's HTTP port; added
    to ``<name>-workers``, which keeps every other port of theirs as closed as in proxy mode. ``<name>-router``:
    the router pods, which no policy selects in proxy mode, become selected, so it admits what reached them
    before from anywhere (the OpenAI API port, which clients call, and the metrics ports) and the picker port
    from the gateway's pods only. Nothing else is opened. [] in proxy mode."""
    picker = dd.spec.router.picker_settings()
    if picker is None:
        return []
    name, n, r = dd.metadata.name, names(dd.metadata.name), dd.spec.router
    peers = _gateway_peers(picker)
    gateway = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(dd, uid, n["gateway-policy"], ROLE_DECODE),
        "spec": {"podSelector": {"matchLabels": serving_selector(dd, ROLE_DECODE)}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": peers, "ports": _tcp(HTTP_PORT)}]},
    }
    router = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(dd, uid, n["router-policy"], ROLE_ROUTER),
        "spec": {"podSelector": {"matchLabels": selector(name, ROLE_ROUTER)}, "policyTypes": ["Ingress"],
                 "ingress": [
                     # no `from`: any source, as with no policy (clients; whoever scrapes the metrics)
                     {"ports": _tcp(HTTP_PORT, *(contract.ROUTER_METRICS_PORT + i for i in range(r.processes)))},
                     {"from": peers, "ports": _tcp(picker.port)}]},
    }
    return [gateway, router]


def inference_pool(dd: DisaggDeployment, uid: str) -> dict[str, Any] | None:
    """The deployment's InferencePool (inference.networking.k8s.io/v1) in picker mode, else None: its members
    are the decode pods that serve (:func:`serving_selector`, the pods the router's discovery routes to), on
    vLLM's HTTP port, and its endpoint picker is the routers' picker port on the deployment's Service. A
    gateway's HTTPRoute names it as a backend (group inference.networking.k8s.io, kind InferencePool)."""
    picker = dd.spec.router.picker_settings()
    if picker is None:
        return None
    n = names(dd.metadata.name)
    pool = pools.InferencePool.model_validate({
        "metadata": _meta(dd, uid, n["inference-pool"]),
        "spec": {"selector": {"matchLabels": serving_selector(dd, ROLE_DECODE)},
                 "targetPorts": [{"number": HTTP_PORT}],
                 "endpointPickerRef": {"group": "", "kind": "Service", "name": n["service"],
                                       "port": {"number": picker.port}, "failureMode": picker.failure_mode}}})
    return pool.model_dump(by_alias=True, exclude_none=True, mode="json")


def router_rbac(dd: DisaggDeployment, uid: str) -> list[dict[str, Any]]:
    """The router discovers workers from the role Services' EndpointSlices, and each worker's KV revision
    from its pod's labels: it lists both, in its namespace; it reads its own DisaggDeployment's adapters and
    writes their status, and nothing else (tests/test_rbac.py audits the
    router's own account: every verb here used, none denied)."""
    name = names(dd.metadata.name)[ROLE_ROUTER]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(dd, uid, name, ROLE_ROUTER)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(dd, uid, name, ROLE_ROUTER),
         "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]},
                   {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
                   # its own DisaggDeployment only: the LoRA adapters it loads onto the workers (spec.model),
                   # and status.adapters, which it alone can tell (router/adapters.py)
                   {"apiGroups": [GROUP], "resources": [PLURAL], "resourceNames": [dd.metadata.name],
                    "verbs": ["get"]},
                   {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "resourceNames": [dd.metadata.name],
                    "verbs": ["patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": _meta(dd, uid, name, ROLE_ROUTER),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name,
                       "namespace": dd.metadata.namespace or "default"}]},
    ]


# What a deployment may have had rendered and no longer renders (the operator's networkPolicy option turned
# off, spec.router.mode back to proxy): (apiVersion, kind, names() key), deleted by the reconcile.
PRUNABLE = [("networking.k8s.io/v1", "NetworkPolicy", "network-policy"),
            ("networking.k8s.io/v1", "NetworkPolicy", "gateway-policy"),
            ("networking.k8s.io/v1", "NetworkPolicy", "router-policy"),
            (pools.API_VERSION, pools.KIND, "inference-pool")]
PICKER_ONLY = {"gateway-policy", "router-policy", "inference-pool"}


def endpoint(dd: DisaggDeployment) -> str:
    return f"http://{names(dd.metadata.name)['service']}.{dd.metadata.namespace}.svc:80/v1"


def children(dd: DisaggDeployment, uid: str, generation: int | None = None,
             hold: bool = False) -> tuple[list[dict[str, Any]], gangs.Gang]:
    """Every child manifest, gang objects first (pods reference them), the InferencePool last (picker mode),
    each stamped with its content hash.
    ``generation`` orders the workers' KV revision (:func:`revision_generation`; default: this one);
    ``hold``: a rollout to a new KV revision waits for its first ready pair (:mod:`.revisions`)."""
    gang = gangs.render(dd.metadata.name, dd.spec)
    out: list[dict[str, Any]] = []
    for obj in gang.objects:
        meta = _meta(dd, uid, obj["metadata"]["name"])
        out.append({**obj, "metadata": meta})
    out += router_rbac(dd, uid)
    out += services(dd, uid)
    if network_policy_enabled():
        out.append(network_policy(dd, uid))
        out += picker_network_policies(dd, uid)
    # a role of multi-pod replicas has no Deployment: the status loop runs its groups (operator/groups.py)
    out += [worker_deployment(dd, uid, role, gang, generation, hold) for role in worker_roles(dd)
            if not multi_pod(dd, role)]
    out.append(router_deployment(dd, uid))
    pool = inference_pool(dd, uid)
    if pool is not None:
        # last: its API may be missing (its CRD not installed), which fails nothing else (children.apply)
        out.append(pool)
    for obj in out:
        stamp(obj)
    return out, gang


def stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """A child manifest with its content hash (HASH_ANNOTATION), which apply compares with the live object's."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
    obj["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = digest
    return obj
