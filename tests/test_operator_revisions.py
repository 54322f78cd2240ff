"""KV revisions on the local control plane with the operator running: the revision the operator
renders onto the worker pods reaches the router's discovery, scaling keeps it (no pods rolled), and a
rollout that changes it keeps the old revision's ready pair until the new revision has one."""

from __future__ import annotations

from kubernetes import client

from disagg.api import contract
from disagg.api.names import LABEL_DEPLOYMENT, ROLE_DECODE, ROLE_PREFILL
from disagg.api.v1alpha1 import DisaggDeployment
from disagg.e2e.testing import DD, dd_manifest, wait_for
from disagg.operator import render
from disagg.router.discovery import EndpointSliceDiscovery

import pytest

pytestmark = pytest.mark.cluster


def _revision(dd: DD) -> str:
    obj = dd.get()
    return render.kv_revision(DisaggDeployment.model_validate({k: obj[k] for k in ("apiVersion", "kind", "metadata",
                                                                                   "spec")}))


def _ready(p) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])


def _workers(dd: DD) -> list:
    return [p for p in dd.pods() if p.metadata.labels.get("serving.disagg.dev/role") in (ROLE_PREFILL, ROLE_DECODE)]


def _paired(pods) -> set[str]:
    ready = {(p.metadata.labels[contract.KV_REVISION_LABEL], p.metadata.labels["serving.disagg.dev/role"])
             for p in pods if _ready(p)}
    return {rev for rev, role in ready if role == ROLE_PREFILL and (rev, ROLE_DECODE) in ready}


def test_router_discovers_the_revision_the_operator_renders(api_client, namespace, operator):
    dd = DD(api_client, namespace, dd_manifest("rev", decode={"replicas": 2}))
    dd.wait_phase("Ready")
    revision, n = _revision(dd), render.names("rev")
    disc = EndpointSliceDiscovery(api_client, namespace, {ROLE_PREFILL: n[ROLE_PREFILL], ROLE_DECODE: n[ROLE_DECODE]})

    def discovered(count: dict[str, int]):
        eps = {role: disc.list(role) for role in (ROLE_PREFILL, ROLE_DECODE)}
        return all(len(eps[r]) == count[r] for r in eps) and eps
    eps = wait_for(lambda: discovered({ROLE_PREFILL: 1, ROLE_DECODE: 2}), 60, "workers in the EndpointSlices")
    assert {(e.revision, e.revision_generation) for es in eps.values() for e in es} == {(revision, 1)}
    for p in _workers(dd):
        env = {e.name: e.value for e in p.spec.containers[0].env}
        assert env[contract.KV_REVISION_ENV] == revision

    # scaling is a new generation but the same revision: the generation label stays, no pod is replaced
    before = {p.metadata.name for p in dd.pods(ROLE_PREFILL)}
    dd.patch_spec({"decode": {"replicas": 3}})
    eps = wait_for(lambda: discovered({ROLE_PREFILL: 1, ROLE_DECODE: 3}), 60, "a third decode discovered")
    assert {(e.revision, e.revision_generation) for es in eps.values() for e in es} == {(revision, 1)}
    assert {p.metadata.name for p in dd.pods(ROLE_PREFILL)} == before
    # the router's own Role lets it list the pods it reads revisions from
    role = client.RbacAuthorizationV1Api(api_client).read_namespaced_role(n["router"], namespace)
    assert any("pods" in r.resources and "list" in r.verbs for r in role.rules)


def test_rollout_keeps_the_old_pair_until_the_new_revision_has_one(api_client, namespace, operator):
    """The new revision's decode cannot be placed (a node selector nothing matches): its prefill becomes
    ready but is held unavailable, so the prefill Deployment keeps its old pod and the old revision keeps
    a ready pair; once the decode can be placed, the rollout finishes on the new revision alone."""
    dd = DD(api_client, namespace, dd_manifest("hold", scheduling={"gang": {"backend": "none"}}))
    dd.wait_phase("Ready")
    old = _revision(dd)
    apps = client.AppsV1Api(api_client)
    dd.patch_spec({"engine": {"args": ["--kv-cache-dtype", "fp8"]},
                   "decode": {"nodeSelector": {"serving.disagg.dev/test-nowhere": "true"}}})
    new = _revision(dd)
    assert new != old

    def held():
        dep = apps.read_namespaced_deployment(render.names("hold")[ROLE_PREFILL], namespace)
        sets = apps.list_namespaced_replica_set(namespace, label_selector=f"{LABEL_DEPLOYMENT}=hold").items
        fresh = [rs for rs in sets if (rs.spec.template.metadata.labels or {}).get(contract.KV_REVISION_LABEL) == new
                 and rs.metadata.labels.get("serving.disagg.dev/role") == ROLE_PREFILL]
        # ready but not available: only the hold's minReadySeconds makes that state last
        return (dep.spec.min_ready_seconds == contract.ROLLOUT_HOLD_SECONDS
                and dep.status.observed_generation == dep.metadata.generation
                and fresh and (fresh[0].status.ready_replicas or 0) == 1
                and not fresh[0].status.available_replicas and dep)
    wait_for(held, 90, "the new revision's prefill ready and held")
    pods = _workers(dd)
    assert _paired(pods) == {old}, [(p.metadata.name, p.metadata.labels, _ready(p)) for p in pods]
    assert any(p.metadata.labels[contract.KV_REVISION_LABEL] == old and _ready(p) for p in dd.pods(ROLE_PREFILL))

    dd.patch_spec({"decode": {"nodeSelector": None}})

    def rolled_out() -> bool:
        pods = _workers(dd)
        # at every poll, not only at the end: never a moment without a ready pair of one revision
        assert _paired(pods), f"no revision with a ready pair: {[(p.metadata.name, _ready(p)) for p in pods]}"
        revs = {p.metadata.labels[contract.KV_REVISION_LABEL] for p in pods}
        deps = [apps.read_namespaced_deployment(render.names("hold")[r], namespace) for r in (ROLE_PREFILL, ROLE_DECODE)]
        return (revs == {new} and len(pods) == 2 and _paired(pods) == {new}
                and all(d.spec.min_ready_seconds in (0, None) for d in deps))
    wait_for(rolled_out, 120, f"the rollout to finish on {new}: one pair of it, the hold lifted", interval=0.1)

    def reasons() -> set[str]:
        return {e.reason for e in dd.core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=hold").items}
    wait_for(lambda: {"RolloutHeld", "RolloutHoldLifted"} <= reasons(), 30, "the hold's events")
