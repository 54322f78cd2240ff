"""What the operator renders for replicas larger than one pod, and what its group controller decides
(operator/groups.py's plan: pods in, actions out), without a cluster."""

from __future__ import annotations

from disagg.api import contract, parallelism
from disagg.api.names import LABEL_GROUP, LABEL_GROUP_POD, LABEL_HEADLESS
from disagg.api.v1alpha1 import GPU_RESOURCE, DisaggDeployment
from disagg.e2e.testing import dd_manifest
from disagg.operator import gang as gangs
from disagg.operator import groups, render
from disagg.operator.status import PodView

REV = "rev1"


def _dd(prefill: dict, topology: str | None = "required", backend: str = "workload-api") -> DisaggDeployment:
    scheduling: dict = {"gang": {"minPrefill": 1, "minDecode": 1, "backend": backend}}
    if topology:
        scheduling["topology"] = {"key": "nvidia.com/gpu.clique", "mode": topology}
    m = dd_manifest("big", prefill=prefill, scheduling=scheduling)
    m["metadata"] |= {"namespace": "ns", "generation": 3}
    return DisaggDeployment.model_validate(m)


TP4_OVER_2 = {"replicas": 2, "podsPerReplica": 2, "parallelism": {"tensor": 4}}


def test_a_group_is_a_leader_and_headless_ranks_with_its_gpus_flags_and_names():
    dd = _dd(TP4_OVER_2)
    gang = gangs.render("big", dd.spec)
    pg, leader, rank = groups.manifests(dd, "uid", "prefill", 1, gang, 3)
    assert pg["kind"] == "PodGroup" and pg["spec"]["schedulingPolicy"] == {"gang": {"minCount": 2}}
    assert pg["spec"]["schedulingConstraints"] == {"topology": [{"key": "nvidia.com/gpu.clique"}]}
    assert [leader["metadata"]["name"], rank["metadata"]["name"]] == ["big-prefill-1-0", "big-prefill-1-1"]
    for pod, index in ((leader, 0), (rank, 1)):
        spec, c = pod["spec"], pod["spec"]["containers"][0]
        assert spec["schedulingGroup"] == {"podGroupName": pg["metadata"]["name"]}
        assert spec["hostname"] == pod["metadata"]["name"] and spec["subdomain"] == "big-prefill-ranks"
        assert spec["restartPolicy"] == "Never"
        assert c["resources"]["limits"][GPU_RESOURCE] == "2", "tensor 4 over 2 pods"
        assert pod["metadata"]["labels"][LABEL_GROUP] == "big-prefill-1"
        assert pod["metadata"]["labels"][LABEL_GROUP_POD] == str(index)
        # what the plan reads to tell a current group from an old one
        assert pod["metadata"]["labels"][contract.KV_REVISION_LABEL] == render.kv_revision(dd)
        assert pod["metadata"]["labels"][contract.KV_REVISION_GENERATION_LABEL] == "3"
        engine = c["args"][c["args"].index("--") + 1:]
        assert engine[:8] == ["--distributed-executor-backend", "mp", "--nnodes", "2", "--node-rank", str(index),
                              "--master-addr", "big-prefill-1-0.big-prefill-ranks"]
        assert {"name": "DISAGG_GROUP_SIZE", "value": "2"} in c["env"]
    assert "--headless" not in leader["spec"]["containers"][0]["args"]
    assert "--headless" in rank["spec"]["containers"][0]["args"]
    assert "readinessProbe" in leader["spec"]["containers"][0] and "readinessProbe" not in rank["spec"]["containers"][0]
    assert LABEL_HEADLESS not in leader["metadata"]["labels"] and rank["metadata"]["labels"][LABEL_HEADLESS] == "true"
    assert "--metrics-port" in leader["spec"]["containers"][0]["args"]
    assert "--metrics-port" not in rank["spec"]["containers"][0]["args"], "the leader serves the metrics"
    assert rank["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-3:] == [
        "wait-gone", "big-prefill-1-0.big-prefill-ranks", "8000"], "the leader drains first"


def test_the_children_have_no_prefill_deployment_a_ranks_service_and_a_nested_gang():
    dd = _dd(TP4_OVER_2)
    out, gang = render.children(dd, "uid")
    kinds = {(m["kind"], m["metadata"]["name"]) for m in out}
    assert ("Deployment", "big-prefill") not in kinds and ("Deployment", "big-decode") in kinds
    ranks = next(m for m in out if m["metadata"]["name"] == "big-prefill-ranks")
    assert ranks["spec"]["clusterIP"] == "None" and ranks["spec"]["publishNotReadyAddresses"] is True
    composites = {m["metadata"]["name"]: m["spec"] for m in out if m["kind"] == "CompositePodGroup"}
    role = composites[gang.group_names["prefill"]]
    assert role["parentCompositePodGroupName"] == gang.name
    assert role["schedulingPolicy"] == {"gang": {"minGroupCount": 1}}, "the minimum counts whole replicas"
    assert "schedulingConstraints" not in composites[gang.name], "the topology binds each replica"


