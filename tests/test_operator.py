"""The operator against the local control plane, running under its least-privilege role.
Nothing about Kubernetes is mocked: the real scheduler places (or refuses) the gang."""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from disagg.api import metrics as m
from disagg.api.names import LABEL_ROLE
from disagg.operator import metrics as operator_metrics
from disagg.workers.local import metric_sum, scrape
from disagg.e2e.localcluster import nodepools
from disagg.e2e.testing import DD, GROUP, PLURAL, VERSION, dd_manifest, wait_for
from disagg.e2e.testing import pod as pod_manifest
from disagg.operator import gang as gangs

def _empty_clique(api_client):
    """An NVLink domain of the default pool with no pod on it."""
    core = client.CoreV1Api(api_client)
    nodes = [n for n in core.list_node(label_selector=nodepools.CLIQUE_LABEL).items
             if n.metadata.name.startswith("h100-")]
    busy = {p.spec.node_name for p in core.list_pod_for_all_namespaces(field_selector="spec.nodeName!=").items}
    cliques = sorted({n.metadata.labels[nodepools.CLIQUE_LABEL] for n in nodes})
    return next(c for c in cliques if not any(n.metadata.name in busy for n in nodes
                                              if n.metadata.labels[nodepools.CLIQUE_LABEL] == c))


def test_creates_children_reaches_ready_and_deletes_cascade(api_client, namespace, operator):
    dd = DD(api_client, namespace, dd_manifest("small", decode={"replicas": 2}))
    dd.wait_phase("Ready")
    dd.wait_condition("Progressing", "False", "Complete")
    status = dd.status()
    assert status["prefill"] == {"desired": 1, "scheduled": 1, "ready": 1, "updated": 1, "summary": "1/1"}
    assert status["decode"]["summary"] == "2/2" and status["router"]["summary"] == "1/1"
    assert status["endpoint"] == f"http://small.{namespace}.svc:80/v1"
    assert status["observedGeneration"] == dd.get()["metadata"]["generation"]
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Ready"]["status"] == "True" and conds["GangScheduled"]["status"] == "True"
    assert conds["Progressing"]["status"] == "False" and conds["Degraded"]["status"] == "False", conds

    uid = dd.get()["metadata"]["uid"]
    deployments = dd.apps.list_namespaced_deployment(namespace).items
    assert sorted(d.metadata.name for d in deployments) == ["small-decode", "small-prefill", "small-router"]
    services = {s.metadata.name: s for s in dd.core.list_namespaced_service(namespace).items}
    assert set(services) == {"small", "small-prefill", "small-decode"}
    assert services["small-prefill"].spec.cluster_ip == "None"
    objects = client.CustomObjectsApi(api_client)
    groups = objects.list_namespaced_custom_object("scheduling.k8s.io", "v1beta1", namespace, "podgroups")["items"]
    assert sorted(g["spec"]["workloadRef"]["templateName"] for g in groups) == ["decode", "prefill"]
    composite = objects.list_namespaced_custom_object("scheduling.k8s.io", "v1alpha3", namespace,
                                                      "compositepodgroups")["items"]
    assert [c["spec"]["schedulingPolicy"]["gang"]["minGroupCount"] for c in composite] == [2]
    for obj in [*deployments, *services.values()]:
        assert obj.metadata.owner_references[0].uid == uid
    for pod in dd.pods("prefill") + dd.pods("decode"):
        assert pod.spec.scheduling_group.pod_group_name in {g["metadata"]["name"] for g in groups}

    dd.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "small")
    wait_for(lambda: not dd.apps.list_namespaced_deployment(namespace).items
             and not dd.core.list_namespaced_service(namespace).items, 90, "children garbage-collected")


