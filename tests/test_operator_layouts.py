"""Parallel layouts as the operator renders them: a one-pod replica carries its data-with-expert
parallel inside its pod (pipeline parallel is refused on both roles: disagg.api.parallelism.PIPELINE), with GPUs and KV revision to match; a replica of several pods
with a gang backend that has no per-replica level (scheduler-plugins, Volcano) applies nothing and says so
in status and an event, never replicas that could be half placed, whose engines would wait for ranks that
never come (tests/test_operator_groups.py runs multi-pod replicas with the workload API)."""

from __future__ import annotations

from kubernetes import client

from disagg.api import contract
from disagg.api.v1alpha1 import GPU_RESOURCE, DisaggDeployment
from disagg.e2e.testing import DD, dd_manifest, wait_for
from disagg.operator import render


def _dd(**spec) -> DisaggDeployment:
    m = dd_manifest("lay", **spec)
    m["metadata"]["namespace"] = "ns"
    return DisaggDeployment.model_validate(m)


def _worker(dd: DisaggDeployment, role: str) -> tuple[list[str], dict]:
    c = render.worker_deployment(dd, "uid", role, render.gangs.render("lay", dd.spec))["spec"]["template"]["spec"][
        "containers"][0]
    return c["args"], c["resources"]["limits"]


def test_a_one_pod_expert_parallel_replica_gets_its_flags_gpus_and_revision():
    plain, ep = _dd(), _dd(prefill={"replicas": 1, "parallelism": {"data": 2, "expert": True, "tensor": 2}})
    args, limits = _worker(ep, "prefill")
    assert contract.flag_value(args, "--data-parallel-size") == "2" and "--enable-expert-parallel" in args
    assert contract.flag_value(args, "--tensor-parallel-size") == "2"
    assert limits[GPU_RESOURCE] == "4", "tensor 2 x data 2 in one pod"
    plain_args, plain_limits = _worker(plain, "prefill")
    assert contract.flag_value(plain_args, "--data-parallel-size") is None and plain_limits[GPU_RESOURCE] == "1"
    assert render.kv_revision(ep) != render.kv_revision(plain), "expert parallel splits KV differently"
    assert render.unrendered_layout(ep) is None and render.unrendered_layout(plain) is None


def test_a_multi_pod_replica_without_a_replica_gang_is_not_rendered_and_says_so(api_client, namespace, operator):
    volcano = {"gang": {"backend": "volcano", "minPrefill": 1, "minDecode": 1}}
    wide = {"replicas": 1, "podsPerReplica": 2, "parallelism": {"tensor": 2}}
    assert "prefill.podsPerReplica is 2" in render.unrendered_layout(_dd(prefill=wide, scheduling=volcano))
    assert render.unrendered_layout(_dd(prefill=wide)) is None, "the workload API has a level per replica"
    dd = DD(api_client, namespace, dd_manifest("wide", prefill=wide, scheduling=volcano))
    degraded = dd.wait_condition("Degraded", "True", "ApplyFailed")
    assert "prefill.podsPerReplica is 2" in degraded["message"] and "workload-api" in degraded["message"]
    core = client.CoreV1Api(api_client)
    wait_for(lambda: any(e.reason == "LayoutNotRendered" and e.type == "Warning" for e in core.list_namespaced_event(
        namespace, field_selector="involvedObject.name=wide").items), 60, "a LayoutNotRendered event")
    assert not client.AppsV1Api(api_client).list_namespaced_deployment(namespace).items, "nothing applied"
