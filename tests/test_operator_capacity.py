"""The capacity explanation (pure): each role counted on the nodes its own selector and tolerations admit."""

from __future__ import annotations

from disagg.api.v1alpha1 import Toleration
from disagg.e2e.localcluster import nodepools
from disagg.operator import capacity

PRODUCT = "nvidia.com/gpu.product"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
TOLERATE = (Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),)


def mixed_fleet(used: dict[str, int] | None = None) -> list[capacity.NodeFree]:
    """The GPU nodes of e2e/clusters/mixed.yaml, through the same parser the operator uses."""
    nodes = nodepools.nodes(nodepools.load(nodepools.CLUSTERS / "mixed.yaml"))
    pods = [{"spec": {"nodeName": node, "containers": [{"resources": {"limits": {"nvidia.com/gpu": str(n)}}}]},
             "status": {"phase": "Running"}} for node, n in (used or {}).items()]
    return capacity.free_gpus(nodes, pods)


def role(name: str, replicas: int, gpus: int, product: str | None, tolerations=TOLERATE) -> capacity.RoleNeed:
    return capacity.RoleNeed(name, replicas, gpus, {PRODUCT: product} if product else {}, tolerations)


def test_pool_file_has_two_gpu_products_behind_the_gpu_taint():
    fleet = mixed_fleet()
    assert {n.labels[PRODUCT] for n in fleet} == {"NVIDIA-H800", "NVIDIA-H20"}
    assert all(n.taints == (capacity.Taint(**GPU_TAINT),) and n.free_gpus == 8 for n in fleet)


def test_roles_on_different_products_fit():
    roles = [role("prefill", 1, 1, "NVIDIA-H800"), role("decode", 1, 1, "NVIDIA-H20")]
    fits, msg = capacity.explain(mixed_fleet(), roles, None)
    assert fits, msg
    assert msg == ("gang needs 2 nvidia.com/gpu: prefill fits (needs 1, 2 nodes admit it), "
                   "decode fits (needs 1, 2 nodes admit it)")
    # no free counts where it fits: the words stay as other pods are bound (a waiting gang's status is
    # not rewritten for each)
    assert capacity.explain(mixed_fleet({"h20-a0-0-0": 3}), roles, None) == (True, msg)


def test_the_role_that_does_not_fit_is_named_with_numbers():
    fits, msg = capacity.explain(mixed_fleet({"h20-a0-0-0": 3}), [role("prefill", 1, 1, "NVIDIA-H800"),
                                                                  role("decode", 2, 8, "NVIDIA-H20")], None)
    assert not fits
    assert msg == ("gang needs 17 nvidia.com/gpu: decode cannot be placed (needs 16 = 2 x 8, 13 free on 2 nodes "
                   "its nodeSelector and tolerations admit); prefill fits (needs 1, 16 free on 2 nodes)")


def test_whole_replicas_and_missing_tolerations():
    # 16 free H20 GPUs, but 4 + 4 + 8 cannot hold two 8-GPU replicas
    fits, msg = capacity.explain(mixed_fleet({"h20-a0-0-0": 4, "h20-a0-0-1": 4}) + [
        capacity.NodeFree("h20-extra", {PRODUCT: "NVIDIA-H20"}, 8)], [role("decode", 2, 8, "NVIDIA-H20")], None)
    assert not fits and "needs 16 = 2 x 8, 16 free on 3 nodes" in msg and "split across nodes" in msg, msg
    # a decode that does not tolerate the GPU taint is admitted nowhere in this fleet
    fits, msg = capacity.explain(mixed_fleet(), [role("prefill", 1, 1, "NVIDIA-H800"),
                                                 role("decode", 1, 1, "NVIDIA-H20", tolerations=())], None)
    assert not fits and "decode cannot be placed (needs 1, 0 free on 0 nodes" in msg, msg


def test_tolerations_follow_kubernetes_matching():
    taint = capacity.Taint("nvidia.com/gpu", "present", "NoSchedule")
    node = capacity.NodeFree("n", {}, 8, (taint,))

    def admits(**t) -> bool:
        return capacity.RoleNeed("decode", 1, 1, {}, (Toleration(**t),)).admits(node)
    assert admits(operator="Exists")                                        # empty key + Exists: every taint
    assert admits(key="nvidia.com/gpu", operator="Equal", value="present")  # empty effect: every effect
    assert not admits(key="nvidia.com/gpu", operator="Equal", value="absent")
    assert not admits(key="nvidia.com/gpu", operator="Exists", effect="NoExecute")
    assert not capacity.RoleNeed("decode", 1, 1).admits(node)


def test_shared_nodes_fit_each_role_alone_but_not_both():
    fleet = [capacity.NodeFree("a", {PRODUCT: "X"}, 8)]
    fits, msg = capacity.explain(fleet, [role("prefill", 1, 4, None), role("decode", 1, 8, None)], None)
    assert not fits and "prefill and decode each fit alone but not together" in msg, msg


def test_required_topology_domain_names_the_short_role():
    # two racks: prefill (H800) and decode (H20) only meet in zone-a rack 0
    rack = nodepools.RACK_LABEL

    def node(name, product, rack_name, free):
        return capacity.NodeFree(name, {PRODUCT: product, rack: rack_name}, free)
    fleet = [node("p0", "NVIDIA-H800", "r0", 8), node("d0", "NVIDIA-H20", "r0", 8),
             node("p1", "NVIDIA-H800", "r1", 8)]
    fits, msg = capacity.explain(fleet, [role("prefill", 1, 8, "NVIDIA-H800", ()),
                                         role("decode", 2, 8, "NVIDIA-H20", ())], rack)
    assert not fits
    assert msg.startswith(f"gang needs 24 nvidia.com/gpu in one {rack} domain (3 replicas of 8); "
                          "the largest free domain has 16; in "), msg
    assert f"{rack}=r0: decode cannot be placed (needs 16 = 2 x 8, 8 free on 1 node its" in msg, msg
    fits, msg = capacity.explain(fleet, [role("prefill", 1, 8, "NVIDIA-H800", ()),
                                         role("decode", 1, 8, "NVIDIA-H20", ())], rack)
    assert fits and f"{rack}=r0: prefill fits" in msg, msg


def test_the_operator_watches_only_its_children_server_side():
    import kopf
    from kopf._cogs.structs.references import Resource   # kopf exports no public name for it

    from disagg.operator import handlers

    settings = kopf.OperatorSettings()
    handlers.watch_only_owned(settings)
    pods, deployments = Resource("", "v1", "pods"), Resource("apps", "v1", "deployments")
    dds = Resource("serving.disagg.dev", "v1alpha1", "disaggdeployments")
    for resource in (pods, deployments):
        assert settings.watching.label_selectors.collect(resource) == [
            "serving.disagg.dev/deployment,app.kubernetes.io/managed-by=disagg-operator"], resource
    assert settings.watching.label_selectors.collect(dds) == []
    assert settings.watching.chunk_size == 500
