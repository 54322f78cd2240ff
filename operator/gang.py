"""Gang objects per backend, and what a role's pods need to join the gang.

workload-api (default): a Workload with one CompositePodGroup template whose
gang policy needs both children (minGroupCount 2), and one PodGroup per role
with gang minCount = that role's minimum. The composite is what makes the
minimum hold *per role*: a single PodGroup with minCount = minPrefill +
minDecode over all pods could be satisfied by prefill pods alone. Replicas
above a role's minimum join its PodGroup and schedule one by one once the
group has been admitted. With a `required` topology key the composite carries
the scheduler's own topology constraint, so the whole gang lands in one domain.

Gang objects are immutable where it matters (policy, topology), so their names
carry a hash of everything they encode: changing the key or the minimums makes
new objects; the role Deployments then roll onto them (pods keep their place
until replaced), and objects no pod references any more are deleted.

Replicas of several pods (podsPerReplica > 1, operator/groups.py) are gangs themselves: a replica is never
partly placed. With the workload API their role is a CompositePodGroup under the deployment's (its
minGroupCount = the role's minimum, in whole replicas), and each replica is a PodGroup under it (gang
minCount = its pods) that the group controller creates with the replica's pods. A `required` topology key
then binds each replica, not the whole deployment: a replica's pods are what talk over the fast
interconnect (tensor, pipeline, expert parallel), while replicas of a wide-EP deployment together may
outgrow one NVLink domain, and KV between replicas crosses the RDMA network anyway. Such a role always
joins the gang, at a minimum of at least one replica (a PodGroup needs a parent to reference).

coscheduling (scheduler-plugins) and volcano: PodGroups for clusters running
those schedulers. Volcano's minTaskMember expresses the per-role minimum
exactly; scheduler-plugins' PodGroup has no per-role minimum, so each role gets
its own gang (all-or-nothing within a role, not across roles) — documented.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from disagg.api.names import LABEL_GANG, ROLE_DECODE, ROLE_PREFILL, child_name
from disagg.api.v1alpha1 import DisaggDeploymentSpec, GangBackend, TopologyMode

WORKLOAD_API = "scheduling.k8s.io/v1beta1"
COMPOSITE_API = "scheduling.k8s.io/v1alpha3"
COSCHEDULING_API = "scheduling.x-k8s.io/v1alpha1"
COSCHEDULING_LABEL = "scheduling.x-k8s.io/pod-group"
VOLCANO_API = "scheduling.volcano.sh/v1beta1"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
VOLCANO_TASK_ANNOTATION = "volcano.sh/task-spec"
VOLCANO_SCHEDULER = "volcano"
COSCHEDULING_SCHEDULER = "scheduler-plugins-scheduler"


@dataclass
class Gang:
    """Objects to apply, and per role the fields its pod template needs."""

    objects: list[dict[str, Any]] = field(default_factory=list)
    pod_fields: dict[str, dict[str, Any]] = field(default_factory=dict)  # role -> {spec: {...}, labels, annotations}
    name: str = ""                 # the gang's identity, put on pods as LABEL_GANG
    group_names: dict[str, str] = field(default_factory=dict)  # role -> PodGroup name
    # role -> the spec of each of its replicas' PodGroups (roles of multi-pod replicas, workload API)
    replica_groups: dict[str, dict[str, Any]] = field(default_factory=dict)


REPLICA_TEMPLATE = "{role}-replica"


def replica_pod_group(gang: Gang, role: str, group: str) -> dict[str, Any] | None:
    """The PodGroup of one multi-pod replica (named as its group), or None when its role has none."""
    spec = gang.replica_groups.get(role)
    if spec is None:
        return None
    return {"apiVersion": WORKLOAD_API, "kind": "PodGroup", "metadata": {"name": group}, "spec": dict(spec)}


def _pods(spec: DisaggDeploymentSpec) -> dict[str, int]:
    return {ROLE_PREFILL: spec.prefill.pods_per_replica, ROLE_DECODE: spec.decode.pods_per_replica}


def _hash(spec: DisaggDeploymentSpec) -> str:
    gang = spec.scheduling.gang
    topo = spec.scheduling.topology
    key = {"backend": gang.backend, "minPrefill": gang.min_prefill, "minDecode": gang.min_decode,
           "topology": [topo.key, topo.mode] if topo else None,
           "priority": spec.scheduling.priority_class_name}
    if any(n > 1 for n in _pods(spec).values()):
        key["podsPerReplica"] = _pods(spec)   # a new shape of gang: new objects (they are immutable)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:6]


def render(name: str, spec: DisaggDeploymentSpec) -> Gang:
    backend = spec.scheduling.gang.backend
    h = _hash(spec)
    gang_name = child_name(name, f"gang-{h}")
    mins = {ROLE_PREFILL: spec.scheduling.gang.min_prefill, ROLE_DECODE: spec.scheduling.gang.min_decode}
    pods = _pods(spec)
    if backend == GangBackend.WORKLOAD_API:
        mins = {role: max(n, 1) if pods[role] > 1 else n for role, n in mins.items()}
    members = [role for role, n in mins.items() if n > 0]
    out = Gang(name=gang_name)
    if backend == GangBackend.NONE or not members:
        return out
    for role in (ROLE_PREFILL, ROLE_DECODE):
        out.pod_fields[role] = {"labels": {LABEL_GANG: gang_name}, "annotations": {}, "spec": {}}
    topo = spec.scheduling.topology
    required_key = topo.key if topo and topo.mode == TopologyMode.REQUIRED else None
    priority = spec.scheduling.priority_class_name

    if backend == GangBackend.WORKLOAD_API:
        if any(pods[r] > 1 for r in members):
            _workload_api_groups(out, name, h, gang_name, mins, pods, members, required_key, priority)
        else:
            _workload_api(out, name, h, gang_name, mins, members, required_key, priority)
    elif backend == GangBackend.COSCHEDULING:
        for role in members:
            group = child_name(name, f"{role}-{h}")
            out.group_names[role] = group
            out.objects.append({"apiVersion": COSCHEDULING_API, "kind": "PodGroup", "metadata": {"name": group},
                                "spec": {"minMember": mins[role],
                                         "scheduleTimeoutSeconds": spec.scheduling.gang.timeout_seconds}})
            out.pod_fields[role]["labels"][COSCHEDULING_LABEL] = group
            out.pod_fields[role]["spec"]["schedulerName"] = COSCHEDULING_SCHEDULER
    elif backend == GangBackend.VOLCANO:
        group_spec: dict[str, Any] = {"minMember": sum(mins[r] for r in members),
                                      "minTaskMember": {r: mins[r] for r in members}}
        if priority:
            group_spec["priorityClassName"] = priority
        out.objects.append({"apiVersion": VOLCANO_API, "kind": "PodGroup", "metadata": {"name": gang_name},
                            "spec": group_spec})
        for role in members:
            out.group_names[role] = gang_name
            out.pod_fields[role]["annotations"] |= {VOLCANO_GROUP_ANNOTATION: gang_name,
                                                    VOLCANO_TASK_ANNOTATION: role}
            out.pod_fields[role]["spec"]["schedulerName"] = VOLCANO_SCHEDULER
    return out


def _workload_api(out: Gang, name: str, h: str, gang_name: str, mins: dict[str, int], members: list[str],
                  required_key: str | None, priority: str | None) -> None:
    constraints = {"topology": [{"key": required_key}]} if required_key else None
    composite = len(members) > 1
    templates = []
    for role in members:
        template: dict[str, Any] = {"name": role, "schedulingPolicy": {"gang": {"minCount": mins[role]}}}
        if constraints and not composite:
            template["schedulingConstraints"] = constraints
        templates.append(template)
    if composite:
        top: dict[str, Any] = {"name": "gang", "schedulingPolicy": {"gang": {"minGroupCount": len(members)}},
                               "podGroupTemplates": templates}
        if constraints:
            top["schedulingConstraints"] = constraints
        if priority:
            top["priorityClassName"] = priority
        workload_spec: dict[str, Any] = {"compositePodGroupTemplates": [top]}
    else:
        if priority:
            templates[0]["priorityClassName"] = priority
        workload_spec = {"podGroupTemplates": templates}
    out.objects.append({"apiVersion": WORKLOAD_API, "kind": "Workload", "metadata": {"name": gang_name},
                        "spec": workload_spec})
    if composite:
        cpg: dict[str, Any] = {"workloadRef": {"workloadName": gang_name, "templateName": "gang"},
                               "schedulingPolicy": {"gang": {"minGroupCount": len(members)}}}
        if constraints:
            cpg["schedulingConstraints"] = constraints
        if priority:
            cpg["priorityClassName"] = priority
        out.objects.append({"apiVersion": COMPOSITE_API, "kind": "CompositePodGroup",
                            "metadata": {"name": gang_name}, "spec": cpg})
    for role in members:
        group = child_name(name, f"{role}-{h}")
        out.group_names[role] = group
        pg: dict[str, Any] = {"workloadRef": {"workloadName": gang_name, "templateName": role},
                              "schedulingPolicy": {"gang": {"minCount": mins[role]}}}
        if composite:
            pg["parentCompositePodGroupName"] = gang_name
        elif constraints:
            pg["schedulingConstraints"] = constraints
        if priority and not composite:
            pg["priorityClassName"] = priority
        out.objects.append({"apiVersion": WORKLOAD_API, "kind": "PodGroup", "metadata": {"name": group},
                            "spec": pg})
        out.pod_fields[role]["spec"]["schedulingGroup"] = {"podGroupName": group}


def _workload_api_groups(out: Gang, name: str, h: str, gang_name: str, mins: dict[str, int], pods: dict[str, int],
                         members: list[str], required_key: str | None, priority: str | None) -> None:
    """The workload-API gang of a deployment with multi-pod replicas: root composite (every member role),
    under it a composite per multi-pod role (minGroupCount: its minimum replicas) whose replicas are
    PodGroups of minCount pods, each inside one topology domain, and a PodGroup per one-pod role as
    without groups (minCount: its minimum pods)."""
    constraints = {"topology": [{"key": required_key}]} if required_key else None
    top: dict[str, Any] = {"name": "gang", "schedulingPolicy": {"gang": {"minGroupCount": len(members)}}}
    pod_templates, composite_templates = [], []
    for role in members:
        if pods[role] > 1:
            replica = {"name": REPLICA_TEMPLATE.format(role=role),
                       "schedulingPolicy": {"gang": {"minCount": pods[role]}}}
            if constraints:
                replica["schedulingConstraints"] = constraints
            composite_templates.append({"name": role, "schedulingPolicy": {"gang": {"minGroupCount": mins[role]}},
                                        "podGroupTemplates": [replica]})
        else:
            pod_templates.append({"name": role, "schedulingPolicy": {"gang": {"minCount": mins[role]}}})
    if pod_templates:
        top["podGroupTemplates"] = pod_templates
    if composite_templates:
        top["compositePodGroupTemplates"] = composite_templates
    if priority:
        top["priorityClassName"] = priority
    out.objects.append({"apiVersion": WORKLOAD_API, "kind": "Workload", "metadata": {"name": gang_name},
                        "spec": {"compositePodGroupTemplates": [top]}})
    root: dict[str, Any] = {"workloadRef": {"workloadName": gang_name, "templateName": "gang"},
                            "schedulingPolicy": {"gang": {"minGroupCount": len(members)}}}
    if priority:
        root["priorityClassName"] = priority
    out.objects.append({"apiVersion": COMPOSITE_API, "kind": "CompositePodGroup", "metadata": {"name": gang_name},
                        "spec": root})
    for role in members:
        group = child_name(name, f"{role}-{h}")
        out.group_names[role] = group
        if pods[role] > 1:
            out.objects.append({"apiVersion": COMPOSITE_API, "kind": "CompositePodGroup", "metadata": {"name": group},
                                "spec": {"parentCompositePodGroupName": gang_name,
                                         "workloadRef": {"workloadName": gang_name, "templateName": role},
                                         "schedulingPolicy": {"gang": {"minGroupCount": mins[role]}}}})
            replica_spec: dict[str, Any] = {
                "parentCompositePodGroupName": group,
                "workloadRef": {"workloadName": gang_name, "templateName": REPLICA_TEMPLATE.format(role=role)},
                "schedulingPolicy": {"gang": {"minCount": pods[role]}}}
            if constraints:
                replica_spec["schedulingConstraints"] = constraints
            out.replica_groups[role] = replica_spec
            # each pod names its replica's PodGroup (operator/groups.py sets it per group)
            continue
        out.objects.append({"apiVersion": WORKLOAD_API, "kind": "PodGroup", "metadata": {"name": group}, "spec": {
            "workloadRef": {"workloadName": gang_name, "templateName": role},
            "schedulingPolicy": {"gang": {"minCount": mins[role]}}, "parentCompositePodGroupName": gang_name}})
        out.pod_fields[role]["spec"]["schedulingGroup"] = {"podGroupName": group}