def test_deleted_and_created_again_under_the_same_name(api_client, namespace, operator):
    """The old children are garbage until the collector removes them: the new deployment waits for
    that (no ChildConflict, which means someone else's object) and ends up owning fresh children."""
    dd = DD(api_client, namespace, dd_manifest("again"))
    dd.wait_phase("Ready")
    old_uid = dd.get()["metadata"]["uid"]
    dd.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "again")

    def created() -> bool:
        try:
            dd.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, dd_manifest("again"))
            return True
        except client.exceptions.ApiException as e:
            if e.status != 409:   # the old one still finalizing
                raise
            return False
    wait_for(created, 60, "the DisaggDeployment created again")
    uid = dd.get()["metadata"]["uid"]
    assert uid != old_uid
    dd.wait_phase("Ready")
    wait_for(lambda: {d.metadata.owner_references[0].uid for d in dd.apps.list_namespaced_deployment(namespace).items}
             == {uid}, 60, "every child Deployment owned by the new DisaggDeployment")
    events = dd.core.list_namespaced_event(namespace, field_selector=f"involvedObject.uid={uid}").items
    assert not [e.message for e in events if e.reason == "ChildConflict"]


def test_a_child_name_someone_else_controls_is_a_conflict_and_left_alone(api_client, namespace, operator):
    """A name a child needs, held by an object another controller owns: ChildConflict, named in a
    Warning event, and that object untouched."""
    core = client.CoreV1Api(api_client)
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "someone-else"}})
    core.create_namespaced_service(namespace, {
        "metadata": {"name": "taken", "labels": {"app": "theirs"},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "someone-else",
                                          "uid": owner.metadata.uid, "controller": True}]},
        "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 8000}]}})
    dd = DD(api_client, namespace, dd_manifest("taken"))
    wait_for(lambda: any(e.reason == "ChildConflict" and e.type == "Warning" and "ConfigMap someone-else" in e.message
                         for e in core.list_namespaced_event(namespace, field_selector="involvedObject.name=taken"
                                                             ).items
                         if e.involved_object.kind == dd.get()["kind"]), 60, "a ChildConflict event")
    svc = core.read_namespaced_service("taken", namespace)
    assert [(o.kind, o.name, o.controller) for o in svc.metadata.owner_references] == [
        ("ConfigMap", "someone-else", True)]
    assert svc.metadata.labels == {"app": "theirs"} and svc.spec.ports[0].port == 8000


def test_printer_columns_show_live_values(cluster, api_client, namespace, operator):
    dd = DD(api_client, namespace, dd_manifest("cols", decode={"replicas": 2}))
    dd.wait_phase("Ready")
    row = cluster.kubectl("get", "dd", "cols", "-n", namespace, "--no-headers").stdout.split()
    assert row[:4] == ["cols", "1/1", "2/2", "Ready"]


def test_gang_one_gpu_short_binds_nothing_then_binds_all_when_capacity_arrives(api_client, namespace, operator):
    """Pinned to one NVLink domain of 4 x 8 GPUs: 4 decode replicas of 8 GPUs plus one
    1-GPU prefill need 33. Nothing binds, the status says why in numbers; a node added
    to that domain lets the whole gang bind without touching the deployment."""
    clique = _empty_clique(api_client)
    pin = {"nodeSelector": {nodepools.CLIQUE_LABEL: clique}}
    dd = DD(api_client, namespace, dd_manifest(
        "gang", prefill={"replicas": 1, **pin},
        decode={"replicas": 4, "tensorParallelSize": 8, **pin},
        scheduling={"gang": {"minPrefill": 1, "minDecode": 4},
                    "topology": {"key": nodepools.CLIQUE_LABEL, "mode": "required"}}))
    cond = dd.wait_condition("GangScheduled", "False", "InsufficientCapacity")
    assert "gang needs 33 nvidia.com/gpu in one nvidia.com/gpu.clique domain" in cond["message"]
    assert "the largest free domain has 32" in cond["message"]
    events = dd.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name=gang").items
    assert any(e.reason == "InsufficientCapacity" and e.type == "Warning" for e in events)
    workers = dd.wait_refused_by_scheduler("prefill", 1) + dd.wait_refused_by_scheduler("decode", 4)
    assert all(p.spec.node_name is None for p in workers), "no pod of a partial gang binds"
    assert dd.status()["phase"] == "Pending"

    extra = nodepools.nodes(nodepools.PoolFile.model_validate(
        {"pools": [{"name": "extra", "gpus": 8, "gpuProduct": "NVIDIA-H100-80GB-HBM3"}]}))[0]
    extra["metadata"]["name"] = f"extra-{namespace[-6:]}"
    extra["metadata"]["labels"] |= {nodepools.CLIQUE_LABEL: clique, "kubernetes.io/hostname": extra["metadata"]["name"]}
    dd.core.create_node(extra)
    try:
        dd.wait_condition("GangScheduled", "True", timeout=120)
        pods = dd.pods("prefill") + dd.pods("decode")
        assert len(pods) == 5 and all(p.spec.node_name for p in pods)
        dd.wait_phase("Ready")
    finally:
        # pods first: a pod on a deleted node lingers until the pod garbage collector runs
        dd.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gang")
        wait_for(lambda: not dd.pods("decode"), 90, "gang pods deleted")
        dd.core.delete_node(extra["metadata"]["name"])


