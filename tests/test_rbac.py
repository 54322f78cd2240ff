"""Least privilege, measured: every verb each ServiceAccount's roles grant is used, and nothing is denied.

The chart's RBAC (helm template, both gang backends on) is applied to the real API server for a release in
the audited namespace (conftest.AUDITED_NAMESPACE: the API server logs every request of its ServiceAccounts),
once watching all namespaces (ClusterRoles) and once with operator.watchNamespaces (Roles in that namespace).
The operator runs in this process under a token of the chart's operator ServiceAccount and the planner loop
under the planner's, through a scenario that makes each do everything it does: create, drift-revert and
re-gang a deployment, the other gang backends, a gang that does not fit (the capacity lists), the
NetworkPolicy switched off, a deployment in picker mode (its InferencePool, under the chart's CRD) switched
back to proxy mode, a planner decision with a profile ConfigMap over a flex pool. The chart's policies on what the
operator's and the planner's accounts write are applied too, and each refusal proved. Then, per account, the grants
(API group, resource, verb) are compared with the audit log:

- a grant never used fails the test (remove it, or exercise it);
- a request RBAC denies (the audit event's authorization decision "forbid") fails the test (the role lacks what
  the code does).

Two kinds of use are not requests of their own: a server-side apply that creates an object is a patch the
API server also authorizes as create (logged as a patch answered 201), and a Role the operator creates
for a router is admitted only if the operator holds every rule in it (RBAC's escalation check), so the
router Role's rules are used by each Role the operator created.

The router, which faces clients, is audited on its own account too (watching all namespaces, where the
operator serves a deployment in the audited namespace): its discovery runs under a token of the
ServiceAccount the operator made for it, and the Role the operator bound to that account must be used
whole, with nothing denied.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config

from disagg.api import inferencepool as pools
from disagg.api.names import LABEL_DEPLOYMENT, LABEL_ROLE, LABEL_SERVING_ROLE, ROLE_FLEX, SERVING_ROLES
from disagg.api.v1alpha1 import DisaggDeployment
from disagg.e2e.localcluster import binaries, nodepools
from disagg.e2e.operator_fixture import AUDITED_NAMESPACE, running_operator, token_kubeconfig
from disagg.e2e.testing import DD, GROUP, PLURAL, VERSION, dd_manifest, install_inference_pool_crd, wait_for
from disagg.operator import render
from disagg.perf import model as perfmodel
from disagg.perf.profile import configmap
from disagg.planner.apply import Executor
from disagg.planner.endpoints import Allowlist, Endpoint
from disagg.planner.loop import PlannerLoop
from disagg.planner.metrics_source import PrometheusSource
from disagg.router.discovery import EndpointSliceDiscovery

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "disagg"
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
# the chart's policy on what the operator's account may write (operator-admission.yaml): applied with the
# roles, so the whole scenario runs under it
POLICY_KINDS = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
WRITES_POLICY = "operator-writes"
PLANNER_POLICY = "planner-writes"   # and on what the planner's account writes to pods (planner-admission.yaml)
GANG_GROUPS = {"coscheduling": ("scheduling.x-k8s.io", "v1alpha1"), "volcano": ("scheduling.volcano.sh", "v1beta1")}
Grant = tuple[str, str, str]   # (API group, resource[/subresource], verb)


def chart_rbac(release: str, *values: str) -> list[dict]:
    out = subprocess.run(
        [str(binaries() / "helm"), "template", release, str(CHART), "--namespace", AUDITED_NAMESPACE,
         "--set", "gangBackends.coscheduling=true", "--set", "gangBackends.volcano=true", *values],
        capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d and (d["kind"] in RBAC_KINDS or (
        d["kind"] in POLICY_KINDS and d["metadata"]["name"].endswith((WRITES_POLICY, PLANNER_POLICY))))]


def expand(rules: list[dict]) -> set[Grant]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def granted(objs: list[dict], account: str) -> dict[Grant, str]:
    """Every (group, resource, verb) bound to `account`, with the role that grants it."""
    roles = {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o["rules"]
             for o in objs if o["kind"] in ("ClusterRole", "Role")}
    out: dict[Grant, str] = {}
    for b in (o for o in objs if o["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        if not any(s["name"] == account and s.get("namespace") == AUDITED_NAMESPACE for s in b["subjects"]):
            continue
        ref = b["roleRef"]
        key = (ref["kind"], b["metadata"].get("namespace", "") if ref["kind"] == "Role" else "", ref["name"])
        for grant in expand(roles[key]):
            out[grant] = f"{ref['kind']} {ref['name']}"
    return out


def audit_events(path: Path, offset: int, user: str, namespace: str) -> list[dict]:
    """The account's requests in the test's namespace or cluster-scoped (in a full run, other tests'
    namespaces may be terminating, where a write is refused whatever the role says)."""
    with path.open() as f:
        f.seek(offset)
        events = [json.loads(line) for line in f if line.strip()]
    # every stage: a watch's ResponseStarted is there as soon as it is open
    return [e for e in events if e.get("user", {}).get("username") == user and e.get("objectRef")
            and e["objectRef"].get("namespace") in (None, namespace)]


def used(events: list[dict]) -> tuple[set[Grant], list[str]]:
    """(grants used, requests denied) from the audit events of one account."""
    uses: set[Grant] = set()
    denied = []
    for e in events:
        ref, code = e["objectRef"], (e.get("responseStatus") or {}).get("code", 0)
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        grant = (ref.get("apiGroup", ""), resource, e["verb"])
        # RBAC's own verdict (a 403 can also be a namespace being deleted)
        if (e.get("annotations") or {}).get("authorization.k8s.io/decision") == "forbid":
            denied.append(f"{e['verb']} {resource} ({ref.get('apiGroup', '') or 'core'}) in "
                          f"{ref.get('namespace', '<cluster>')}")
            continue
        uses.add(grant)
        if e["verb"] == "patch" and code == 201:   # a server-side apply that created the object
            uses.add(grant[:2] + ("create",))
    return uses, denied


def router_role_rules() -> set[Grant]:
    """The rules of the Role the operator writes for each router (rendered, not copied)."""
    dd = DisaggDeployment.model_validate({**dd_manifest("x"), "metadata": {"name": "x", "namespace": "n"}})
    manifests, _ = render.children(dd, "uid")
    (role,) = [m for m in manifests if m["kind"] == "Role"]
    return expand(role["rules"])


def token_client(cluster, api_client, account: str, path: Path) -> tuple[Path, client.ApiClient]:
    kubeconfig = token_kubeconfig(cluster.kubeconfig, api_client, AUDITED_NAMESPACE, account, path)
    return kubeconfig, config.new_client_from_config(str(kubeconfig))


def gang_groups(api_client, namespace: str, backend: str) -> list[str]:
    group, version = GANG_GROUPS[backend]
    return sorted(g["metadata"]["name"] for g in client.CustomObjectsApi(api_client).list_namespaced_custom_object(
        group, version, namespace, "podgroups")["items"])


def operator_scenario(api_client, namespace: str) -> None:
    """Everything the operator does, under its role, in `namespace`."""
    apps, custom = client.AppsV1Api(api_client), client.CustomObjectsApi(api_client)
    # a deployment: every child created (server-side apply), status, events
    dd = DD(api_client, namespace, dd_manifest("main", scheduling={
        "gang": {"minPrefill": 1, "minDecode": 1}, "topology": {"key": nodepools.CLIQUE_LABEL, "mode": "required"}}))
    dd.wait_phase("Ready", timeout=120)
    # a hand edit of a child: read and restored
    apps.patch_namespaced_deployment_scale("main-decode", namespace, {"spec": {"replicas": 3}})
    wait_for(lambda: apps.read_namespaced_deployment("main-decode", namespace).spec.replicas == 1, 60,
             "the hand edit reverted")
    # the other gang backends: their PodGroups created; switched back to the Workload API, the pods of the
    # old gang (unbound: no such scheduler runs here) are replaced and its PodGroups deleted
    for backend in GANG_GROUPS:
        other = DD(api_client, namespace, dd_manifest(f"gang-{backend}", scheduling={
            "gang": {"backend": backend, "minPrefill": 1, "minDecode": 1}}))
        wait_for(lambda: gang_groups(api_client, namespace, backend), 60, f"{backend} PodGroups")
        other.patch_spec({"scheduling": {"gang": {"backend": "workload-api"}}})
        wait_for(lambda: not gang_groups(api_client, namespace, backend), 120, f"{backend} PodGroups deleted")
    # a replica of two pods: the operator creates its pods itself, and recreates the replica as a whole
    # once one of them is gone (deleting the other)
    wide = DD(api_client, namespace, dd_manifest("wide", prefill={"replicas": 1, "podsPerReplica": 2,
                                                                  "parallelism": {"tensor": 2}}))
    wait_for(lambda: len(wide.pods("prefill")) == 2, 60, "the replica's two pods")
    client.CoreV1Api(api_client).delete_namespaced_pod("wide-prefill-0-1", namespace, grace_period_seconds=0)
    wait_for(lambda: {p.metadata.name for p in wide.pods("prefill")} == {"wide-prefill-1-0", "wide-prefill-1-1"},
             120, "the replica recreated whole")
    # picker mode: the deployment's InferencePool created (server-side apply), then deleted back in proxy mode
    gateway = DD(api_client, namespace, dd_manifest("gw", router={"mode": "picker"}))
    pools_now = lambda: {p["metadata"]["name"] for p in custom.list_namespaced_custom_object(  # noqa: E731
        pools.GROUP, pools.VERSION, namespace, pools.PLURAL)["items"]}
    wait_for(lambda: "gw" in pools_now(), 60, "the InferencePool of a picker-mode deployment")
    gateway.patch_spec({"router": {"mode": "proxy"}})
    wait_for(lambda: "gw" not in pools_now(), 60, "the InferencePool deleted back in proxy mode")
    # a flex pool: the operator labels its pod with a serving role (a metadata-only update of a pod it did not
    # create, which the write policy allows on flex pods alone)
    flexy = DD(api_client, namespace, dd_manifest("flexy", flex={"replicas": 1}))
    wait_for(lambda: any(LABEL_SERVING_ROLE in (p.metadata.labels or {}) for p in flexy.pods(ROLE_FLEX)), 60,
             "the flex pod labelled with its serving role")
    # a gang that cannot be placed: the capacity view lists nodes and bound pods cluster-wide
    DD(api_client, namespace, dd_manifest("too-big", decode={"replicas": 1, "tensorParallelSize": 16,
                                                             "resources": {"limits": {"nvidia.com/gpu": 16}}})
       ).wait_condition("GangScheduled", "False", "InsufficientCapacity", timeout=90)
    # the NetworkPolicy option turned off: the operator deletes the one it made (at the next reconcile),
    # and a new topology key re-gangs `main`: the old gang's Workload API objects are deleted
    os.environ[render.NETWORK_POLICY_ENV] = "false"
    try:
        old = sorted(g["metadata"]["name"] for g in custom.list_namespaced_custom_object(
            "scheduling.k8s.io", "v1beta1", namespace, "podgroups")["items"] if g["metadata"]["name"].startswith("main"))
        dd.patch_spec({"scheduling": {"topology": {"key": nodepools.RACK_LABEL, "mode": "required"}}})
        wait_for(lambda: not client.NetworkingV1Api(api_client).list_namespaced_network_policy(
            namespace, label_selector="serving.disagg.dev/deployment=main").items, 60, "the NetworkPolicy deleted")
        wait_for(lambda: not {g["metadata"]["name"] for g in custom.list_namespaced_custom_object(
            "scheduling.k8s.io", "v1beta1", namespace, "podgroups")["items"]} & set(old), 180,
            "the old gang's PodGroups deleted")
    finally:
        del os.environ[render.NETWORK_POLICY_ENV]


def planner_scenario(planner_api, api_client, namespace: str, namespaces: list[str]) -> None:
    """One planner pass over a deployment with a profile ConfigMap and a flex pool, its Prometheus unreachable:
    it reads the profile, lists the flex pods and gives the one that has no serving role yet its role (a
    label: the operator, which would, is not running), takes the replicas (server-side apply), writes status
    and posts an event."""
    profile = perfmodel.Profile(model="tiny", gpu="H100-SXM", tensor_parallel_size=1,
                                prefill=tuple({"tokens": t, "batch": 1, "seconds": t / 1e4} for t in (64, 128, 256)),
                                decode=tuple({"concurrency": c, "context": 128, "seconds": 0.01 * c} for c in (1, 2, 4)))
    core = client.CoreV1Api(api_client)
    core.create_namespaced_config_map(namespace, configmap(profile, "profile"))
    DD(api_client, namespace, dd_manifest("planned", slo={"ttftMs": 1000, "itlMs": 50}, planner={
        "enabled": True, "prometheus": "main", "profileRef": {"name": "profile"}}, flex={"replicas": 1}))
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "planned-flex-0", "labels": {LABEL_DEPLOYMENT: "planned", LABEL_ROLE: ROLE_FLEX}},
        "spec": {"containers": [{"name": "c", "image": "x"}], "automountServiceAccountToken": False}})
    loop = PlannerLoop(planner_api, Executor(planner_api), lambda endpoint: PrometheusSource.for_endpoint(endpoint, 1),
                       Allowlist({"main": Endpoint("main", "http://127.0.0.1:9")}), namespace=namespaces)
    done = [d for ns, name, d in loop.step() if (ns, name) == (namespace, "planned")]
    assert done and done[0].reason == "PrometheusUnreachable", done
    labels = core.read_namespaced_pod("planned-flex-0", namespace).metadata.labels
    assert labels.get(LABEL_SERVING_ROLE) in SERVING_ROLES, labels


def refused_by_policy(attempts: dict, policy: str) -> dict[str, str]:
    """Each attempt (what -> a call RBAC allows) refused by a ValidatingAdmissionPolicy: what -> the API
    server's message. Waits on each: a policy's binding takes effect some seconds after it is created."""
    out = {}
    for what, attempt in attempts.items():
        def refused() -> str | None:
            try:
                attempt()
            except client.ApiException as e:
                return e.body if e.status in (403, 422) and "ValidatingAdmissionPolicy" in (e.body or "") else None
            raise AssertionError(f"{what}: admitted")
        out[what] = wait_for(refused, 30, f"{what} refused by {policy}")
    return out


def planner_refusals(planner_api, namespace: str) -> dict[str, str]:
    """What the chart's planner-writes policy refuses the planner's account, each a patch RBAC allows it:
    kind -> the API server's message."""
    core = client.CoreV1Api(planner_api)
    prefill = next(p.metadata.name for p in client.CoreV1Api(planner_api).list_namespaced_pod(
        namespace, label_selector=f"{LABEL_DEPLOYMENT}=main,{LABEL_ROLE}=prefill").items)
    attempts = {
        "a serving role on a prefill pod": lambda: core.patch_namespaced_pod(
            prefill, namespace, {"metadata": {"labels": {LABEL_SERVING_ROLE: "decode"}}}),
        "another label on a flex pod": lambda: core.patch_namespaced_pod(
            "planned-flex-0", namespace, {"metadata": {"labels": {LABEL_DEPLOYMENT: "main"}}}),
        "a flex pod's pool label": lambda: core.patch_namespaced_pod(
            "planned-flex-0", namespace, {"metadata": {"labels": {LABEL_ROLE: "prefill"}}}),
    }
    return refused_by_policy(attempts, "the planner's write policy")


