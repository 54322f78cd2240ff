"""The pods and the network policy the operator renders, against the real API server: Pod Security
Admission (the API server's built-in PodSecurity plugin, on by default) admits router and worker pods
in namespaces that enforce the baseline and the restricted levels, and the per-deployment
NetworkPolicy is created, reverted after hand edits, garbage-collected with its deployment, and
absent when the operator's option is off. What the API server accepts is tested here; whether the
policy is enforced depends on the CNI (the local cluster's bridge plugin does not enforce it)."""

from __future__ import annotations

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from disagg.api import contract
from disagg.api import metrics as m
from disagg.api.names import LABEL_DEPLOYMENT, LABEL_ROLE
from disagg.e2e.testing import DD, dd_manifest, wait_for
from disagg.e2e.testing import pod as pod_manifest
from disagg.operator import metrics as operator_metrics
from disagg.operator import render
from disagg.workers.local import scrape

ROLES = ("prefill", "decode", "router")


def _enforce(api_client, namespace: str, level: str) -> None:
    client.CoreV1Api(api_client).patch_namespace(namespace, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": level, "pod-security.kubernetes.io/enforce-version": "latest"}}})


def _refused(core: client.CoreV1Api, namespace: str, manifest: dict) -> str | None:
    """PodSecurity's refusal message for a pod, or None when it is admitted (and then deleted)."""
    try:
        core.create_namespaced_pod(namespace, manifest)
    except ApiException as e:
        assert e.status == 403, e
        return e.body
    core.delete_namespaced_pod(manifest["metadata"]["name"], namespace, grace_period_seconds=0)
    return None


def _replica_set_failures(apps: client.AppsV1Api, namespace: str) -> list[str]:
    """What the ReplicaSet controller was refused (PodSecurity's message lands in its ReplicaFailure)."""
    return [f"{rs.metadata.name}: {c.message}" for rs in apps.list_namespaced_replica_set(namespace).items
            for c in rs.status.conditions or [] if c.type == "ReplicaFailure"]


@pytest.mark.parametrize("level", ["baseline", "restricted"])
def test_pod_security_admission_admits_every_pod_the_operator_renders(api_client, namespace, operator, level):
    core, apps = client.CoreV1Api(api_client), client.AppsV1Api(api_client)
    _enforce(api_client, namespace, level)
    # PodSecurity is on and enforces this level: a privileged pod is refused at both levels, a pod
    # with no securityContext at all only at restricted
    privileged = pod_manifest("privileged")
    privileged["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    assert "violates PodSecurity" in (_refused(core, namespace, privileged) or ""), "PodSecurity admitted it"
    plain = _refused(core, namespace, pod_manifest("plain"))
    if level == "restricted":
        assert plain and "violates PodSecurity" in plain and "runAsNonRoot" in plain, plain
    else:
        assert plain is None, plain

    dd = DD(api_client, namespace, dd_manifest("psa", kvCache={"offload": {"diskGiB": 1}}))

    def admitted() -> dict[str, int]:
        pods = core.list_namespaced_pod(namespace, label_selector=f"{LABEL_DEPLOYMENT}=psa").items
        roles = {r: sum(1 for p in pods if p.metadata.labels.get(LABEL_ROLE) == r) for r in ROLES}
        failures = _replica_set_failures(apps, namespace)
        assert not failures, f"pods refused at {level}: {failures}"
        return roles if all(roles.values()) else {}
    wait_for(admitted, 90, f"a pod of every role admitted under enforce={level}")
    dd.wait_phase("Ready")
    for p in dd.pods():
        assert p.spec.security_context.run_as_user == contract.RUN_AS_USER, p.metadata.name
        assert p.spec.containers[0].security_context.read_only_root_filesystem is True, p.metadata.name


def test_ipc_lock_for_rdma_needs_a_privileged_namespace(api_client, namespace, operator):
    """spec.kvTransfer.ipcLock adds a capability the baseline level does not allow: its workers are refused
    there (what the field's description says), its router still admitted."""
    apps = client.AppsV1Api(api_client)
    _enforce(api_client, namespace, "baseline")
    DD(api_client, namespace, dd_manifest("rdma", kvTransfer={"ipcLock": True}))

    def refused_roles() -> set[str]:
        return {rs.metadata.labels.get(LABEL_ROLE) for rs in apps.list_namespaced_replica_set(namespace).items
                for c in rs.status.conditions or []
                if c.type == "ReplicaFailure" and "violates PodSecurity" in c.message and "IPC_LOCK" in c.message}
    wait_for(lambda: refused_roles() >= {"prefill", "decode"}, 90, "worker pods refused for IPC_LOCK at baseline")
    assert "router" not in refused_roles()
    wait_for(lambda: client.CoreV1Api(api_client).list_namespaced_pod(
        namespace, label_selector=f"{LABEL_DEPLOYMENT}=rdma,{LABEL_ROLE}=router").items, 60, "the router pod admitted")


def _policy(api_client, namespace: str, name: str):
    try:
        return client.NetworkingV1Api(api_client).read_namespaced_network_policy(name, namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _peer_selects(peer, labels: dict[str, str]) -> bool:
    """Whether a NetworkPolicy pod selector (matchLabels / In expressions) selects pods with `labels`."""
    sel = peer.pod_selector
    if sel is None:
        return False
    if any(labels.get(k) != v for k, v in (sel.match_labels or {}).items()):
        return False
    for e in sel.match_expressions or []:
        assert e.operator == "In", e
        if labels.get(e.key) not in e.values:
            return False
    return True


def _reverts(manager: str) -> float:
    samples = scrape(f"http://127.0.0.1:{operator_metrics.port()}")
    return samples.get(f'{m.OPERATOR_DRIFT_REVERTS}{{kind="NetworkPolicy",manager="{manager}"}}', 0.0)


def test_network_policy_admits_only_the_deployments_own_pods(api_client, namespace, operator):
    dd = DD(api_client, namespace, dd_manifest("np"))
    name = render.names("np")["network-policy"]
    policy = wait_for(lambda: _policy(api_client, namespace, name), 60, f"NetworkPolicy {name}")
    uid = dd.get()["metadata"]["uid"]
    assert policy.metadata.owner_references[0].uid == uid and policy.metadata.owner_references[0].controller

    spec = policy.spec
    assert spec.policy_types == ["Ingress"], "egress (model downloads) is not restricted"

    def labels(role: str, deployment: str = "np") -> dict[str, str]:
        return {LABEL_DEPLOYMENT: deployment, LABEL_ROLE: role}
    # the policy guards this deployment's workers, not its routers, not another deployment's workers
    assert _peer_selects(spec, labels("prefill")) and _peer_selects(spec, labels("decode"))
    assert not _peer_selects(spec, labels("router")) and not _peer_selects(spec, labels("decode", "other"))

    def ports_for(labels_: dict[str, str]) -> set[int] | None:
        """Ports a pod with these labels (in this namespace) may reach; None: every port."""
        allowed: set[int] = set()
        for rule in spec.ingress:
            if any(p.namespace_selector is None and p.ip_block is None and _peer_selects(p, labels_)
                   for p in rule._from or []):
                if not rule.ports:
                    return None
                allowed |= {p.port for p in rule.ports}
        return allowed
    assert ports_for(labels("prefill")) is None and ports_for(labels("decode")) is None, \
        "workers reach each other on every port (UCX picks its TCP ports)"
    assert ports_for(labels("router")) == {render.HTTP_PORT, render.KV_EVENTS_PORT, contract.KV_REPLAY_PORT}
    assert ports_for(labels("router", "other")) == set() and ports_for(labels("decode", "other")) == set()
    assert ports_for({"app": "anything"}) == set()
    (prometheus,) = [r for r in spec.ingress if any(p.namespace_selector is not None for p in r._from)]
    assert [p.port for p in prometheus.ports] == [contract.WORKER_METRICS_PORT], \
        "Prometheus reaches the metrics port only, never vLLM's API port"
    assert prometheus._from[0].pod_selector.match_labels == {"app.kubernetes.io/name": "prometheus"}

    # a hand edit (opening the workers to everyone) is reverted at once, and so is a deletion
    reverts_before = {manager: _reverts(manager) for manager in ("kubectl-edit", "delete")}
    net = client.NetworkingV1Api(api_client)
    net.patch_namespaced_network_policy(name, namespace, {"spec": {"ingress": [{}]}}, field_manager="kubectl-edit")
    wait_for(lambda: all(r._from for r in _policy(api_client, namespace, name).spec.ingress or []), 60,
             "the rendered ingress rules restored")
    assert len(_policy(api_client, namespace, name).spec.ingress) == len(spec.ingress)
    before = policy.metadata.uid
    net.delete_namespaced_network_policy(name, namespace)
    wait_for(lambda: (p := _policy(api_client, namespace, name)) is not None and p.metadata.uid != before, 60,
             "the deleted NetworkPolicy re-created")

    # counted once each (the metric, not the events: kopf posts those from one queue, which can be held
    # up for a minute retrying events of an earlier test's deleted namespace)
    wait_for(lambda: all(_reverts(manager) > reverts_before[manager] for manager in ("kubectl-edit", "delete")),
             60, "drift reverts counted for the edit and the deletion")

    # gone with its deployment (owner reference, the garbage collector)
    dd.custom.delete_namespaced_custom_object("serving.disagg.dev", "v1alpha1", namespace, "disaggdeployments", "np")
    wait_for(lambda: _policy(api_client, namespace, name) is None, 60, "the NetworkPolicy garbage-collected")


def test_network_policy_option_off(api_client, namespace, operator, monkeypatch):
    """The chart's networkPolicy.enabled=false reaches the operator as DISAGG_NETWORK_POLICY=false:
    new deployments get no policy, and an existing one is deleted at its deployment's next reconcile."""
    net = client.NetworkingV1Api(api_client)
    before = DD(api_client, namespace, dd_manifest("was-on"))
    wait_for(lambda: _policy(api_client, namespace, render.names("was-on")["network-policy"]), 60, "policy")
    monkeypatch.setenv(render.NETWORK_POLICY_ENV, "false")
    before.patch_spec({"router": {"overlapWeight": 2.0}})
    wait_for(lambda: _policy(api_client, namespace, render.names("was-on")["network-policy"]) is None, 60,
             "the policy deleted once the option is off")

    dd = DD(api_client, namespace, dd_manifest("off"))
    # the policy is applied before the Deployments (render.children's order): once they exist, it would too
    wait_for(lambda: len(dd.apps.list_namespaced_deployment(
        namespace, label_selector=f"{LABEL_DEPLOYMENT}=off").items) == 3, 60, "the Deployments of 'off'")
    assert not net.list_namespaced_network_policy(namespace).items