def test_gang_minimum_holds_per_role(api_client, namespace, operator):
    """Two prefill replicas with GPUs to spare, one decode replica with none, a minimum of one per role.
    A single PodGroup with minCount = minPrefill + minDecode = 2 (the design gang.py rejects) is met by the
    two prefill pods alone and binds them, shown below with plain pods; the per-role minimum binds neither."""
    dd = DD(api_client, namespace, dd_manifest(
        "perrole", prefill={"replicas": 2},
        decode={"replicas": 1, "nodeSelector": {"nvidia.com/gpu.product": "no-such-gpu"}}))
    cond = dd.wait_condition("GangScheduled", "False", "InsufficientCapacity")
    assert cond["message"].startswith("gang needs 2 nvidia.com/gpu: decode cannot be placed (needs 1, 0 free on "
                                      "0 nodes"), cond
    dd.wait_refused_by_scheduler("prefill", 2)
    assert all(p.spec.node_name is None for p in dd.pods("prefill")), "prefill bound without its decode"
    assert dd.condition("Ready")["status"] == "False"

    # the rejected design on the same layout: one PodGroup over all three pods, minCount 2
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    group, version = gangs.WORKLOAD_API.split("/")
    custom.create_namespaced_custom_object(group, version, namespace, "workloads", {
        "apiVersion": gangs.WORKLOAD_API, "kind": "Workload", "metadata": {"name": "single"},
        "spec": {"podGroupTemplates": [{"name": "all", "schedulingPolicy": {"gang": {"minCount": 2}}}]}})
    custom.create_namespaced_custom_object(group, version, namespace, "podgroups", {
        "apiVersion": gangs.WORKLOAD_API, "kind": "PodGroup", "metadata": {"name": "single"},
        "spec": {"workloadRef": {"workloadName": "single", "templateName": "all"},
                 "schedulingPolicy": {"gang": {"minCount": 2}}}})
    for i in range(2):
        core.create_namespaced_pod(namespace, pod_manifest(f"single-prefill-{i}", gpus=1, pod_group="single"))
    core.create_namespaced_pod(namespace, pod_manifest("single-decode", gpus=1, pod_group="single",
                                                       node_selector={"nvidia.com/gpu.product": "no-such-gpu"}))
    wait_for(lambda: all(core.read_namespaced_pod(f"single-prefill-{i}", namespace).spec.node_name
                         for i in range(2)), 60, "a single PodGroup binding the prefill pods without a decode")


def test_a_gang_waiting_past_its_timeout_says_so(api_client, namespace, operator):
    dd = DD(api_client, namespace, dd_manifest(
        "late", decode={"replicas": 1, "nodeSelector": {"nvidia.com/gpu.product": "no-such-gpu"}},
        scheduling={"gang": {"minPrefill": 1, "minDecode": 1, "timeoutSeconds": 8}}))
    cond = dd.wait_condition("GangScheduled", "False", "GangTimeout", timeout=120)
    assert "not placed after" in cond["message"] and "(timeout 8s)" in cond["message"]
    assert "gang needs 2 nvidia.com/gpu" in cond["message"], cond
    # kopf posts events from its own queue, after the status write the condition came with: wait for it
    wait_for(lambda: any(e.reason == "GangTimeout" and e.type == "Warning" for e in dd.core.list_namespaced_event(
        namespace, field_selector="involvedObject.name=late").items), 60, "the GangTimeout Warning event")
    # the same decision as a metric
    key = (f'{m.OPERATOR_CONDITION}{{deployment="late",namespace="{namespace}",reason="GangTimeout",'
           f'type="GangScheduled"}}')
    wait_for(lambda: scrape(f"http://127.0.0.1:{operator_metrics.port()}").get(key) == 0.0, 30,
             f"{key} = 0 on the operator's /metrics")


