"""Steps and assertions of the end-to-end suite (tests/test_e2e_helm.py), written against the Kubernetes
API only so they hold on every provider (e2e/providers.py): the Helm release's objects, placement of a
DisaggDeployment's pods, its gang, its status, scaling, a rollout, deletion."""

from __future__ import annotations

import subprocess
import time
from typing import Any, Callable

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from disagg.api.names import LABEL_DEPLOYMENT, LABEL_ROLE

from .localcluster.nodepools import CLIQUE_LABEL
from .providers import CHART, REPO, Provider
from .testing import DD, GROUP, PLURAL, VERSION, wait_for

GPU = "nvidia.com/gpu"
CRD_NAME = "disaggdeployments.serving.disagg.dev"
EXAMPLES = REPO / "examples"
ROLES = ("prefill", "decode")
INSTANCE = "app.kubernetes.io/instance"


# ---------------------------------------------------------------- the Helm release

# The Prometheus endpoint examples/with-planner.yaml names (spec.planner.prometheus: main): the chart's
# admission policy refuses a name its planner.prometheusEndpoints does not list.
EXAMPLE_PROMETHEUS = ("--set-json",
                      'planner.prometheusEndpoints=[{"name": "main", "url": "http://prometheus-operated.monitoring:9090"}]')


def helm_install(provider: Provider, release: str, namespace: str, *values: str, timeout: str = "5m") -> None:
    provider.helm("install", release, str(CHART), "--namespace", namespace, "--create-namespace",
                  "--timeout", timeout, *EXAMPLE_PROMETHEUS, *values)


def helm_uninstall(provider: Provider, release: str, namespace: str, check: bool = True) -> None:
    provider.helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "5m", check=check)


def release_objects(api: client.ApiClient, release: str, namespace: str) -> dict[str, list[str]]:
    """Kind -> names of the objects labelled as the release's (what the chart renders carries that label),
    cluster-wide for cluster-scoped kinds and in `namespace` otherwise; the monitoring kinds where served."""
    sel = f"{INSTANCE}={release}"
    core, rbac, apps = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api), client.AppsV1Api(api)
    found = {
        "ServiceAccount": core.list_namespaced_service_account(namespace, label_selector=sel).items,
        "Service": core.list_namespaced_service(namespace, label_selector=sel).items,
        "ConfigMap": core.list_config_map_for_all_namespaces(label_selector=sel).items,
        "Deployment": apps.list_namespaced_deployment(namespace, label_selector=sel).items,
        "ClusterRole": rbac.list_cluster_role(label_selector=sel).items,
        "ClusterRoleBinding": rbac.list_cluster_role_binding(label_selector=sel).items,
        "Role": rbac.list_namespaced_role(namespace, label_selector=sel).items,
        "RoleBinding": rbac.list_namespaced_role_binding(namespace, label_selector=sel).items,
        "ValidatingAdmissionPolicy": client.AdmissionregistrationV1Api(api).list_validating_admission_policy(
            label_selector=sel).items,
        "ValidatingAdmissionPolicyBinding": client.AdmissionregistrationV1Api(
            api).list_validating_admission_policy_binding(label_selector=sel).items,
    }
    out = {kind: sorted(o.metadata.name for o in objs) for kind, objs in found.items()}
    custom = client.CustomObjectsApi(api)
    for kind, plural in (("ServiceMonitor", "servicemonitors"), ("PodMonitor", "podmonitors"),
                         ("PrometheusRule", "prometheusrules")):
        try:
            items = custom.list_namespaced_custom_object("monitoring.coreos.com", "v1", namespace, plural,
                                                         label_selector=sel)["items"]
        except ApiException as e:
            if e.status != 404:   # the Prometheus Operator's CRDs are not installed
                raise
            items = []
        out[kind] = sorted(o["metadata"]["name"] for o in items)
    return {k: v for k, v in out.items() if v}