ROUTED = "routed"    # the deployment whose router account is audited (in AUDITED_NAMESPACE)


def router_scenario(cluster, api_client, tmp_path: Path) -> tuple[str, dict[Grant, str]]:
    """The router's discovery, once, under its own ServiceAccount: (its user name, the grants of the Role
    the operator bound to it, as the API server holds them)."""
    names = render.names(ROUTED)
    account = names["router"]
    wait_for(lambda: any(r.metadata.name == account for r in client.RbacAuthorizationV1Api(api_client)
                         .list_namespaced_role_binding(AUDITED_NAMESPACE).items), 60, "the router's RoleBinding")
    _, router_api = token_client(cluster, api_client, account, tmp_path / "router")
    try:
        discovery = EndpointSliceDiscovery(router_api, AUDITED_NAMESPACE,
                                           {"prefill": names["prefill"], "decode": names["decode"]})
        revisions = discovery.revisions()
        for role in ("prefill", "decode"):
            discovery.list(role, revisions)
        # the LoRA adapters it loads, and their status it writes (router/adapters.py)
        discovery.report_adapters([{"name": a, "prefill": 0, "decode": 0}
                                   for a in sorted(discovery.adapters())])
    finally:
        router_api.close()
    role = client.RbacAuthorizationV1Api(api_client).read_namespaced_role(account, AUDITED_NAMESPACE)
    rules = [{"apiGroups": r.api_groups, "resources": r.resources, "verbs": r.verbs} for r in role.rules]
    return f"system:serviceaccount:{AUDITED_NAMESPACE}:{account}", {g: f"Role {account}" for g in expand(rules)}


