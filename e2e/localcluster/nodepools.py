"""Simulated GPU node pools, declared in ``e2e/clusters/*.yaml`` and run by kwok.

``nodes()`` is a pure function from a pool file to Node manifests (unit-tested
without a cluster); ``apply_node_pools`` creates them; kwok's stages (written by
``write_kwok_config``) make the nodes Ready and bound pods Running with IPs.
"""

from __future__ import annotations

import ipaddress
import string
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from .controlplane import LocalCluster

CLUSTERS = Path(__file__).resolve().parent.parent / "clusters"
DEFAULT_POOLS = CLUSTERS / "default.yaml"

ZONE_LABEL = "topology.kubernetes.io/zone"
RACK_LABEL = "topology.disagg.dev/rack"
CLIQUE_LABEL = "nvidia.com/gpu.clique"
POOL_LABEL = "topology.disagg.dev/pool"
GPU = "nvidia.com/gpu"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
# A pod annotated with this key is held in the named failure state by kwok
# instead of becoming Ready (ImagePullBackOff or CrashLoopBackOff), so status
# reporting can be tested against the real control plane.
FAULT_ANNOTATION = "sim.disagg.dev/fault"
# Simulated nodes' addresses: a slice of the benchmarking range 198.18.0.0/15 (see controlplane.py's address
# plan), never a private range a machine's real networks may use. Nothing is ever sent to them.
KWOK_NODE_CIDR = ipaddress.ip_network("198.18.64.0/18")


class Taint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str
    value: str = ""
    effect: str = Field(pattern="^(NoSchedule|PreferNoSchedule|NoExecute)$")


class Pool(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,20}$")
    zones: int = Field(1, ge=1, le=26)
    racks_per_zone: int = Field(1, alias="racksPerZone", ge=1, le=1000)
    nvlink_domains_per_rack: int = Field(1, alias="nvlinkDomainsPerRack", ge=1, le=1000)
    nodes_per_domain: int = Field(1, alias="nodesPerDomain", ge=1, le=10000)
    gpus: int = Field(0, ge=0, le=64)
    gpu_product: str = Field("", alias="gpuProduct")
    cpu: str = "64"
    memory: str = "256Gi"
    pods: str = "110"
    instance_type: str = Field("", alias="instanceType")
    labels: dict[str, str] = Field(default_factory=dict)
    taints: list[Taint] = Field(default_factory=list)


class PoolFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pools: list[Pool] = Field(min_length=1)


def load(path: Path | None = None) -> PoolFile:
    path = path or DEFAULT_POOLS
    return PoolFile.model_validate(yaml.safe_load(Path(path).read_text()))


def domain_labels(pool: Pool, zone: int, rack: int, domain: int) -> dict[str, str]:
    """The labels every node of one NVLink domain carries (topology, pool, GPU product), so a real node can
    join a domain of a pool file exactly as its simulated nodes do."""
    zone_name = f"zone-{string.ascii_lowercase[zone]}"
    rack_name = f"{zone_name}-rack-{rack}"
    labels = {ZONE_LABEL: zone_name, RACK_LABEL: rack_name, POOL_LABEL: pool.name,
              **({"node.kubernetes.io/instance-type": pool.instance_type} if pool.instance_type else {}),
              **pool.labels}
    if pool.gpus:
        labels |= {CLIQUE_LABEL: f"{pool.name}.{rack_name}-nvl-{domain}", f"{GPU}.present": "true",
                   f"{GPU}.count": str(pool.gpus), f"{GPU}.product": pool.gpu_product or "simulated"}
    return labels


def nodes(pools: PoolFile, first_address: int = 0) -> list[dict[str, Any]]:
    """Node manifests (with status) for every node of every pool; addresses from the
    `first_address`-th of KWOK_NODE_CIDR on (pools added to a running cluster start past its own)."""
    out = []
    serial = first_address
    for pool in pools.pools:
        for z in range(pool.zones):
            for r in range(pool.racks_per_zone):
                for d in range(pool.nvlink_domains_per_rack):
                    for n in range(pool.nodes_per_domain):
                        name = f"{pool.name}-{string.ascii_lowercase[z]}{r}-{d}-{n}"
                        labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                  "kubernetes.io/arch": "amd64", "type": "kwok", **domain_labels(pool, z, r, d)}
                        resources = {"cpu": pool.cpu, "memory": pool.memory, "pods": pool.pods,
                                     "ephemeral-storage": "1Ti"}
                        if pool.gpus:
                            resources[GPU] = str(pool.gpus)
                        ip = str(KWOK_NODE_CIDR[serial])
                        serial += 1
                        out.append({
                            "apiVersion": "v1", "kind": "Node",
                            "metadata": {"name": name, "labels": labels,
                                         "annotations": {KWOK_ANNOTATION: "fake",
                                                         "node.alpha.kubernetes.io/ttl": "0"}},
                            "spec": {"taints": [t.model_dump() for t in pool.taints]},
                            "status": {"capacity": resources, "allocatable": resources,
                                       "addresses": [{"type": "InternalIP", "address": ip},
                                                     {"type": "Hostname", "address": name}]},
                        })
    if serial > KWOK_NODE_CIDR.num_addresses:
        raise ValueError(f"{serial} simulated nodes do not fit their address range {KWOK_NODE_CIDR}")
    return out