def test_hand_edits_of_children_are_reverted(api_client, namespace, operator):
    """The DisaggDeployment is the source of truth: a `kubectl edit` or `kubectl scale` of a child
    Deployment is undone at once (not at the next spec change), with an event and a metric."""
    dd = DD(api_client, namespace, dd_manifest("drift"))
    dd.wait_phase("Ready")
    apps, name = dd.apps, "drift-decode"
    container = apps.read_namespaced_deployment(name, namespace).spec.template.spec.containers[0]
    before = metric_sum(scrape(f"http://127.0.0.1:{operator_metrics.port()}"), m.OPERATOR_DRIFT_REVERTS)
    apps.patch_namespaced_deployment(name, namespace, {"spec": {"template": {"spec": {"containers": [
        {"name": container.name, "args": ["--edited-by-hand"]}]}}}}, field_manager="kubectl-edit")
    wait_for(lambda: apps.read_namespaced_deployment(name, namespace).spec.template.spec.containers[0].args
             == container.args, 60, "the rendered args restored")
    apps.patch_namespaced_deployment_scale(name, namespace, {"spec": {"replicas": 3}}, field_manager="kubectl-scale")
    wait_for(lambda: apps.read_namespaced_deployment(name, namespace).spec.replicas == 1, 60, "replicas restored")

    def managers() -> set[str]:
        events = dd.core.list_namespaced_event(namespace, field_selector="involvedObject.name=drift").items
        return {e.message.split(" was changed by ")[1].split(";")[0] for e in events
                if e.reason == "ChildDriftReverted"}
    # kopf posts events from its own queue, after the revert they report: wait for both
    wait_for(lambda: {"kubectl-edit", "kubectl-scale"} <= managers(), 60,
             "ChildDriftReverted events naming kubectl-edit and kubectl-scale")
    after = metric_sum(scrape(f"http://127.0.0.1:{operator_metrics.port()}"), m.OPERATOR_DRIFT_REVERTS)
    assert after - before >= 2
    dd.wait_phase("Ready")


def _clique_of(api_client, pods):
    core = client.CoreV1Api(api_client)
    return {core.read_node(p.spec.node_name).metadata.labels[nodepools.CLIQUE_LABEL] for p in pods}


@pytest.mark.parametrize("mode", ["required", "preferred"])
def test_topology_packs_the_gang_into_one_domain(api_client, namespace, operator, mode):
    """Four 4-GPU workers would spread over the empty fleet; the topology key packs them."""
    dd = DD(api_client, namespace, dd_manifest(
        f"topo-{mode}", prefill={"replicas": 2, "tensorParallelSize": 4},
        decode={"replicas": 2, "tensorParallelSize": 4},
        scheduling={"gang": {"minPrefill": 2, "minDecode": 2},
                    "topology": {"key": nodepools.CLIQUE_LABEL, "mode": mode}}))
    dd.wait_phase("Ready")
    pods = dd.pods("prefill") + dd.pods("decode")
    assert len(pods) == 4 and len(_clique_of(api_client, pods)) == 1


