"""Replicas larger than one pod on the local control plane (real API server and scheduler, kwok GPU nodes
of 8 GPUs in NVLink domains of 4 nodes, e2e/clusters/default.yaml): the operator runs each multi-pod
replica as a group of pods (operator/groups.py), gang-scheduled per replica by the workload API's nested
groups (operator/gang.py).

* a replica that no domain can hold is not placed at all (no pod of it bound), and status says why, with
  the numbers;
* with room, every pod of a replica lands in one domain; deleting one pod of a replica recreates the
  whole replica, counted and evented;
* a rollout (a new KV revision) never leaves the role without a whole ready replica.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml
from kubernetes import client, watch

from disagg.api import contract
from disagg.api.names import LABEL_GROUP, LABEL_GROUP_POD, LABEL_HEADLESS
from disagg.e2e.localcluster import nodepools
from disagg.e2e.testing import DD, dd_manifest, wait_for
from disagg.operator import metrics as operator_metrics

GPUS_PER_NODE = 8
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _wide(name: str, pods: int, replicas: int = 1) -> dict:
    """Prefill replicas of `pods` pods of a whole node each (tensor parallel across them), one decode pod,
    each replica inside one NVLink domain."""
    return dd_manifest(name, prefill={"replicas": replicas, "podsPerReplica": pods,
                                      "parallelism": {"tensor": pods * GPUS_PER_NODE}},
                       scheduling={"gang": {"minPrefill": 1, "minDecode": 1},
                                   "topology": {"key": nodepools.CLIQUE_LABEL, "mode": "required"}})


def _group_pods(dd: DD) -> dict[str, list[client.V1Pod]]:
    out: dict[str, list] = {}
    for p in dd.pods("prefill"):
        out.setdefault(p.metadata.labels[LABEL_GROUP], []).append(p)
    return out


def _events(core, namespace: str, name: str, reason: str) -> list:
    return [e for e in core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
            if e.reason == reason]


def test_a_replica_no_domain_can_hold_is_not_placed_at_all(api_client, namespace, operator):
    """5 pods of 8 GPUs; every NVLink domain has 4 nodes of 8."""
    dd = DD(api_client, namespace, _wide("nofit", pods=5))
    refused = dd.wait_refused_by_scheduler("prefill", 5, timeout=120)
    assert {p.metadata.labels[LABEL_GROUP] for p in refused} == {"nofit-prefill-0"}
    assert not any(p.spec.node_name for p in dd.pods("prefill")), "no pod of the replica is bound"
    gang = dd.wait_condition("GangScheduled", "False", "InsufficientCapacity", timeout=120)
    assert "5 pods" in gang["message"] and "40 = 5 x 8" in gang["message"], gang["message"]
    assert "nvidia.com/gpu.clique" in gang["message"], gang["message"]


def test_a_replica_lands_in_one_domain_and_a_lost_pod_restarts_it_whole(api_client, namespace, operator):
    core = client.CoreV1Api(api_client)
    dd = DD(api_client, namespace, _wide("grp", pods=4, replicas=2))
    wait_for(lambda: (dd.status().get("prefill") or {}).get("ready") == 2 and dd.status().get("phase") == "Ready",
             180, f"both prefill replicas ready (status: {dd.status()})")
    groups = _group_pods(dd)
    assert sorted(groups) == ["grp-prefill-0", "grp-prefill-1"]
    nodes = {n.metadata.name: n.metadata.labels for n in core.list_node().items}
    for group, pods in groups.items():
        assert sorted(int(p.metadata.labels[LABEL_GROUP_POD]) for p in pods) == [0, 1, 2, 3]
        assert len({nodes[p.spec.node_name][nodepools.CLIQUE_LABEL] for p in pods}) == 1, f"{group} in one domain"
        assert [p.metadata.labels.get(LABEL_HEADLESS) for p in sorted(
            pods, key=lambda p: p.metadata.labels[LABEL_GROUP_POD])] == [None, "true", "true", "true"]
    prefill = dd.status()["prefill"]
    assert (prefill["desired"], prefill["podsPerReplica"], prefill["podsScheduled"]) == (2, 4, 8), prefill
    assert prefill.get("groupRestarts") == 0

    restarts = operator_metrics.group_restarts.labels(namespace, "grp", "prefill")
    before = restarts._value.get()
    lost = next(p for p in groups["grp-prefill-1"] if p.metadata.labels[LABEL_GROUP_POD] == "2")
    core.delete_namespaced_pod(lost.metadata.name, namespace, grace_period_seconds=0)
    event = wait_for(lambda: _events(core, namespace, "grp", "GroupRestarted"), 60, "a GroupRestarted event")[0]
    assert "grp-prefill-1" in event.message and lost.metadata.name in event.message, event.message
    assert restarts._value.get() == before + 1
    # the whole replica replaced (a new group: its old names are busy until its old pods are gone)
    def whole_again():
        gs = _group_pods(dd)
        ready = [g for g, pods in gs.items() if len(pods) == 4 and all(p.spec.node_name for p in pods)]
        return len(gs) == 2 and len(ready) == 2 and "grp-prefill-1" not in gs and gs
    wait_for(whole_again, 120, "two whole replicas again")
    dd.wait_phase("Ready", timeout=120)
    wait_for(lambda: dd.status()["prefill"].get("groupRestarts") == 1, 30, "the restart counted in status")


def test_a_rollout_keeps_a_whole_ready_replica(api_client, namespace, operator):
    core = client.CoreV1Api(api_client)
    dd = DD(api_client, namespace, _wide("roll", pods=2, replicas=1))
    dd.wait_phase("Ready", timeout=180)
    (old,) = _group_pods(dd)
    old_revision = dd.pods("prefill")[0].metadata.labels[contract.KV_REVISION_LABEL]
    # every ready leader seen, in order, from a watch that starts before the rollout
    seen: list[tuple[str, str, bool]] = []
    lows: list[str] = []
    stop = threading.Event()
    w = watch.Watch()

    def follow():
        try:
            watch_leaders()
        except Exception as e:   # the stream cut by w.stop() at the end is expected; anything before is not
            if not stop.is_set():
                lows.append(f"the watch failed: {e!r}")

    def watch_leaders():
        ready: dict[str, bool] = {}
        for ev in w.stream(core.list_namespaced_pod, namespace,
                           label_selector=f"serving.disagg.dev/deployment=roll,{LABEL_GROUP_POD}=0",
                           timeout_seconds=300):
            p = ev["object"]
            ok = ev["type"] != "DELETED" and not p.metadata.deletion_timestamp and any(
                c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            ready[p.metadata.name] = ok
            seen.append((p.metadata.name, p.metadata.labels[contract.KV_REVISION_LABEL], ok))
            if started.is_set() and not any(ready.values()):
                lows.append(f"no ready prefill leader after {ev['type']} {p.metadata.name}")
            if stop.is_set():
                return
    started = threading.Event()
    t = threading.Thread(target=follow, daemon=True)
    t.start()
    wait_for(lambda: any(ok for _, _, ok in seen), 30, "the watch to see the ready leader")
    started.set()
    dd.patch_spec({"engine": {"args": ["--kv-cache-dtype", "auto"]}})   # a new KV revision

    def rolled():
        gs = _group_pods(dd)
        pods = [p for ps in gs.values() for p in ps]
        return (old not in gs and pods and all(p.metadata.labels[contract.KV_REVISION_LABEL] != old_revision
                                                for p in pods) and dd.status().get("phase") == "Ready" and gs)
    try:
        new = wait_for(rolled, 180, "the rollout to a new replica")
    except AssertionError as e:
        pods = [(p.metadata.name, p.metadata.labels.get(contract.KV_REVISION_LABEL), p.spec.node_name,
                 p.status.phase) for p in dd.pods()]
        events = [(e.reason, e.message) for e in core.list_namespaced_event(namespace).items
                  if e.involved_object.name == "roll"]
        raise AssertionError(f"{e}\npods: {pods}\nevents: {events}\nstatus: {dd.status()}") from e
    stop.set()
    w.stop()
    assert not lows, lows
    assert any(rev != old_revision and ok for _, rev, ok in seen), "the new leader was seen ready"
    assert len(new) == 1 and len(next(iter(new.values()))) == 2
    # kopf posts events from its own queue: the event may land a moment after the rollout is seen done
    wait_for(lambda: _events(core, namespace, "roll", "GroupDeleted"), 30, "the old replica's removal evented")


@pytest.fixture(scope="module")
def nvl72_fleet(cluster, api_client):
    """The GPU racks of e2e/clusters/nvl72.yaml (18 nodes x 4 GPUs per NVLink domain, tainted: no other
    test's pods land there) added to the test cluster, removed afterwards."""
    core = client.CoreV1Api(api_client)
    names = nodepools.add_gpu_pools(core, nodepools.CLUSTERS / "nvl72.yaml", first_address=8192)
    yield names
    for name in names:
        core.delete_node(name)


@pytest.mark.parametrize("example", ["deepseek-wide-ep.yaml", "llama-405b-tp16.yaml"])
def test_the_multi_node_examples_place_every_replica_inside_one_domain(example, api_client, namespace, operator,
                                                                       nvl72_fleet):
    """The wide expert-parallel MoE example on the NVL72 racks, the dense tensor-parallel-across-pods one on the default
    H100 pool: every replica of every role bound, each inside one NVLink domain, with its GPUs."""
    core = client.CoreV1Api(api_client)
    manifest = yaml.safe_load((EXAMPLES / example).read_text())
    dd = DD(api_client, namespace, manifest)
    spec = manifest["spec"]

    def placed():
        s = dd.status()
        return all((s.get(r) or {}).get("ready") == spec[r]["replicas"] for r in ("prefill", "decode")) and s
    wait_for(placed, 180, f"every replica of {dd.name} placed and ready (status: {dd.status()})")
    nodes = {n.metadata.name: n for n in core.list_node().items}
    for role in ("prefill", "decode"):
        groups: dict[str, list] = {}
        for p in dd.pods(role):
            groups.setdefault(p.metadata.labels[LABEL_GROUP], []).append(p)
        assert len(groups) == spec[role]["replicas"]
        for group, pods in groups.items():
            assert len(pods) == spec[role]["podsPerReplica"], group
            domains = {nodes[p.spec.node_name].metadata.labels[nodepools.CLIQUE_LABEL] for p in pods}
            assert len(domains) == 1, f"{group} spans {domains}"
            gpus = {p.spec.containers[0].resources.limits["nvidia.com/gpu"] for p in pods}
            assert gpus == {str(spec[role]["resources"]["limits"]["nvidia.com/gpu"])}
