"""The operator under faults: killed and restarted, a node of the gang lost, the API
server restarted. Each test runs its own operator (under the least-privilege role)."""

from __future__ import annotations

import time

from kubernetes import client
from prometheus_client import REGISTRY

from disagg.api import metrics as m
from disagg.e2e.localcluster import nodepools
from disagg.e2e.operator_fixture import running_operator
from disagg.e2e.testing import DD, dd_manifest, wait_for


def _children(api_client, namespace):
    """(kind, name) -> resourceVersion of everything in the namespace the operator writes."""
    apps, core = client.AppsV1Api(api_client), client.CoreV1Api(api_client)
    custom = client.CustomObjectsApi(api_client)
    out = {}
    for d in apps.list_namespaced_deployment(namespace).items:
        out[("Deployment", d.metadata.name)] = d.metadata.resource_version
    for s in core.list_namespaced_service(namespace).items:
        out[("Service", s.metadata.name)] = s.metadata.resource_version
    for group, version, plural in (("scheduling.k8s.io", "v1beta1", "podgroups"),
                                   ("scheduling.k8s.io", "v1beta1", "workloads"),
                                   ("scheduling.k8s.io", "v1alpha3", "compositepodgroups"),
                                   ("serving.disagg.dev", "v1alpha1", "disaggdeployments")):
        for obj in custom.list_namespaced_custom_object(group, version, namespace, plural)["items"]:
            out[(plural, obj["metadata"]["name"])] = obj["metadata"]["resourceVersion"]
    return out


def _operator_counts() -> dict[str, float]:
    """The in-process operator's reconciles by result and child writes by kind (its own counters)."""
    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == m.OPERATOR_RECONCILES:
                out[f"reconcile/{sample.labels['result']}"] = sample.value
            elif sample.name == m.OPERATOR_CHILD_WRITES:
                out[f"write/{sample.labels['kind']}"] = sample.value
    return out


def _handled(obj) -> bool:
    """kopf has recorded the spec it handled and holds no handler progress on the object."""
    annotations = obj["metadata"].get("annotations") or {}
    return "kopf.zalando.org/last-handled-configuration" in annotations and not any(
        k.startswith("kopf.zalando.org/") and k != "kopf.zalando.org/last-handled-configuration"
        for k in annotations) and not (obj.get("status") or {}).get("kopf", {}).get("progress")


def test_killed_mid_reconcile_converges_and_a_second_reconcile_writes_nothing(
        api_client, namespace, operator_kubeconfig):
    apps = client.AppsV1Api(api_client)
    with running_operator(operator_kubeconfig):
        dd = DD(api_client, namespace, dd_manifest("crash", decode={"replicas": 2}))
        # stop it as soon as the first children exist, before it can finish
        wait_for(lambda: apps.list_namespaced_deployment(namespace).items
                 or client.CustomObjectsApi(api_client).list_namespaced_custom_object(
                     "scheduling.k8s.io", "v1beta1", namespace, "podgroups")["items"], 60, "first children")
    with running_operator(operator_kubeconfig):
        dd.wait_phase("Ready")
        # the status can be Ready while kopf is still finishing the create handler (a loaded machine):
        # its own bookkeeping on the object comes last, so wait for it before taking the snapshot
        wait_for(lambda: _handled(dd.get()), 60, "kopf's record that the creation was handled")
    # snapshot once this operator has stopped, so nothing it still had in flight is blamed on the next one
    before = _children(api_client, namespace)
    rs = client.AppsV1Api(api_client).list_namespaced_replica_set(namespace).items
    assert len(rs) == 3, "one ReplicaSet per Deployment: no duplicate rollout"
    assert sorted(k for k in before if k[0] == "Deployment") == [
        ("Deployment", "crash-decode"), ("Deployment", "crash-prefill"), ("Deployment", "crash-router")]
    # a fresh operator (scoped to this namespace, so its counters are this deployment's) resumes it and
    # reconciles it again: the reconcile is counted unchanged and writes no child. The DisaggDeployment's own
    # resourceVersion is left out: the status loop of a fresh operator may rewrite status (seen once in a full
    # run: the object's resourceVersion moved while every child's stayed).
    counts = _operator_counts()

    def resumed() -> bool:
        return any(v > counts.get(k, 0) for k, v in _operator_counts().items() if k.startswith("reconcile/"))

    with running_operator(operator_kubeconfig, namespaces=(namespace,)):
        wait_for(resumed, 60, "the resumed operator's reconcile")
    after = _operator_counts()
    changed = {k: after[k] - counts.get(k, 0) for k in after if after[k] != counts.get(k, 0)}
    assert set(changed) == {"reconcile/unchanged"}, changed
    now = _children(api_client, namespace)
    assert {k: v for k, v in now.items() if k[0] != "disaggdeployments"} == {
        k: v for k, v in before.items() if k[0] != "disaggdeployments"}