def installed_crd(api: client.ApiClient) -> dict[str, Any] | None:
    try:
        return client.ApiextensionsV1Api(api).read_custom_resource_definition(CRD_NAME).to_dict()
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def chart_crd() -> dict[str, Any]:
    (path,) = (CHART / "crds").glob("*.yaml")
    return yaml.safe_load(path.read_text())


def assert_crd_is_the_charts(api: client.ApiClient) -> None:
    """The served CRD is the chart's: same group, names, scope and versions (schemas, printer columns,
    subresources), compared after a round trip through the API server's own defaulting."""
    got = installed_crd(api)
    assert got, f"CRD {CRD_NAME} is not installed"
    want = chart_crd()["spec"]
    spec = client.ApiClient().sanitize_for_serialization(
        client.ApiextensionsV1Api(api).read_custom_resource_definition(CRD_NAME).spec)
    assert spec["group"] == want["group"] and spec["scope"] == want["scope"]
    assert spec["names"]["kind"] == want["names"]["kind"] and spec["names"]["plural"] == want["names"]["plural"]
    assert [v["name"] for v in spec["versions"]] == [v["name"] for v in want["versions"]]
    for served, ours in zip(spec["versions"], want["versions"]):
        assert served["schema"]["openAPIV3Schema"] == ours["schema"]["openAPIV3Schema"], served["name"]
        assert served.get("additionalPrinterColumns") == ours.get("additionalPrinterColumns"), served["name"]
        assert served.get("subresources") == ours.get("subresources"), served["name"]


def wait_crd_established(api: client.ApiClient, timeout: float = 300) -> None:
    def established():
        crd = installed_crd(api)
        return crd and any(c["type"] == "Established" and c["status"] == "True"
                           for c in (crd.get("status") or {}).get("conditions") or [])
    wait_for(established, timeout, f"CRD {CRD_NAME} Established", interval=0.5)


def delete_crd_if_unused(api: client.ApiClient, timeout: float = 120) -> bool:
    """Delete the DisaggDeployment CRD when it exists and no DisaggDeployment does (so that `helm install`
    creates it, as on a fresh cluster); True when it was deleted."""
    if not installed_crd(api):
        return False
    if client.CustomObjectsApi(api).list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]:
        return False
    client.ApiextensionsV1Api(api).delete_custom_resource_definition(CRD_NAME)
    wait_for(lambda: installed_crd(api) is None, timeout, f"CRD {CRD_NAME} deleted", interval=0.5)
    return True


def assert_secure_operator_pod(pod_spec: client.V1PodSpec) -> None:
    """The chart's security defaults on the operator's (or the planner's) pod."""
    psc = pod_spec.security_context
    assert psc.run_as_non_root is True and psc.run_as_user and psc.run_as_user != 0, psc
    assert psc.seccomp_profile.type == "RuntimeDefault", psc
    for c in pod_spec.containers:
        sc = c.security_context
        assert sc.read_only_root_filesystem is True and sc.allow_privilege_escalation is False, (c.name, sc)
        assert sc.capabilities.drop == ["ALL"] and not sc.capabilities.add, (c.name, sc)
        assert sc.run_as_non_root is True and sc.seccomp_profile.type == "RuntimeDefault", (c.name, sc)
        assert c.resources.limits.get("memory") and c.resources.requests.get("cpu"), (c.name, c.resources)


def wait_deployment_available(api: client.ApiClient, namespace: str, name: str, timeout: float = 300):
    apps = client.AppsV1Api(api)

    def available():
        d = apps.read_namespaced_deployment(name, namespace)
        ok = any(c.type == "Available" and c.status == "True" for c in d.status.conditions or [])
        return d if ok and (d.status.ready_replicas or 0) >= (d.spec.replicas or 0) else None
    return wait_for(available, timeout, f"Deployment {namespace}/{name} Available", interval=1)


# ---------------------------------------------------------------- DisaggDeployments