def test_preferred_topology_still_schedules_when_no_domain_fits(api_client, namespace, operator):
    """Five 8-GPU replicas cannot share a 4-node domain: preferred spreads them rather than wait."""
    dd = DD(api_client, namespace, dd_manifest(
        "spread", prefill={"replicas": 1, "tensorParallelSize": 8},
        decode={"replicas": 4, "tensorParallelSize": 8},
        scheduling={"gang": {"minPrefill": 1, "minDecode": 4},
                    "topology": {"key": nodepools.CLIQUE_LABEL, "mode": "preferred"}}))
    dd.wait_phase("Ready", timeout=120)
    pods = dd.pods("prefill") + dd.pods("decode")
    assert len(pods) == 5 and len(_clique_of(api_client, pods)) >= 2


def test_engine_args_reach_the_container_literally(api_client, namespace, operator):
    tricky = ["--served-model-name", "$(rm -rf /)", "; echo pwned", "'quoted' \"double\"", "a b\tc", "`id`"]
    dd = DD(api_client, namespace, dd_manifest("args", engine={"args": tricky}))
    dep = wait_for(lambda: next(iter(dd.apps.list_namespaced_deployment(
        namespace, label_selector=f"{LABEL_ROLE}=decode").items), None), 60, "decode Deployment")
    container = dep.spec.template.spec.containers[0]
    assert container.command == ["python", "-m", "disagg.workers"], "exec form: no shell in between"
    assert container.args[-len(tricky):] == tricky
    # and an exec-form argv reaches a real process unchanged
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))",
                          *container.args], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)[-len(tricky):] == tricky


def test_router_processes_each_have_a_named_metrics_port(api_client, namespace, operator):
    """spec.router.processes: the router pod the API server stores and a node runs names one metrics port
    per process (the ports the chart's router PodMonitor keeps) and starts that many processes."""
    import re

    from disagg.api import contract

    dd = DD(api_client, namespace, dd_manifest("procs", router={"processes": 3}))
    pod = wait_for(lambda: next((p for p in dd.pods("router") if p.status.phase == "Running"), None), 120,
                   "a running router pod")
    (c,) = pod.spec.containers
    ports = {p.name: p.container_port for p in c.ports}
    metrics = sorted(n for n in ports if re.fullmatch(contract.ROUTER_METRICS_PORT_NAMES, n))
    assert metrics == ["metrics-0", "metrics-1", "metrics-2"]
    assert [ports[n] for n in metrics] == [contract.ROUTER_METRICS_PORT + i for i in range(3)]
    assert c.args[c.args.index("--processes") + 1] == "3"


def test_a_secret_ref_is_passed_to_the_pods_without_the_operator_reading_secrets(api_client, namespace, operator):
    """The operator may not read Secrets (operator/rbac.yaml): spec.model.secretRef goes into the worker
    pods' env as a secretKeyRef, and a missing Secret is the kubelet's CreateContainerConfigError, which
    Degraded names with the kubelet's message (tests/test_operator_status.py; kwok does not check Secrets)."""
    dd = DD(api_client, namespace, dd_manifest("secret", model={"secretRef": {"name": "hf-token"}}))
    dd.wait_phase("Ready")
    for role in ("prefill", "decode"):
        pod = dd.apps.read_namespaced_deployment(f"secret-{role}", namespace).spec.template.spec
        refs = [e.value_from.secret_key_ref for c in pod.containers for e in c.env or []
                if e.value_from and e.value_from.secret_key_ref]
        assert [r.name for r in refs] == ["hf-token"]
    auth = client.AuthorizationV1Api(api_client)
    review = auth.create_subject_access_review({"spec": {
        "user": "system:serviceaccount:disagg-system:disagg-operator",
        "resourceAttributes": {"namespace": namespace, "verb": "get", "resource": "secrets"}}})
    assert review.status.allowed is False


def test_faulty_pod_is_named_in_degraded(api_client, namespace, operator):
    dd = DD(api_client, namespace, dd_manifest("faulty"))
    dd.wait_phase("Ready")
    # A new decode pod that can never pull its image (kwok holds it in ImagePullBackOff).
    dd.apps.patch_namespaced_deployment("faulty-decode", namespace, {"spec": {"template": {"metadata": {
        "annotations": {nodepools.FAULT_ANNOTATION: "ImagePullBackOff"}}}}})
    cond = dd.wait_condition("Degraded", "True", "ImagePullBackOff")
    assert "ImagePullBackOff on decode pod faulty-decode-" in cond["message"]
    # surge, no unavailability: the old decode pod keeps serving
    assert dd.status()["decode"]["ready"] == 1 and dd.condition("Ready")["status"] == "True"