def test_losing_a_node_of_the_gang_degrades_then_recovers(api_client, namespace, operator_kubeconfig):
    """Decode pinned to two dedicated 8-GPU nodes; one node is deleted: the pod garbage
    collector removes its pod, the replacement cannot fit -> Degraded; a new node -> Ready."""
    core = client.CoreV1Api(api_client)
    pool = f"pool-{namespace[-6:]}"

    def node(i):
        n = nodepools.nodes(nodepools.PoolFile.model_validate({"pools": [{"name": "spare", "gpus": 8}]}))[0]
        name = f"{pool}-{i}"
        n["metadata"]["name"] = name
        n["metadata"]["labels"] |= {"kubernetes.io/hostname": name, "test.disagg.dev/pool": pool}
        return n

    for i in (0, 1):
        core.create_node(node(i))
    try:
        with running_operator(operator_kubeconfig):
            dd = DD(api_client, namespace, dd_manifest(
                "lose", decode={"replicas": 2, "tensorParallelSize": 8,
                                "nodeSelector": {"test.disagg.dev/pool": pool}},
                scheduling={"gang": {"minPrefill": 1, "minDecode": 2}}))
            dd.wait_phase("Ready")
            core.delete_node(f"{pool}-0")
            try:
                cond = dd.wait_condition("Degraded", "True", "ReplicasUnavailable", timeout=150)
            except AssertionError as e:
                pods = [(p.metadata.name, p.spec.node_name, p.status.phase) for p in dd.pods()]
                raise AssertionError(f"{e}\npods: {pods}\nnodes: "
                                     f"{[n.metadata.name for n in core.list_node().items if pool in n.metadata.name]}")
            assert "decode 1/2 ready" in cond["message"]
            assert dd.status()["phase"] == "Degraded"
            core.create_node(node(2))
            dd.wait_phase("Ready", timeout=120)
            assert dd.condition("Degraded")["status"] == "False"
    finally:
        for i in (0, 1, 2):
            try:
                core.delete_node(f"{pool}-{i}")
            except client.exceptions.ApiException:
                pass
        # Pods bound to a node that no longer exists wait for the pod garbage collector's 40 s quarantine
        # before the namespace can go; they are kwok's (no containers), so remove them now.
        for p in core.list_namespaced_pod(namespace).items:
            if (p.spec.node_name or "").startswith(f"{pool}-"):
                try:
                    core.delete_namespaced_pod(p.metadata.name, namespace, grace_period_seconds=0)
                except client.exceptions.ApiException:
                    pass


def test_operator_recovers_from_an_api_server_restart(cluster, api_client, namespace, operator_kubeconfig):
    with running_operator(operator_kubeconfig):
        dd = DD(api_client, namespace, dd_manifest("restart"))
        dd.wait_phase("Ready")
        cluster.stop_component("kube-apiserver")
        time.sleep(3)
        cluster.start_component("kube-apiserver")
        dd.patch_spec({"decode": {"replicas": 2}})
        wait_for(lambda: dd.status().get("decode", {}).get("summary") == "2/2" and dd.status()["phase"] == "Ready",
                 120, "the operator to act after the API server came back")