def real_node_labels(path: Path | None = None) -> dict[str, str]:
    """The labels of the NVLink domain the real node joins: the first domain of the first GPU pool."""
    pool = next((p for p in load(path).pools if p.gpus), None)
    if pool is None:
        raise ValueError(f"{path or DEFAULT_POOLS}: no GPU pool for the real node to join")
    return domain_labels(pool, 0, 0, 0)


def apply_node_pools(cluster: LocalCluster, path: Path | None = None) -> list[str]:
    from kubernetes import client, config

    api = client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))
    return _create_nodes(api, nodes(load(path)))


def _create_nodes(core, manifests: list[dict[str, Any]]) -> list[str]:
    """Create the nodes (one already there is kept); their names."""
    from kubernetes.client.exceptions import ApiException

    for node in manifests:
        try:
            core.create_node(node)
        except ApiException as e:
            if e.status != 409:
                raise
    return [n["metadata"]["name"] for n in manifests]


def add_gpu_pools(core, path: Path, first_address: int, timeout: float = 90) -> list[str]:
    """The GPU pools of another pool file added to a running cluster (``core``: a CoreV1Api), their node
    addresses from ``first_address`` on (past the cluster's own); returns their names once every one is Ready
    without the node lifecycle controller's start-up taints. Delete them with ``core.delete_node``."""
    pools = load(path)
    pools.pools = [p for p in pools.pools if p.gpus]
    names = _create_nodes(core, nodes(pools, first_address=first_address))

    def ready(name: str) -> bool:
        node = core.read_node(name)
        return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or []) \
            and not any(t.key.startswith("node.kubernetes.io/") for t in node.spec.taints or [])
    deadline = time.monotonic() + timeout
    while not all(ready(n) for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the nodes of {path.name} not Ready within {timeout:.0f} s")
        time.sleep(0.5)
    return names


def wait_ready(cluster: LocalCluster, timeout: float) -> None:
    """Every simulated node Ready without start-up taints, and the default ServiceAccount present."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    from .controlplane import ClusterError

    api = client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))
    deadline = time.monotonic() + timeout
    pending: list[str] = []
    while time.monotonic() < deadline:
        pending = []
        for node in api.list_node(label_selector="type=kwok").items:
            ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
            tainted = any(t.key.startswith("node.kubernetes.io/") for t in node.spec.taints or [])
            if not ready or tainted:
                pending.append(node.metadata.name)
        if not pending:
            try:
                api.read_namespaced_service_account("default", "default")
                return
            except ApiException as e:
                if e.status != 404:
                    raise
                pending = ["serviceaccount default/default"]
        time.sleep(0.5)
    raise ClusterError(f"timed out waiting for nodes to become Ready: {pending[:10]}\nkwok log:\n"
                       + cluster.tail("kwok"))


# kwok stages: how simulated nodes and pods move through their lifecycle.
_NODE_READY = """\
{{ $now := Now }}
conditions:
- {type: Ready, status: "True", reason: KubeletReady, message: "simulated by kwok",
   lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ $now | Quote }}}
- {type: MemoryPressure, status: "False", reason: KubeletHasSufficientMemory, message: "",
   lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ $now | Quote }}}
- {type: DiskPressure, status: "False", reason: KubeletHasNoDiskPressure, message: "",
   lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ $now | Quote }}}
- {type: PIDPressure, status: "False", reason: KubeletHasSufficientPID, message: "",
   lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ $now | Quote }}}
- {type: NetworkUnavailable, status: "False", reason: RouteCreated, message: "",
   lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ $now | Quote }}}
nodeInfo:
  architecture: amd64
  operatingSystem: linux
  kubeletVersion: simulated
  containerRuntimeVersion: simulated
  kernelVersion: simulated
  kubeProxyVersion: simulated
  osImage: simulated
  machineID: ""
  systemUUID: ""
  bootID: ""