def refusals(operator_api, namespace: str) -> dict[str, str]:
    """What the chart's write policy refuses the operator's own account, each a write RBAC alone allows
    (the account holds every verb and rule involved): kind -> the API server's message."""
    apps, rbac = client.AppsV1Api(operator_api), client.RbacAuthorizationV1Api(operator_api)
    owner = DD(operator_api, namespace, "main").get()["metadata"]
    owned = {"ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "DisaggDeployment", "name": "main",
                                  "uid": owner["uid"], "controller": True}]}

    def deployment(name: str, meta: dict, pod: dict) -> dict:
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, **meta},
                "spec": {"selector": {"matchLabels": {"app": name}}, "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {"containers": [{"name": "c", "image": "x"}], **pod}}}}
    attempts = {
        "an unowned Deployment": lambda: apps.create_namespaced_deployment(
            namespace, deployment("stray", {}, {"automountServiceAccountToken": False})),
        "a Deployment under another account": lambda: apps.create_namespaced_deployment(
            namespace, deployment("borrow", owned, {"serviceAccountName": "main-router"})),
        "a Deployment with a host path": lambda: apps.create_namespaced_deployment(
            namespace, deployment("host", owned, {"automountServiceAccountToken": False,
                                                  "volumes": [{"name": "h", "hostPath": {"path": "/"}}]})),
        "a Pod under another account": lambda: client.CoreV1Api(operator_api).create_namespaced_pod(namespace, {
            "metadata": {"name": "borrowed", **owned},
            "spec": {"serviceAccountName": "main-router", "containers": [{"name": "c", "image": "x"}]}}),
        "a RoleBinding to another account": lambda: rbac.create_namespaced_role_binding(namespace, {
            "metadata": {"name": "main-router-2", **owned},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "main-router"},
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}]}),
        "a Role beyond discovery": lambda: rbac.create_namespaced_role(namespace, {
            "metadata": {"name": "wider", **owned},
            "rules": [{"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["create"]}]}),
        "an InferencePool with another endpoint picker": lambda: client.CustomObjectsApi(
            operator_api).create_namespaced_custom_object(pools.GROUP, pools.VERSION, namespace, pools.PLURAL, {
                "apiVersion": pools.API_VERSION, "kind": pools.KIND, "metadata": {"name": "main", **owned},
                "spec": {"selector": {"matchLabels": {LABEL_DEPLOYMENT: "main"}}, "targetPorts": [{"number": 8000}],
                         "endpointPickerRef": {"name": "elsewhere", "port": {"number": 9002}}}}),
        "an InferencePool of another deployment's pods": lambda: client.CustomObjectsApi(
            operator_api).create_namespaced_custom_object(pools.GROUP, pools.VERSION, namespace, pools.PLURAL, {
                "apiVersion": pools.API_VERSION, "kind": pools.KIND, "metadata": {"name": "main", **owned},
                "spec": {"selector": {"matchLabels": {LABEL_DEPLOYMENT: "other"}}, "targetPorts": [{"number": 8000}],
                         "endpointPickerRef": {"name": "main", "port": {"number": 9002}}}}),
        # pods its Deployments made: only a flex pod's metadata (its serving role), never another's
        "a label on a prefill pod it did not create": lambda: client.CoreV1Api(operator_api).patch_namespaced_pod(
            client.CoreV1Api(operator_api).list_namespaced_pod(
                namespace, label_selector=f"{LABEL_DEPLOYMENT}=main,serving.disagg.dev/role=prefill").items[0].metadata.name,
            namespace, {"metadata": {"labels": {"serving.disagg.dev/serving-role": "decode"}}}),
    }
    return refused_by_policy(attempts, "the write policy")


@pytest.mark.parametrize("mode", ["all-namespaces", "watch-namespaces"])
def test_every_grant_is_used_and_nothing_is_denied(mode, cluster, api_client, crd_installed, other_gang_crds,
                                                    namespace, tmp_path):
    release = f"rbac-{mode.split('-')[0]}"
    watched = [namespace] if mode == "watch-namespaces" else []
    values = ["--set", f"operator.watchNamespaces={{{namespace}}}"] if watched else []
    objs = chart_rbac(release, *values)
    install_inference_pool_crd(cluster)   # the chart's (inferencePool.installCRD): picker mode's pools
    core = client.CoreV1Api(api_client)
    if not any(n.metadata.name == AUDITED_NAMESPACE for n in core.list_namespace().items):
        core.create_namespace({"metadata": {"name": AUDITED_NAMESPACE}})
    text = "---\n".join(yaml.safe_dump(o) for o in objs)
    cluster.kubectl("apply", "--server-side", "-f", "-", input=text)
    accounts = {o["metadata"]["labels"]["app.kubernetes.io/component"]: o["metadata"]["name"]
                for o in objs if o["kind"] == "ServiceAccount"}
    try:
        operator_config, _ = token_client(cluster, api_client, accounts["operator"], tmp_path / "operator")
        _, planner_api = token_client(cluster, api_client, accounts["planner"], tmp_path / "planner")
        offset = cluster.audit_log.stat().st_size if cluster.audit_log.exists() else 0
        router = None
        with running_operator(operator_config, namespaces=tuple(watched)):
            operator_scenario(api_client, namespace)
            if not watched:   # the operator serves the audited namespace too: a router account there
                routed = DD(api_client, AUDITED_NAMESPACE, dd_manifest(ROUTED))
                router = router_scenario(cluster, api_client, tmp_path)
                routed.custom.delete_namespaced_custom_object(GROUP, VERSION, AUDITED_NAMESPACE, PLURAL, ROUTED)
                wait_for(lambda: ROUTED not in {o["metadata"]["name"] for o in routed.custom.list_namespaced_custom_object(
                    GROUP, VERSION, AUDITED_NAMESPACE, PLURAL)["items"]}, 120, "the routed deployment deleted")
        planner_scenario(planner_api, api_client, namespace, watched)
        for what, message in planner_refusals(planner_api, namespace).items():
            assert "denied request" in message and PLANNER_POLICY in message, (what, message)
        planner_api.close()
        # the operator's account, outside the operator: what RBAC alone would let it write, refused
        operator_api = config.new_client_from_config(str(operator_config))
        try:
            for what, message in refusals(operator_api, namespace).items():
                assert "denied request" in message and WRITES_POLICY in message, (what, message)
        finally:
            operator_api.close()

        problems = []
        if router is not None:
            user, grants = router
            uses, denied = used(audit_events(cluster.audit_log, offset, user, AUDITED_NAMESPACE))
            assert uses, f"no audited request of {user}"
            problems += [f"router: {verb} {resource} ({group or 'core'}) granted by {grants[(group, resource, verb)]}"
                         f" but never used" for group, resource, verb in sorted(g for g in grants if g not in uses)]
            problems += [f"router: denied {d}" for d in sorted(set(denied))]
        for who, account in accounts.items():
            user = f"system:serviceaccount:{AUDITED_NAMESPACE}:{account}"
            uses, denied = used(audit_events(cluster.audit_log, offset, user, namespace))
            grants = granted(objs, account)
            if who == "operator" and ("rbac.authorization.k8s.io", "roles", "create") in uses:
                uses |= router_role_rules()
            unused = sorted(g for g in grants if g not in uses)
            problems += [f"{who}: {verb} {resource} ({group or 'core'}) granted by {grants[(group, resource, verb)]}"
                         f" but never used" for group, resource, verb in unused]
            problems += [f"{who}: denied {d}" for d in sorted(set(denied))]
            # and what it used is granted (a use outside the grants would be someone else's permission)
            problems += [f"{who}: used {g} that its roles do not grant" for g in sorted(uses - set(grants))]
        assert not problems, "\n".join(problems)
    finally:
        cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input=text, check=False)