def test_rollout_never_leaves_a_role_without_ready_pods(api_client, namespace, operator):
    dd = DD(api_client, namespace, dd_manifest("roll", prefill={"replicas": 2}, decode={"replicas": 2},
                                               scheduling={"gang": {"minPrefill": 2, "minDecode": 2}}))
    dd.wait_phase("Ready")
    written = dd.record_statuses()     # every status write: on kwok a rollout can finish between two polls
    dd.patch_spec({"engine": {"image": "disagg/worker:0.1.1"}})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for role in ("prefill", "decode"):
            ready = [p for p in dd.pods(role) if any(c.type == "Ready" and c.status == "True"
                                                     for c in p.status.conditions or [])]
            assert ready, f"no ready {role} pod during the rollout"
        status = dd.status()
        images = {p.spec.containers[0].image for p in dd.pods()
                  if p.metadata.labels.get(LABEL_ROLE) in ("prefill", "decode")}
        if images == {"disagg/worker:0.1.1"} and status.get("phase") == "Ready" \
                and status.get("observedGeneration") == dd.get()["metadata"]["generation"] \
                and status["decode"]["updated"] == 2:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"rollout did not finish: {dd.status()}")
    wait_for(lambda: any(c["type"] == "Progressing" and c["status"] == "True"
                         for s in list(written) for c in s.get("conditions", [])),
             10, f"status never showed the rollout in progress (written: {written})")


def test_scale_up_and_down(api_client, namespace, operator):
    dd = DD(api_client, namespace, dd_manifest("scale"))
    dd.wait_phase("Ready")
    dd.patch_spec({"decode": {"replicas": 3}})
    wait_for(lambda: dd.status()["decode"]["summary"] == "3/3" and dd.status()["phase"] == "Ready", 90, "3 decode")
    dd.patch_spec({"decode": {"replicas": 1}})
    wait_for(lambda: dd.status()["decode"]["summary"] == "1/1" and len(dd.pods("decode")) == 1, 90, "1 decode")


def test_longest_allowed_name_gives_valid_children(api_client, namespace, operator):
    name = "n" * 48
    dd = DD(api_client, namespace, dd_manifest(name))
    dd.wait_phase("Ready")
    names = [d.metadata.name for d in dd.apps.list_namespaced_deployment(namespace).items]
    assert all(len(n) <= 63 for n in names) and f"{name}-prefill" in names


def test_changing_the_topology_key_on_a_live_deployment(api_client, namespace, operator):
    """Gang constraints are immutable in the API; changing the key makes a new gang, the
    workers roll onto it without losing service, and the old gang objects are deleted."""
    dd = DD(api_client, namespace, dd_manifest(
        "retopo", prefill={"replicas": 1}, decode={"replicas": 2},
        scheduling={"gang": {"minPrefill": 1, "minDecode": 2},
                    "topology": {"key": nodepools.CLIQUE_LABEL, "mode": "required"}}))
    dd.wait_phase("Ready")
    custom = client.CustomObjectsApi(api_client)

    def groups():
        return sorted(g["metadata"]["name"] for g in custom.list_namespaced_custom_object(
            "scheduling.k8s.io", "v1beta1", namespace, "podgroups")["items"])
    old = groups()
    dd.patch_spec({"scheduling": {"topology": {"key": nodepools.RACK_LABEL, "mode": "required"}}})

    def converged():
        pods = dd.pods("prefill") + dd.pods("decode")
        gangs = {p.metadata.labels.get("serving.disagg.dev/gang") for p in pods}
        return (len(pods) == 3 and len(gangs) == 1 and groups() and not set(groups()) & set(old)
                and dd.status().get("phase") == "Ready" and gangs)
    gang = wait_for(converged, 120, "workers on the new gang and old gang objects deleted")
    composite = custom.list_namespaced_custom_object("scheduling.k8s.io", "v1alpha3", namespace,
                                                     "compositepodgroups")["items"]
    assert [c["spec"]["schedulingConstraints"]["topology"][0]["key"] for c in composite] == [nodepools.RACK_LABEL]
    pods = dd.pods("prefill") + dd.pods("decode")
    racks = {client.CoreV1Api(api_client).read_node(p.spec.node_name).metadata.labels[nodepools.RACK_LABEL]
             for p in pods}
    assert len(racks) == 1, f"gang {gang} spread over racks {racks}"


