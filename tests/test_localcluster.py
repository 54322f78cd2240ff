"""The local control plane: GPU pools, the scheduler placing GPU pods for real,
and gang scheduling through the Workload/PodGroup API."""

import os
from pathlib import Path

import pytest
from kubernetes import client

from disagg.e2e.localcluster import LocalCluster, nodepools
from disagg.e2e.localcluster.controlplane import _alive, _port_open
from disagg.e2e.testing import pod, wait_for


def test_nodes_show_gpu_pools(cluster):
    out = cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.clique", "-L", "topology.kubernetes.io/zone").stdout
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["NAME", "STATUS"] and "GPU.CLIQUE" in lines[0]
    gpu_rows = [line.split() for line in lines[1:] if line.startswith("h100-")]
    assert len(gpu_rows) == 32 and all(row[1] == "Ready" for row in gpu_rows)
    assert len({row[-2] for row in gpu_rows}) == 8  # eight NVLink domains


def _core(api_client):
    return client.CoreV1Api(api_client)


def _scheduled_condition(p):
    return next((c for c in (p.status.conditions or []) if c.type == "PodScheduled"), None)


def test_gpu_pod_runs_and_oversized_pod_stays_pending(api_client, namespace):
    core = _core(api_client)
    core.create_namespaced_pod(namespace, pod("fits", gpus=8))
    core.create_namespaced_pod(namespace, pod("too-big", gpus=9))
    running = wait_for(lambda: (p := core.read_namespaced_pod("fits", namespace)).status.phase == "Running" and p,
                       60, "8-GPU pod Running")
    node = core.read_node(running.spec.node_name)
    assert node.metadata.labels["nvidia.com/gpu.count"] == "8"
    assert running.status.pod_ip, "kwok gives running pods an IP"

    cond = wait_for(lambda: _scheduled_condition(core.read_namespaced_pod("too-big", namespace)),
                    60, "PodScheduled condition on the 9-GPU pod")
    assert cond.status == "False" and cond.reason == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in cond.message
    assert core.read_namespaced_pod("too-big", namespace).status.phase == "Pending"


def _ready(p):
    return any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])


def test_a_running_pod_marked_not_ready_by_the_node_controller_is_ready_again(api_client, namespace):
    """What the node lifecycle controller does when a node's heartbeat looks late (a loaded control plane's
    informers lag): Ready=False on a running pod. A live kubelet reports it ready again; kwok must too, or
    the pod's Deployment stays unavailable for good (seen at 3,000 nodes in bench/operator_scale.py)."""
    core = _core(api_client)
    core.create_namespaced_pod(namespace, pod("marked", gpus=1))
    running = wait_for(lambda: (p := core.read_namespaced_pod("marked", namespace)).status.phase == "Running"
                       and _ready(p) and p, 60, "pod Running and Ready")
    conditions = [{"type": c.type, "status": "False" if c.type == "Ready" else c.status,
                   **({"reason": "NodeNotReady"} if c.type == "Ready" else {})} for c in running.status.conditions]
    marked = core.patch_namespaced_pod_status("marked", namespace, {"status": {"conditions": conditions}})
    assert not _ready(marked)
    again = wait_for(lambda: (p := core.read_namespaced_pod("marked", namespace)) and _ready(p) and p, 60,
                     "the pod Ready again")
    assert again.status.phase == "Running" and again.status.pod_ip == running.status.pod_ip


def _pod_group(name, min_count):
    return {"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup", "metadata": {"name": name},
            "spec": {"schedulingPolicy": {"gang": {"minCount": min_count}}}}


def test_gang_binds_all_or_nothing(api_client, namespace):
    """Five 8-GPU pods pinned to one 4-node NVLink domain cannot all fit: the gang
    (minCount 5) leaves every one unbound, where plain pods would bind four.
    Four pods with minCount 4 in another domain bind together."""
    core = _core(api_client)
    objects = client.CustomObjectsApi(api_client)
    cliques = sorted({n.metadata.labels[nodepools.CLIQUE_LABEL]
                      for n in core.list_node(label_selector=nodepools.CLIQUE_LABEL).items})
    too_big, fits = cliques[-1], cliques[-2]
    for group, count, clique in (("too-big", 5, too_big), ("fits", 4, fits)):
        objects.create_namespaced_custom_object("scheduling.k8s.io", "v1beta1", namespace, "podgroups",
                                                _pod_group(group, count))
        for i in range(count):
            core.create_namespaced_pod(namespace, pod(f"{group}-{i}", gpus=8, pod_group=group,
                                                      node_selector={nodepools.CLIQUE_LABEL: clique}))

    def bound(prefix):
        return [p for p in core.list_namespaced_pod(namespace).items
                if p.metadata.name.startswith(prefix) and p.spec.node_name]

    wait_for(lambda: len(bound("fits-")) == 4, 60, "the fitting gang to bind")
    # the oversized gang: every pod has been tried and found unschedulable, none bound
    wait_for(lambda: all((c := _scheduled_condition(p)) and c.status == "False"
                         for p in core.list_namespaced_pod(namespace).items if p.metadata.name.startswith("too-big-")),
             60, "the oversized gang to be reported unschedulable")
    # Then a node joins the oversized gang's domain, without GPUs (still no room): a cluster event the
    # scheduler answers by trying the gang again. That attempt is waited for (its FailedScheduling events),
    # so the check below follows a scheduling cycle that could have bound part of the gang, not a sleep.
    def attempts() -> int:
        return sum(e.count or 1 for e in core.list_namespaced_event(
            namespace, field_selector="reason=FailedScheduling").items
            if e.involved_object.name.startswith("too-big-"))
    before = attempts()
    template = next(n for n in core.list_node(label_selector=f"{nodepools.CLIQUE_LABEL}={too_big}").items)
    joiner = f"gpu-less-{namespace}"[:63]
    core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": joiner, "labels": {**template.metadata.labels, "kubernetes.io/hostname": joiner},
        "annotations": {nodepools.KWOK_ANNOTATION: "fake"}},
        "status": {"capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
                   "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"}}})
    try:
        wait_for(lambda: attempts() > before, 120, "the scheduler's next attempt at the oversized gang")
        assert bound("too-big-") == []
    finally:
        core.delete_node(joiner)


def test_up_twice_is_harmless_and_down_leaves_nothing(tmp_path):
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text("pools:\n  - name: gpu\n    gpus: 8\n    nodesPerDomain: 1\n")
    c = LocalCluster("lifecycle", state_dir=tmp_path / "state")
    try:
        c.up(nodes_file=tiny)
        first = c._state()
        c.up(nodes_file=tiny)
        assert c._state()["pids"] == first["pids"], "a second up must reuse the running cluster"
        assert c.kubectl("get", "nodes", "-o", "name").stdout.split() == ["node/gpu-a0-0-0"]
    finally:
        c.down()
    assert not any(_alive(pid) for pid in first["pids"].values())
    assert not any(_port_open(port) for port in first["ports"].values())
    assert not (tmp_path / "state").exists()