def test_backends_without_a_replica_level_are_refused_and_other_topologies_use_affinity():
    assert "workload-api" in render.unrendered_layout(_dd(TP4_OVER_2, backend="volcano"))
    assert render.unrendered_layout(_dd(TP4_OVER_2, backend="none")) is None
    dd = _dd(TP4_OVER_2, topology="preferred")
    _, leader, _ = groups.manifests(dd, "uid", "prefill", 0, gangs.render("big", dd.spec), 3)
    term = leader["spec"]["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == {LABEL_GROUP: "big-prefill-0"}


def test_the_gpus_and_rank_flags_of_each_layout():
    cases = [(parallelism.Layout(tensor=8, pods=2), 4, [["--node-rank", "0"], ["--node-rank", "1", "--headless"]]),
             (parallelism.Layout(tensor=2, pipeline=2, pods=2), 2, [["--node-rank", "0"], ["--node-rank", "1"]]),
             (parallelism.Layout(data=16, expert=True, pods=4), 4,
              [["--data-parallel-size-local", "4"], ["--data-parallel-start-rank", "4", "--headless"]])]
    for lay, gpus, wanted in cases:
        assert lay.gpus_per_pod == gpus
        ranks = parallelism.group(lay, "leader")
        for rank, want in zip(ranks, wanted, strict=False):
            flags = list(rank.flags)
            assert all(f in flags for f in want), (lay, flags)
        assert not any("--headless" in r.flags for r in ranks[:1]) and all("--headless" in r.flags for r in ranks[1:])


def _pod(group: str, index: int, *, ready: bool = True, revision: str = REV, generation: int = 3,
         phase: str = "Running", terminating: bool = False, gang: str | None = "g") -> PodView:
    return PodView(name=f"{group}-{index}", role="prefill", node="n", ready=ready and index == 0, phase=phase,
                   terminating=terminating, revision=revision, generation=str(generation), gang=gang,
                   group=group, group_pod=index, headless=index > 0)


def _group(slot: int, size: int = 2, **kw) -> list[PodView]:
    return [_pod(f"big-prefill-{slot}", i, **kw) for i in range(size)]


def _plan(pods, replicas=2, hold=False):
    return groups.plan(pods, "prefill", 2, replicas, REV, 3, "g", hold)


def test_plan_creates_missing_replicas_in_free_slots():
    assert _plan([]).create == [0, 1]
    assert _plan(_group(0)).create == [1]
    assert _plan(_group(0) + _group(1)).create == []


def test_plan_restarts_a_group_that_lost_or_failed_a_pod_and_replaces_it_elsewhere():
    lost = _group(0)[:1] + _group(1)
    p = _plan(lost)
    assert [(g.name, why) for g, why in p.restart] == [("big-prefill-0", "pod big-prefill-0-1 is missing")]
    assert p.create == [2], "its slot is busy until its pods are gone"
    failed = _group(0) + [_pod("big-prefill-1", 0), _pod("big-prefill-1", 1, phase="Failed")]
    assert "big-prefill-1-1 failed" in _plan(failed).restart[0][1]
    deleted = _group(0) + [_pod("big-prefill-1", 0), _pod("big-prefill-1", 1, terminating=True)]
    assert "was deleted" in _plan(deleted).restart[0][1]
    going = _group(0) + _group(1, terminating=True)
    p = _plan(going)
    assert not p.restart and p.create == [2], "a group being removed is not broken"


def test_plan_scales_down_not_ready_and_highest_first():
    pods = _group(0) + _group(1) + _group(2, ready=False)
    assert [g.name for g, _ in _plan(pods, replicas=1).remove] == ["big-prefill-2", "big-prefill-1"]


def test_plan_rolls_out_whole_groups_and_never_below_the_ready_count():
    old = _group(0, revision="rev0") + _group(1, revision="rev0")
    p = _plan(old)
    assert p.create == [2, 3] and not p.remove, "old groups stay until new ones are ready"
    one_new_ready = old + _group(2) + _group(3, ready=False)
    assert [g.name for g, _ in _plan(one_new_ready).remove] == ["big-prefill-1"]
    assert not _plan(one_new_ready, hold=True).remove, "no ready pair in the new revision yet: hold"
    regang = _group(0, gang="old") + _group(1)
    assert _plan(regang).create == [2], "a new gang shape is a new group"


def test_a_non_leader_waits_for_its_leader_to_stop_serving():
    """The preStop of a replica's non-leader pods (workers/leader.py wait-gone): it returns once the leader
    takes no more connections, and gives up at its timeout while the leader still serves."""
    import socket
    import threading

    from disagg.workers.leader import wait_gone

    server = socket.create_server(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    accepting = threading.Event()

    def accept():
        accepting.set()
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()
    threading.Thread(target=accept, daemon=True).start()
    accepting.wait(5)
    assert wait_gone("127.0.0.1", port, timeout=1.5, interval=0.2) is False, "the leader still serves"
    server.close()
    assert wait_gone("127.0.0.1", port, timeout=10, interval=0.2) is True
