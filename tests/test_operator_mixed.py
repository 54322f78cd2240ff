"""A mixed GPU fleet (e2e/clusters/mixed.yaml): prefill on one GPU product, decode on another. The
GangScheduled condition counts each role's free GPUs on the nodes its own nodeSelector and tolerations
admit, names the role that cannot be placed, and says InsufficientCapacity only when that is true."""

from __future__ import annotations

import pytest
from kubernetes import client

from disagg.e2e.localcluster import nodepools
from disagg.e2e.testing import DD, dd_manifest, wait_for

MIXED = nodepools.CLUSTERS / "mixed.yaml"
PRODUCT = "nvidia.com/gpu.product"
TOLERATE_GPU = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
PREFILL = {"nodeSelector": {PRODUCT: "NVIDIA-H800"}, "tolerations": TOLERATE_GPU}
DECODE = {"nodeSelector": {PRODUCT: "NVIDIA-H20"}, "tolerations": TOLERATE_GPU}


@pytest.fixture(scope="module")
def mixed_fleet(cluster, api_client):
    """The GPU pools of mixed.yaml added to the test cluster (tainted: no other test's pods land there),
    removed afterwards. Addresses start past the default pools' own."""
    core = client.CoreV1Api(api_client)
    names = nodepools.add_gpu_pools(core, MIXED, first_address=4096, timeout=60)
    yield names
    for name in names:
        core.delete_node(name)


def gang_message(dd: DD, reason: str) -> str:
    """The GangScheduled message once the capacity explanation is in it (it starts "gang needs")."""
    def check():
        c = dd.condition("GangScheduled")
        return c and c["status"] == "False" and c["reason"] == reason and c["message"].startswith("gang needs") \
            and c["message"]
    return wait_for(check, 90, f"GangScheduled False {reason} with the capacity explanation ({dd.status()})")


def test_roles_on_different_gpu_products_fit(api_client, namespace, operator, mixed_fleet, other_gang_crds):
    """Each product has room for its role. A gang whose scheduler is not running (coscheduling: not
    installed here) waits, and the condition says it fits: reason Pending, not InsufficientCapacity
    (one selector joined from both roles would admit no node and claim 0 free GPUs)."""
    dd = DD(api_client, namespace, dd_manifest("mixed-wait", prefill=PREFILL, decode=DECODE,
                                               scheduling={"gang": {"backend": "coscheduling"}}))
    assert gang_message(dd, "Pending") == (
        "gang needs 2 nvidia.com/gpu: prefill fits (needs 1, 2 nodes admit it), decode fits (needs 1, 2 nodes "
        "admit it); waiting for the scheduler (nvidia.com/gpu fits)")
    # with the cluster's own scheduler the same layout is placed, each role on its product
    placed = DD(api_client, namespace, dd_manifest("mixed", prefill=PREFILL, decode=DECODE))
    placed.wait_condition("GangScheduled", "True", "GangPlaced")
    core = client.CoreV1Api(api_client)
    for role, product in (("prefill", "NVIDIA-H800"), ("decode", "NVIDIA-H20")):
        nodes = {core.read_node(p.spec.node_name).metadata.labels[PRODUCT] for p in placed.pods(role)}
        assert nodes == {product}, (role, nodes)


def test_decode_that_does_not_fit_is_named_with_numbers(api_client, namespace, operator, mixed_fleet):
    """Three 8-GPU decode replicas on two 8-GPU H20 nodes: decode cannot be placed, prefill could."""
    dd = DD(api_client, namespace, dd_manifest(
        "mixed-short", prefill=PREFILL, decode={**DECODE, "replicas": 3, "tensorParallelSize": 8},
        scheduling={"gang": {"minPrefill": 1, "minDecode": 3}}))
    assert gang_message(dd, "InsufficientCapacity") == (
        "gang needs 25 nvidia.com/gpu: decode cannot be placed (needs 24 = 3 x 8, 16 free on 2 nodes its "
        "nodeSelector and tolerations admit); prefill fits (needs 1, 16 free on 2 nodes)")
    # and the gang holds: the scheduler refused every worker, none is bound
    for role, count in (("prefill", 1), ("decode", 3)):
        assert all(p.spec.node_name is None for p in dd.wait_refused_by_scheduler(role, count)), role


def test_fleet_view_in_pages_is_the_whole_fleet(api_client, mixed_fleet):
    """The capacity view lists nodes and bound pods a page at a time: three items a page counts the same
    free GPUs as one page for everything."""
    from disagg.operator.children import Clients
    from disagg.operator.fleet import Fleet

    clients = Clients(api=api_client, core=client.CoreV1Api(api_client), custom=client.CustomObjectsApi(api_client))

    def same():
        small, whole = (sorted(Fleet(clients, page=n).free_gpus(), key=lambda f: f.name) for n in (3, 100_000))
        return small == whole and whole
    whole = wait_for(same, 30, "the paged and the unpaged view to agree")
    mine = {f.name: f for f in whole if f.name in mixed_fleet}
    assert set(mine) == set(mixed_fleet) and all(f.free_gpus == 8 and f.taints for f in mine.values())
    assert len(whole) > 3


def test_an_operator_serving_some_namespaces_counts_their_pods_only(api_client, namespace, mixed_fleet):
    """With watchNamespaces the fleet view lists bound pods in the served namespaces only (no other tenant's
    pod specs are read, operator/fleet.py), and a message that a gang does not fit says what it did not count."""
    from disagg.operator import capacity
    from disagg.operator.children import Clients
    from disagg.operator.fleet import Fleet

    core = client.CoreV1Api(api_client)
    clients = Clients(api=api_client, core=core, custom=client.CustomObjectsApi(api_client))
    node = mixed_fleet[0]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "holder"},
           "spec": {"nodeName": node, "tolerations": TOLERATE_GPU, "containers": [
               {"name": "c", "image": "registry.k8s.io/pause:3.10",
                "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}
    core.create_namespaced_pod(namespace, pod)

    def free(fleet: Fleet) -> int:
        return next(f.free_gpus for f in fleet.free_gpus() if f.name == node)
    wait_for(lambda: free(Fleet(clients)) == 0, 60, "the whole-cluster view to count the holder's GPUs")
    elsewhere = Fleet(clients, namespaces=("default",))
    assert free(elsewhere) == 8, "the pod of a namespace it does not serve is not read"
    assert free(Fleet(clients, namespaces=("default", namespace))) == 0
    fits, message = elsewhere.explain([capacity.RoleNeed("decode", 1, 64, {}, ())], None)
    assert not fits and "pods outside default are not counted" in message, message