def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def apply(provider: Provider, namespace: str, manifest: dict[str, Any]) -> subprocess.CompletedProcess:
    """`kubectl apply --server-side --validate=strict`, as a user would; refuses warnings."""
    out = provider.kubectl("apply", "--server-side", "--validate=strict", "-n", namespace, "-f", "-",
                           input=yaml.safe_dump(manifest), check=False)
    assert out.returncode == 0, out.stderr
    assert "warning" not in out.stderr.lower(), out.stderr
    return out


def is_ready(pod: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def worker_pods(dd: DD) -> list[client.V1Pod]:
    return [p for role in ROLES for p in dd.pods(role)]


def nodes_of(api: client.ApiClient, pods: list[client.V1Pod]) -> dict[str, client.V1Node]:
    core = client.CoreV1Api(api)
    return {p.metadata.name: core.read_node(p.spec.node_name) for p in pods}


def assert_on_gpu_nodes(api: client.ApiClient, pods: list[client.V1Pod]) -> None:
    """Every worker pod is bound to a node advertising at least the GPUs it asks for."""
    assert pods
    for name, node in nodes_of(api, pods).items():
        pod = next(p for p in pods if p.metadata.name == name)
        wanted = int(pod.spec.containers[0].resources.limits[GPU])
        have = int((node.status.allocatable or {}).get(GPU, "0"))
        assert have >= wanted > 0, f"{name} on {node.metadata.name}: wants {wanted} GPUs, node has {have}"


def cliques(api: client.ApiClient, pods: list[client.V1Pod]) -> set[str]:
    return {n.metadata.labels.get(CLIQUE_LABEL, "") for n in nodes_of(api, pods).values()}


def spec_replicas(dd: DD) -> dict[str, int]:
    spec = dd.get()["spec"]
    return {role: spec.get(role, {}).get("replicas", 1) for role in (*ROLES, "router")}


def wait_ready(dd: DD, timeout: float = 180) -> dict[str, Any]:
    """Phase Ready at the current generation, with every role's summary `desired/desired` and as many
    ready pods as the spec asks for."""
    def ready():
        obj = dd.get()
        status = obj.get("status") or {}
        if status.get("phase") != "Ready" or status.get("observedGeneration") != obj["metadata"]["generation"]:
            return None
        want = spec_replicas(dd)
        for role, n in want.items():
            s = status.get(role) or {}
            if (s.get("desired"), s.get("ready"), s.get("summary")) != (n, n, f"{n}/{n}"):
                return None
        if any(len([p for p in dd.pods(r) if is_ready(p)]) != want[r] for r in ROLES):
            return None
        return status
    return wait_for(ready, timeout, f"{dd.name} Ready with every role at its replicas (status: {dd.status()})",
                    interval=0.5)


def assert_gang_scheduled(dd: DD) -> dict[str, Any]:
    cond = dd.condition("GangScheduled")
    assert cond and cond["status"] == "True" and cond["reason"] == "GangPlaced", dd.status()
    return cond


def assert_conditions_healthy(dd: DD) -> None:
    conds = {c["type"]: c for c in dd.status()["conditions"]}
    assert conds["Ready"]["status"] == "True", conds
    assert conds["Degraded"]["status"] == "False", conds
    gen = dd.get()["metadata"]["generation"]
    assert all(c.get("observedGeneration", gen) == gen for c in conds.values()), conds


def scale(dd: DD, role: str, replicas: int, timeout: float = 180) -> dict[str, Any]:
    dd.patch_spec({role: {"replicas": replicas}})
    status = wait_ready(dd, timeout)
    assert status[role]["summary"] == f"{replicas}/{replicas}" and len(dd.pods(role)) == replicas, status
    return status


def rollout(dd: DD, patch: dict[str, Any], rolled: Callable[[client.V1Pod], bool], timeout: float = 240) -> bool:
    """Apply `patch` to the spec and watch until every worker pod satisfies `rolled` and the deployment is
    Ready again; fail the moment a role has no ready pod. True when Progressing was seen."""
    since = dd.patch_spec(patch)["metadata"]["resourceVersion"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for role in ROLES:
            assert [p for p in dd.pods(role) if is_ready(p)], f"no ready {role} pod during the rollout"
        obj = dd.get()
        status = obj.get("status") or {}
        pods = worker_pods(dd)
        want = spec_replicas(dd)
        if (status.get("phase") == "Ready" and status.get("observedGeneration") == obj["metadata"]["generation"]
                and all(status[r]["updated"] == want[r] for r in ROLES)
                and len(pods) == want["prefill"] + want["decode"] and all(rolled(p) for p in pods)):
            # every status written since the patch, not only those a poll happened to read
            return any(c["type"] == "Progressing" and c["status"] == "True"
                       for o in dd.history(since, obj["metadata"]["resourceVersion"])
                       for c in (o.get("status") or {}).get("conditions") or [])
        time.sleep(0.1)
    raise AssertionError(f"rollout did not finish in {timeout:.0f}s: {dd.status()}")


def children(api: client.ApiClient, namespace: str, name: str) -> dict[str, list[str]]:
    """What the operator made for DisaggDeployment `name` and what those made (labelled with it)."""
    sel = f"{LABEL_DEPLOYMENT}={name}"
    core, apps, rbac = client.CoreV1Api(api), client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    out = {
        "Deployment": apps.list_namespaced_deployment(namespace, label_selector=sel).items,
        "ReplicaSet": apps.list_namespaced_replica_set(namespace, label_selector=sel).items,
        "Pod": core.list_namespaced_pod(namespace, label_selector=sel).items,
        "Service": core.list_namespaced_service(namespace, label_selector=sel).items,
        "ServiceAccount": core.list_namespaced_service_account(namespace, label_selector=sel).items,
        "Role": rbac.list_namespaced_role(namespace, label_selector=sel).items,
        "RoleBinding": rbac.list_namespaced_role_binding(namespace, label_selector=sel).items,
    }
    found = {k: sorted(o.metadata.name for o in v) for k, v in out.items()}
    custom = client.CustomObjectsApi(api)
    for kind, version, plural in (("Workload", "v1beta1", "workloads"), ("PodGroup", "v1beta1", "podgroups"),
                                  ("CompositePodGroup", "v1alpha3", "compositepodgroups")):
        try:
            items = custom.list_namespaced_custom_object("scheduling.k8s.io", version, namespace, plural)["items"]
        except ApiException as e:
            if e.status != 404:
                raise
            items = []
        found[kind] = sorted(o["metadata"]["name"] for o in items
                             if any(r.get("kind") == "DisaggDeployment" and r.get("name") == name
                                    for r in o["metadata"].get("ownerReferences") or []))
    return {k: v for k, v in found.items() if v}


def delete(dd: DD, api: client.ApiClient, timeout: float = 180) -> None:
    """Delete the DisaggDeployment; everything it owned goes with it."""
    assert children(api, dd.ns, dd.name), "nothing to delete"
    dd.custom.delete_namespaced_custom_object(GROUP, VERSION, dd.ns, PLURAL, dd.name)

    def gone():
        try:
            dd.get()
            return None
        except ApiException as e:
            if e.status != 404:
                raise
        return not children(api, dd.ns, dd.name)
    wait_for(gone, timeout, f"{dd.name} and its children deleted (left: {children(api, dd.ns, dd.name)})",
             interval=0.5)


def roles_of(pods: list[client.V1Pod]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in pods:
        out[p.metadata.labels[LABEL_ROLE]] = out.get(p.metadata.labels[LABEL_ROLE], 0) + 1
    return out



# ---------------------------------------------------------------- dashboards

OPERATOR_ROW = "Operator"


def dashboard_rows(dashboard: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Row title -> the panels with queries under it (panels before the first row under "")."""
    rows: dict[str, list[dict[str, Any]]] = {}
    current = ""
    for p in dashboard["panels"]:
        if p.get("type") == "row":
            current = p["title"]
            rows.setdefault(current, []).extend(q for q in p.get("panels", []) if q.get("targets"))
        elif p.get("targets"):
            rows.setdefault(current, []).append(p)
    return rows