@pytest.mark.parametrize("backend", ["coscheduling", "volcano"])
def test_other_gang_backends_render_valid_objects(api_client, namespace, operator, other_gang_crds, backend):
    dd = DD(api_client, namespace, dd_manifest(f"gang-{backend}", decode={"replicas": 2},
                                               scheduling={"gang": {"backend": backend, "minPrefill": 1,
                                                                    "minDecode": 2}}))
    custom = client.CustomObjectsApi(api_client)
    group, version = {"coscheduling": ("scheduling.x-k8s.io", "v1alpha1"),
                      "volcano": ("scheduling.volcano.sh", "v1beta1")}[backend]
    items = wait_for(lambda: custom.list_namespaced_custom_object(group, version, namespace, "podgroups")["items"],
                     60, f"{backend} PodGroups accepted by the API server")
    pods = wait_for(lambda: len(dd.pods("decode")) == 2 and dd.pods("prefill") + dd.pods("decode"), 60, "pods")
    if backend == "volcano":
        assert [(i["spec"]["minMember"], i["spec"]["minTaskMember"]) for i in items] == [(3, {"prefill": 1,
                                                                                             "decode": 2})]
        assert {p.spec.scheduler_name for p in pods} == {"volcano"}
        assert {p.metadata.annotations["volcano.sh/task-spec"] for p in pods} == {"prefill", "decode"}
    else:
        assert sorted(i["spec"]["minMember"] for i in items) == [1, 2]
        assert {p.metadata.labels["scheduling.x-k8s.io/pod-group"] for p in pods} == {
            i["metadata"]["name"] for i in items}
    # nobody runs that scheduler here: the pods wait, and the status says the gang is not placed
    assert all(p.spec.node_name is None for p in pods)
    dd.wait_condition("GangScheduled", "False")


def test_operator_follows_the_planners_replicas(cluster, api_client, namespace, operator):
    """The planner owns replicas (server-side apply as `disagg-planner`); the operator scales the
    workers to follow, and a user's later apply of a manifest without replicas changes nothing."""
    import yaml

    from disagg.planner.apply import APPLY, FIELD_MANAGER, replicas_owner

    manifest = dd_manifest("planned", planner={"enabled": True}, slo={"ttftMs": 500, "itlMs": 50})
    del manifest["spec"]["prefill"]["replicas"], manifest["spec"]["decode"]["replicas"]
    manifest["metadata"]["namespace"] = namespace
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
    dd = DD(api_client, namespace, "planned")  # created by kubectl above
    dd.wait_phase("Ready")
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DisaggDeployment",
            "metadata": {"name": "planned", "namespace": namespace},
            "spec": {"prefill": {"replicas": 2}, "decode": {"replicas": 3}}}
    dd.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "planned", body,
                                             field_manager=FIELD_MANAGER, force=True, _content_type=APPLY)
    assert replicas_owner(dd.get()) == FIELD_MANAGER
    wait_for(lambda: dd.status().get("prefill", {}).get("summary") == "2/2"
             and dd.status().get("decode", {}).get("summary") == "3/3", 90, "workers scaled to the planner's sizes")
    assert dd.apps.read_namespaced_deployment("planned-decode", namespace).spec.replicas == 3
    generation = dd.get()["metadata"]["generation"]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
    # the re-apply changed no spec field (a new generation would mean it touched the planner's replicas),
    # so the operator has nothing to act on: checked at once, not after a wait that proves nothing
    assert dd.get()["metadata"]["generation"] == generation
    assert dd.get()["spec"]["decode"]["replicas"] == 3
    assert dd.apps.read_namespaced_deployment("planned-decode", namespace).spec.replicas == 3