phase: Running
"""

_POD_RUNNING = """\
{{ $now := Now }}
conditions:
- {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
{{ range .spec.readinessGates }}
- {type: {{ .conditionType | Quote }}, status: "True", lastTransitionTime: {{ $now | Quote }}}
{{ end }}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: true
  started: true
  restartCount: 0
  state: {running: {startedAt: {{ $now | Quote }}}}
{{ end }}
{{ with NodeIPsWith .spec.nodeName }}
hostIP: {{ index . 0 | Quote }}
hostIPs: [{{ range . }}{ip: {{ . | Quote }}},{{ end }}]
{{ end }}
{{ with PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
podIP: {{ index . 0 | Quote }}
podIPs: [{{ range . }}{ip: {{ . | Quote }}},{{ end }}]
{{ end }}
phase: Running
startTime: {{ $now | Quote }}
"""

# A running pod the node lifecycle controller marked NotReady (its node's heartbeat looked late, as
# happens when a loaded control plane's informers lag) is reported ready again, as a kubelet whose
# node is alive does; without this it stayed NotReady for good and its Deployment never recovered.
_POD_READY_AGAIN = """\
{{ $now := Now }}
conditions:
- {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
"""

_POD_FAULT = """\
{{ $now := Now }}
{{ $fault := index .metadata.annotations "%s" }}
conditions:
- {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ $now | Quote }}}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: false
  started: false
  restartCount: {{ if eq $fault "CrashLoopBackOff" }}5{{ else }}0{{ end }}
  state:
    waiting:
      reason: {{ $fault | Quote }}
      message: {{ printf "simulated %%s" $fault | Quote }}
{{ end }}
{{ with NodeIPsWith .spec.nodeName }}
hostIP: {{ index . 0 | Quote }}
{{ end }}
phase: {{ if eq $fault "CrashLoopBackOff" }}Running{{ else }}Pending{{ end }}
startTime: {{ $now | Quote }}
""" % FAULT_ANNOTATION


def _stage(name: str, kind: str, match: list[dict[str, Any]], template: str | None = None,
           delete: bool = False, delay_ms: int = 0) -> dict[str, Any]:
    spec: dict[str, Any] = {"resourceRef": {"apiGroup": "v1", "kind": kind},
                            "selector": {"matchExpressions": match},
                            "next": {"delete": True} if delete else {"statusTemplate": template}}
    if delay_ms:
        spec["delay"] = {"durationMilliseconds": delay_ms, "jitterDurationMilliseconds": delay_ms * 2}
    return {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": name}, "spec": spec}


def write_kwok_config(path: Path, node_lease_seconds: int = 40) -> Path:
    not_ready = {"key": '.status.conditions.[] | select( .type == "Ready" ) | .status',
                 "operator": "NotIn", "values": ["True"]}
    ready = dict(not_ready, operator="In")
    alive = {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}
    fault_key = f'.metadata.annotations["{FAULT_ANNOTATION}"]'
    docs = [
        {"apiVersion": "config.kwok.x-k8s.io/v1alpha1", "kind": "KwokConfiguration",
         # kwok applies no defaults to a configuration file's options: set them all.
         "options": {"nodeLeaseDurationSeconds": node_lease_seconds, "nodeLeaseParallelism": 8, "podPlayStageParallelism": 8,
                     "nodePlayStageParallelism": 8, "podsOnNodeSyncParallelism": 4}},
        _stage("node-initialize", "Node", [not_ready], _NODE_READY),
        _stage("node-heartbeat", "Node", [ready, {"key": ".status.phase", "operator": "In", "values": ["Running"]}],
               _NODE_READY, delay_ms=300_000),
        _stage("pod-ready", "Pod", [alive, {"key": ".status.phase", "operator": "In", "values": ["Pending"]},
                                    {"key": fault_key, "operator": "DoesNotExist"}, not_ready], _POD_RUNNING),
        _stage("pod-ready-again", "Pod", [alive, {"key": ".status.phase", "operator": "In", "values": ["Running"]},
                                          {"key": fault_key, "operator": "DoesNotExist"}, not_ready],
               _POD_READY_AGAIN),
        _stage("pod-fault", "Pod", [alive, {"key": fault_key, "operator": "Exists"},
                                    {"key": '.status.containerStatuses.[].state.waiting.reason',
                                     "operator": "DoesNotExist"}], _POD_FAULT),
        _stage("pod-delete", "Pod", [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}], delete=True),
    ]
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False, width=200))
    return path