def test_flex_pool_pods_serve_a_role_each_and_report_switches(api_client, namespace, operator):
    """spec.flex: a third Deployment whose engines start as kv_both, its Service for the routers' discovery;
    each new flex pod gets a serving role (split evenly: no planner here), visible in status.flex and as a
    gauge; a label changed as the planner would change it is reported once: event, counter, status."""
    from disagg.api.names import ANNOTATION_OBSERVED_SERVING_ROLE, LABEL_SERVING_ROLE, ROLE_FLEX

    dd = DD(api_client, namespace, dd_manifest("flexy", flex={"replicas": 3, "maxReplicas": 4}))
    dd.wait_phase("Ready")
    flex = wait_for(lambda: (dd.status().get("flex") or {}).get("ready") == 3 and dd.status()["flex"], 90,
                    "three flex workers ready")
    assert (flex["prefill"], flex["decode"], flex["desired"], flex["roleSwitches"]) == (1, 2, 3, 0), flex
    pods = wait_for(lambda: (lambda ps: len(ps) == 3 and all(
        LABEL_SERVING_ROLE in (p.metadata.labels or {}) for p in ps) and ps)(dd.pods(ROLE_FLEX)), 30, "labelled")
    assert sorted(p.metadata.labels[LABEL_SERVING_ROLE] for p in pods) == ["decode", "decode", "prefill"]
    worker = pods[0].spec.containers[0]
    assert worker.args[worker.args.index("--role") + 1] == ROLE_FLEX      # the engine starts kv_both
    router = dd.apps.read_namespaced_deployment("flexy-router", namespace).spec.template.spec.containers[0].args
    assert router[router.index("--flex-service") + 1] == "flexy-flex"
    assert router[router.index("--flex-drain-seconds") + 1] == "120"
    assert dd.core.read_namespaced_service("flexy-flex", namespace).spec.selector == {
        "serving.disagg.dev/deployment": "flexy", LABEL_ROLE: ROLE_FLEX}
    url = f"http://127.0.0.1:{operator_metrics.port()}"
    gauge = f'{m.OPERATOR_FLEX_WORKERS}{{deployment="flexy",namespace="{namespace}",role="prefill"}}'
    wait_for(lambda: scrape(url).get(gauge) == 1, 30, "the flex gauge")

    # the planner's move: a decode worker to prefill
    moved = next(p for p in pods if p.metadata.labels[LABEL_SERVING_ROLE] == "decode")
    dd.core.patch_namespaced_pod(moved.metadata.name, namespace,
                                 {"metadata": {"labels": {LABEL_SERVING_ROLE: "prefill"}}})
    flex = wait_for(lambda: (dd.status().get("flex") or {}).get("roleSwitches") == 1 and dd.status()["flex"], 30,
                    "the switch in status")
    assert (flex["prefill"], flex["decode"]) == (2, 1), flex
    events = wait_for(lambda: [e for e in dd.core.list_namespaced_event(
        namespace, field_selector="involvedObject.name=flexy").items if e.reason == "RoleSwitched"], 30, "event")
    assert len(events) == 1 and f"flex worker {moved.metadata.name}: decode -> prefill" in events[0].message
    switches = f'{m.OPERATOR_ROLE_SWITCHES}{{deployment="flexy",from_role="decode",namespace="{namespace}",' \
               'to_role="prefill"}'
    wait_for(lambda: scrape(url).get(switches) == 1, 30, "the switch counter")
    assert dd.core.read_namespaced_pod(moved.metadata.name, namespace).metadata.annotations[
        ANNOTATION_OBSERVED_SERVING_ROLE] == "prefill"
    # a role someone set is never changed by the operator: the label stays what the planner wrote
    assert dd.core.read_namespaced_pod(moved.metadata.name, namespace).metadata.labels[LABEL_SERVING_ROLE] == "prefill"
    assert dd.status()["flex"]["roleSwitches"] == 1          # counted once
