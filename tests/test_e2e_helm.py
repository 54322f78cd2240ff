"""End to end from `helm install` to `helm uninstall`, on the provider DISAGG_E2E_PROVIDER names
(e2e/providers.py): `local` (default; the local control plane with kwok GPU pools, the chart installed
with operator.enabled=false and the operator run from the source tree as the chart's Deployment runs it,
`python -m` with that container's arguments and environment, under a token of the chart's own
ServiceAccount) or `kind` (e2e/kind/: the chart's operator image in a kind cluster).

The chart installs the CRD, ServiceAccount, RBAC, monitors (the minimal monitoring CRDs make the
Prometheus Operator's API present) and dashboards; then every example is applied and checked for
placement, gang, status and deletion (and no failed operator handler under the chart's role), one is
scaled and rolled out, and `helm uninstall` removes everything the chart made but the CRD. On `local`, a
second release with the operator enabled (its pod run by kwok) shows the operator Deployment becoming
Available with the chart's security defaults, and a real Prometheus scrapes the local operator as
the chart's ServiceMonitor would, with the chart's rules: the overview dashboard's Operator row is
queried on it and a gang that cannot be placed makes DisaggGangNotScheduled pending.

CRDs and Helm: Helm creates the files of a chart's crds/ only when the CRD does not exist yet (it never
adopts, upgrades or deletes them, and does not list them in the release). On `local`, the session's
cluster may already hold the CRD from crds/ (other modules' `crd_installed`): the module deletes it
first when no DisaggDeployment exists, so that `helm install` creates it, and either way checks that
the served CRD is the chart's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import time

import pytest
import yaml
from kubernetes import client

from disagg.api import contract
from disagg.api import metrics as m
from disagg.api.names import LABEL_ROLE
from disagg.e2e import suite
from disagg.e2e.prometheus import LocalPrometheus
from disagg.e2e.providers import CHART, REPO, make_provider
from disagg.e2e.testing import DD, dd_manifest, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]

RELEASE, RELEASE_NS = "e2e", "disagg-e2e"
OPERATOR_RELEASE, OPERATOR_NS = "e2e-operator", "disagg-e2e-operator"
EXAMPLES = ["small.yaml", "llama-70b-tp.yaml", "with-planner.yaml"]


@pytest.fixture(scope="module")
def provider(request):
    return make_provider(lambda: request.getfixturevalue("cluster"))


@pytest.fixture(scope="module")
def kube(provider):
    api = provider.api_client()
    yield api
    api.close()


@pytest.fixture(scope="module")
def monitoring_api(provider):
    """The Prometheus Operator's API, so that the chart renders its monitors: the minimal CRDs of
    e2e/crds/monitoring where the cluster has none."""
    have = provider.kubectl("get", "crd", "servicemonitors.monitoring.coreos.com", check=False)
    if have.returncode != 0:
        provider.kubectl("apply", "--server-side", "-f", str(REPO / "e2e" / "crds" / "monitoring"))
    provider.kubectl("wait", "--for=condition=Established", "--timeout=300s",
                     *(f"crd/{p}.monitoring.coreos.com" for p in ("servicemonitors", "podmonitors", "prometheusrules")))
    return True


def manifest_objects(provider, release: str, namespace: str) -> dict[str, list[str]]:
    """Kind -> names of what Helm tracks in the release (its manifest)."""
    text = provider.helm("get", "manifest", release, "--namespace", namespace).stdout
    out: dict[str, list[str]] = {}
    for doc in yaml.safe_load_all(text):
        if doc:
            out.setdefault(doc["kind"], []).append(doc["metadata"]["name"])
    return {k: sorted(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def release(provider, kube, monitoring_api):
    """The suite's Helm release, installed with the provider's values."""
    if provider.name == "local":
        suite.delete_crd_if_unused(kube)
    crd_absent = suite.installed_crd(kube) is None
    try:
        suite.helm_install(provider, RELEASE, RELEASE_NS, *provider.chart_values())
        suite.wait_crd_established(kube)
        yield {"crd_created_by_helm": crd_absent}
    finally:
        suite.helm_uninstall(provider, RELEASE, RELEASE_NS, check=False)
        provider.kubectl("delete", "namespace", RELEASE_NS, "--ignore-not-found", "--wait=false", check=False)
        if provider.name == "local" and suite.installed_crd(kube) is None:   # leave the session its CRD
            provider.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
            suite.wait_crd_established(kube)


class Operator:
    """The running operator: on `local` its process (the chart's arguments and environment) and the
    Prometheus scraping it."""

    def __init__(self):
        self.stack = contextlib.ExitStack()
        self.started = time.time()
        self.process = None                              # the chart's operator as a local process (local)
        self.prometheus: LocalPrometheus | None = None   # scraping it (local)

    def failures(self) -> list[str]:
        """kopf's handler failures in the local operator's log."""
        log = self.process.log_path.read_text(errors="replace")
        return [line[:500] for line in log.splitlines() if HANDLER_FAILED.search(line)]

    def stop(self):
        self.stack.close()


@pytest.fixture(scope="module")
def operator(provider, kube, release, tmp_path_factory):
    """The operator serving the release: a local process run as the chart's Deployment runs it, under a
    token of the chart's ServiceAccount (local), or the chart's own operator pod (kind)."""
    op = Operator()
    if provider.operator_in_process:
        from disagg.e2e.operator_fixture import chart_operator, token_kubeconfig

        # the operator's (the planner's is <account>-planner)
        account, _ = suite.release_objects(kube, RELEASE, RELEASE_NS)["ServiceAccount"]
        state = tmp_path_factory.mktemp("e2e-operator")
        kubeconfig = token_kubeconfig(provider.kubeconfig, kube, RELEASE_NS, account, state / "kubeconfig")
        op.process = op.stack.enter_context(chart_operator(provider.helm, CHART, RELEASE, RELEASE_NS, kubeconfig,
                                                           state))
        op.prometheus = operator_prometheus(provider, tmp_path_factory.mktemp("e2e-prometheus"),
                                            op.process.metrics_port)
        op.stack.callback(op.prometheus.stop)
    else:
        for name in suite.release_objects(kube, RELEASE, RELEASE_NS)["Deployment"]:   # operator, planner
            suite.wait_deployment_available(kube, RELEASE_NS, name)
    yield op
    op.stop()


def operator_prometheus(provider, state_dir, port: int) -> LocalPrometheus:
    """A real Prometheus scraping the local operator's /metrics (on `port`) as the chart's ServiceMonitor
    has the Prometheus Operator scrape the operator pod (its `metrics` endpoint: path, honorLabels, the
    target labels the Prometheus Operator adds), and evaluating the chart's PrometheusRule every second."""
    out = provider.helm("template", RELEASE, str(CHART), "--namespace", RELEASE_NS,
                        "--api-versions", "monitoring.coreos.com/v1")
    objs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (monitor,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    endpoint = next(e for e in monitor["spec"]["endpoints"] if e["port"] == "metrics")
    service = monitor["metadata"]["name"] + "-metrics"
    job = {"job_name": f"serviceMonitor/{RELEASE_NS}/{monitor['metadata']['name']}/0",
           "honor_labels": endpoint["honorLabels"], "metrics_path": endpoint["path"],
           "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": {
               "namespace": RELEASE_NS, "service": service, "pod": f"{monitor['metadata']['name']}-0",
               "endpoint": "metrics"}}]}
    groups = rule["spec"]["groups"]
    for g in groups:
        g["interval"] = "1s"
    return LocalPrometheus(state_dir, [], scrape_configs=[job], rule_groups=groups).start()


@pytest.fixture
def ns(request, provider, kube):
    """A fresh namespace for one test, deleted (with its pods gone) afterwards."""
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:6]
    name = re.sub(r"[^a-z0-9-]", "-", f"e2e-{request.node.name.lower()}"[:40]).strip("-") + f"-{digest}"
    core = client.CoreV1Api(kube)
    core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: any(sa.metadata.name == "default" for sa in core.list_namespaced_service_account(name).items),
             60, f"default ServiceAccount in {name}")
    provider.prepare_namespace(kube, name)
    yield name
    core.delete_namespace(name)
    wait_for(lambda: not core.list_namespaced_pod(name).items, 180, f"pods of namespace {name} to be deleted")
    provider.cleanup_namespace(kube, name)


# ---------------------------------------------------------------- the release


def test_chart_installs_crd_rbac_monitors_and_dashboards(provider, kube, release):
    objs = suite.release_objects(kube, RELEASE, RELEASE_NS)
    assert objs == manifest_objects(provider, RELEASE, RELEASE_NS), \
        "live objects labelled with the release differ from Helm's manifest"
    full = f"{RELEASE}-disagg"
    assert objs["ServiceAccount"] == [full, f"{full}-planner"]
    assert objs["ClusterRole"] == [f"{full}-edit", f"{full}-operator", f"{full}-operator-cluster", f"{full}-planner",
                                   f"{full}-view"]
    assert objs["ClusterRoleBinding"] == [f"{full}-operator", f"{full}-operator-cluster", f"{full}-planner"]
    assert objs["ValidatingAdmissionPolicy"] == objs["ValidatingAdmissionPolicyBinding"] == [
        f"{full}-operator-writes", f"{full}-planner-writes", f"{full}-prometheus-endpoints"]
    assert objs["ConfigMap"] == sorted([f"{full}-dashboard-{d}" for d in
                                        ("overview", "planner", "prefill-decode", "router")]
                                       + ([] if provider.operator_in_process else [f"{full}-planner-prometheus"]))
    assert objs["PodMonitor"] == [f"{full}-routers", f"{full}-workers"]
    assert objs["PrometheusRule"] == [full]
    if provider.operator_in_process:   # operator.enabled=false: no operator pod, its Service or monitor
        assert not {"Deployment", "Service", "ServiceMonitor"} & objs.keys(), objs
    else:
        assert objs["Deployment"] == [f"{full}-operator", f"{full}-planner"]
        assert objs["ServiceMonitor"] == [f"{full}-operator"]
    binding = client.RbacAuthorizationV1Api(kube).read_cluster_role_binding(f"{full}-operator")
    assert [(s.kind, s.namespace, s.name) for s in binding.subjects] == [
        ("ServiceAccount", RELEASE_NS, full)]
    # CRDs are not part of the release; the served one is the chart's
    assert "CustomResourceDefinition" not in manifest_objects(provider, RELEASE, RELEASE_NS)
    suite.assert_crd_is_the_charts(kube)
    if release["crd_created_by_helm"]:
        crd = suite.installed_crd(kube)
        managers = {f["manager"] for f in crd["metadata"]["managed_fields"] or []}
        assert "helm" in managers, managers


def test_operator_pod_reaches_available_with_secure_defaults(provider, kube, release, monitoring_api):
    """With the operator enabled (default values) the operator Deployment becomes Available. On `local`,
    a second release into its own namespace; kwok runs its pod (no image is pulled), then it is
    uninstalled. On `kind`, the suite's own release, whose operator really runs."""
    if provider.operator_in_process:
        suite.helm_install(provider, OPERATOR_RELEASE, OPERATOR_NS)
        namespace, release_name = OPERATOR_NS, OPERATOR_RELEASE
    else:
        namespace, release_name = RELEASE_NS, RELEASE
    try:
        objs = suite.release_objects(kube, release_name, namespace)
        assert objs == manifest_objects(provider, release_name, namespace)
        name, planner = objs["Deployment"]
        assert planner == name.removesuffix("-operator") + "-planner"
        assert objs["ServiceMonitor"] == [name] and objs["Service"] == [f"{name}-metrics", f"{planner}-metrics"]
        # the planner: its own pod, ServiceAccount and security defaults
        planner_spec = suite.wait_deployment_available(kube, namespace, planner).spec.template.spec
        assert planner_spec.service_account_name == objs["ServiceAccount"][1]
        assert [c.name for c in planner_spec.containers] == ["planner"]
        suite.assert_secure_operator_pod(planner_spec)
        dep = suite.wait_deployment_available(kube, namespace, name)
        pod_spec = dep.spec.template.spec
        assert pod_spec.service_account_name == objs["ServiceAccount"][0]
        assert [c.name for c in pod_spec.containers] == ["operator"]
        suite.assert_secure_operator_pod(pod_spec)
        (pod,) = [p for p in client.CoreV1Api(kube).list_namespaced_pod(
            namespace, label_selector=f"app.kubernetes.io/instance={release_name},app.kubernetes.io/component=operator"
            ).items if not p.metadata.deletion_timestamp]
        assert suite.is_ready(pod) and pod.status.phase == "Running"
        suite.assert_secure_operator_pod(pod.spec)
        # the metrics Service selects the operator pod
        endpoints = wait_for(lambda: [a for s in client.DiscoveryV1Api(kube).list_namespaced_endpoint_slice(
            namespace, label_selector=f"kubernetes.io/service-name={name}-metrics").items
            for e in s.endpoints or [] for a in e.addresses], 60, "the metrics Service's endpoints")
        assert endpoints == [pod.status.pod_ip]
    finally:
        if provider.operator_in_process:
            suite.helm_uninstall(provider, OPERATOR_RELEASE, OPERATOR_NS)
            assert suite.release_objects(kube, OPERATOR_RELEASE, OPERATOR_NS) == {}
            provider.kubectl("delete", "namespace", OPERATOR_NS, "--ignore-not-found", "--wait=false", check=False)


# ---------------------------------------------------------------- DisaggDeployments


HANDLER_FAILED = re.compile(r"Handler '[\w/.]+' failed")


def handler_failures(provider, kube, operator) -> list[str]:
    """kopf's "Handler '...' failed" lines so far: logged by the local operator process (local) or by the
    operator container (kind). A reconcile that fails on a 403 under the chart's role shows up here."""
    if provider.operator_in_process:
        return operator.failures()
    name, _ = suite.release_objects(kube, RELEASE, RELEASE_NS)["Deployment"]   # the operator's; the planner's
    logs = provider.kubectl("logs", f"deployment/{name}", "-c", "operator", "-n", RELEASE_NS).stdout
    return [line for line in logs.splitlines() if HANDLER_FAILED.search(line)]


@pytest.mark.parametrize("name", EXAMPLES, ids=[e.removesuffix(".yaml") for e in EXAMPLES])
def test_example_is_placed_as_a_gang_becomes_ready_and_deletes(provider, kube, operator, ns, name):
    failures = len(handler_failures(provider, kube, operator))
    manifest = provider.adapt(suite.example(name))
    suite.apply(provider, ns, manifest)
    dd = DD(kube, ns, manifest["metadata"]["name"])
    status = suite.wait_ready(dd, timeout=240)
    suite.assert_gang_scheduled(dd)
    suite.assert_conditions_healthy(dd)
    assert status["endpoint"] == f"http://{dd.name}.{ns}.svc:80/v1"
    want = suite.spec_replicas(dd)
    pods = suite.worker_pods(dd)
    assert suite.roles_of(pods) == {"prefill": want["prefill"], "decode": want["decode"]}
    suite.assert_on_gpu_nodes(kube, pods)
    for p in pods:   # each worker asks for its tensor-parallel size in GPUs
        role_spec = manifest["spec"][p.metadata.labels[LABEL_ROLE]]
        assert p.spec.containers[0].resources.limits[suite.GPU] == str(role_spec.get("tensorParallelSize", 1))
    topology = manifest["spec"]["scheduling"].get("topology") or {}
    if topology.get("mode") == "required":
        assert len(suite.cliques(kube, pods)) == 1, f"{dd.name} spread over {suite.cliques(kube, pods)}"
    routers = dd.pods("router")   # no GPU for a router (it only prefers CPU nodes: not asserted)
    assert len(routers) == want["router"] and all(suite.is_ready(r) for r in routers)
    assert not any(suite.GPU in (c.resources.limits or {}) for r in routers for c in r.spec.containers)
    if name == "llama-70b-tp.yaml":
        # TP 8 decode replicas take a whole 8-GPU node each; all 24 GPUs inside one NVLink domain
        decode_nodes = [p.spec.node_name for p in dd.pods("decode")]
        assert len(set(decode_nodes)) == len(decode_nodes) == 2
        assert sum(int(p.spec.containers[0].resources.limits[suite.GPU]) for p in pods) == 24
    suite.delete(dd, kube)
    # under the chart's role every handler went through (a 403 would fail one)
    assert handler_failures(provider, kube, operator)[failures:] == []


def test_scale_up_and_down_and_status_follows(provider, kube, operator, ns):
    manifest = provider.adapt(suite.example("small.yaml"))
    suite.apply(provider, ns, manifest)
    dd = DD(kube, ns, manifest["metadata"]["name"])
    suite.wait_ready(dd)
    suite.scale(dd, "decode", 4)
    suite.scale(dd, "prefill", 2)
    pods = suite.worker_pods(dd)
    assert suite.roles_of(pods) == {"prefill": 2, "decode": 4}
    assert len(suite.cliques(kube, pods)) == 1    # later replicas join the gang's domain
    suite.scale(dd, "decode", 1)
    suite.scale(dd, "prefill", 1)
    suite.assert_gang_scheduled(dd)


def test_rollout_never_leaves_a_role_without_a_ready_pod(provider, kube, operator, ns):
    manifest = provider.adapt(suite.example("small.yaml"))
    suite.apply(provider, ns, manifest)
    dd = DD(kube, ns, manifest["metadata"]["name"])
    suite.wait_ready(dd)
    image = dd.get()["spec"]["engine"]["image"]
    new_image = provider.next_worker_image(image)
    args = [*manifest["spec"]["engine"]["args"], "--max-num-seqs", "64"]

    def rolled(pod):
        c = pod.spec.containers[0]
        return c.image == new_image and c.args[-2:] == ["--max-num-seqs", "64"]
    saw_progress = suite.rollout(dd, {"engine": {"image": new_image, "args": args}}, rolled)
    assert saw_progress, "status never showed the rollout in progress"
    suite.assert_conditions_healthy(dd)
    suite.assert_gang_scheduled(dd)


# ---------------------------------------------------------------- serving, on a provider whose pods run images


def test_the_tiny_model_on_the_cpu_worker_image_answers_the_openai_client(provider, kube, operator, request):
    """kind: a DisaggDeployment of the tiny model whose prefill and decode pods run the CPU worker image
    (vLLM's CPU build, NIXL) on one node and whose router pod runs the control-plane image on the CPU pool,
    as the chart's operator pod renders them; the official client's chat and completions, streamed and not,
    all on the remote_prefill path with NIXL bytes moved, through a port-forward to the router pod."""
    from disagg.e2e import realnode
    from disagg.e2e.providers import Unsupported

    try:
        manifest = provider.tiny_model_deployment("tiny")
    except Unsupported as e:
        pytest.skip(f"{e}; tests/test_e2e_realnode.py serves the same on the local cluster's real node")
    ns = request.getfixturevalue("ns")   # after the skip: no namespace made for nothing
    suite.apply(provider, ns, manifest)
    dd = DD(kube, ns, "tiny")
    try:
        suite.wait_ready(dd, timeout=900)
    except AssertionError as e:    # the pods and their logs go with the namespace
        raise AssertionError(realnode.pod_logs(kube, ns, "")) from e
    assert {p.spec.containers[0].image for p in suite.worker_pods(dd)} == {provider.cpu_worker_image}
    (router,) = dd.pods("router")
    (decode,) = dd.pods("decode")
    metrics_ports = [p.container_port for c in router.spec.containers for p in c.ports or []
                     if re.fullmatch(contract.ROUTER_METRICS_PORT_NAMES, p.name or "")]
    with provider.port_forward(ns, router.metadata.name, contract.HTTP_PORT, *metrics_ports) as to_router, \
            provider.port_forward(ns, decode.metadata.name, contract.WORKER_METRICS_PORT) as to_decode:
        url = f"http://127.0.0.1:{to_router[contract.HTTP_PORT]}/v1"
        # the router probes the workers it discovers; until it counts a healthy prefill it prefills locally
        wait_for(lambda: realnode.serving(url, [f"http://127.0.0.1:{to_router[p]}" for p in metrics_ports]), 300,
                 "the router serving with its prefill and decode workers", interval=1)
        realnode.served_on_the_remote_prefill_path(
            url, f"http://127.0.0.1:{to_decode[contract.WORKER_METRICS_PORT]}")
    suite.delete(dd, kube)


# ---------------------------------------------------------------- the operator's metrics


def test_operator_panels_and_gang_alert_on_the_real_operators_metrics(provider, kube, operator, ns):
    """The overview's Operator row and the DisaggGangNotScheduled alert against a real Prometheus that
    scraped this module's operator (everything above happened in front of it): a gang that cannot be
    placed makes the alert pending (its `for` is 10 minutes), a hand edit is reverted, and every panel
    target has data."""
    if not operator.prometheus:
        pytest.skip("the operator runs in the cluster (kind): its metrics are not scraped by this process")
    prom = operator.prometheus
    # a gang that cannot be placed: no node has that GPU
    stuck = dd_manifest("stuck", decode={"replicas": 1, "nodeSelector": {"nvidia.com/gpu.product": "no-such-gpu"}})
    dd = DD(kube, ns, stuck)
    dd.wait_condition("GangScheduled", "False", "InsufficientCapacity", timeout=120)

    def pending():
        alerts = prom.api("alerts").get("data", {}).get("alerts", [])
        return [a for a in alerts if a["labels"]["alertname"] == "DisaggGangNotScheduled"
                and a["labels"].get("namespace") == ns]
    # generous: under CI load a rule evaluation and the scrapes before it can lag well past their intervals
    (alert,) = wait_for(pending, 240, "DisaggGangNotScheduled pending", interval=0.5)
    assert alert["state"] == "pending" and alert["labels"]["deployment"] == "stuck", alert
    # a hand edit of a child, reverted (the drift counter)
    manifest = provider.adapt(suite.example("small.yaml"))
    suite.apply(provider, ns, manifest)
    small = DD(kube, ns, manifest["metadata"]["name"])
    suite.wait_ready(small)
    child = f"{small.name}-decode"
    small.apps.patch_namespaced_deployment_scale(child, ns, {"spec": {"replicas": 5}}, field_manager="kubectl-scale")
    wait_for(lambda: small.apps.read_namespaced_deployment(child, ns).spec.replicas == 2, 120, "replicas restored")
    wait_for(lambda: prom.api("query", query=f"sum({m.OPERATOR_DRIFT_REVERTS})")["data"]["result"], 120,
             "the revert scraped", interval=0.5)
    variables = {"namespace": ns, "deployment": ".*", "__rate_interval": "1m"}
    dashboard = json.loads((CHART / "dashboards" / "overview.json").read_text())
    row = suite.dashboard_rows(dashboard)[suite.OPERATOR_ROW]
    assert len(row) >= 4
    # every panel with data: rates need a few scrapes after the last change, so wait for them (the last
    # failures are what a timeout reports), never for a fixed time
    failures: list[str] = []
    try:
        wait_for(lambda: not _operator_row_failures(prom, row, variables, operator.started, failures), 120,
                 "every operator panel to have data", interval=1)
    except AssertionError as e:
        raise AssertionError(f"{e}:\n" + "\n".join(failures)) from None
    # the conditions panel shows the stuck gang with its reason
    r = prom.api("query", query=f'{m.OPERATOR_CONDITION}{{namespace="{ns}", deployment="stuck", '
                                f'type="GangScheduled"}}')
    assert [s["metric"]["reason"] for s in r["data"]["result"]] == ["InsufficientCapacity"], r


def _operator_row_failures(prom, row: list[dict], variables: dict[str, str], start: float,
                           failures: list[str]) -> list[str]:
    """The panels of the operator row whose queries error or return no finite value since ``start`` (also
    left in ``failures``)."""
    failures.clear()
    checked = 0
    for panel in row:
        for t in panel["targets"]:
            expr = t["expr"]
            for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
                expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
            assert "$" not in expr, expr
            r = prom.api("query_range", query=expr, start=start, end=time.time(), step="1s")
            checked += 1
            values = [float(v) for series in r.get("data", {}).get("result", []) for _, v in series["values"]]
            if r.get("status") != "success":
                failures.append(f"{panel['title']} [{t['refId']}]: query error {r.get('error')}: {expr}")
            elif not any(math.isfinite(v) for v in values):
                failures.append(f"{panel['title']} [{t['refId']}]: no data: {expr}")
    assert checked >= 6, checked
    return failures


# ---------------------------------------------------------------- uninstall


def test_helm_uninstall_removes_everything_but_the_crd(provider, kube, release, operator):
    operator.stop()   # the local operator loses its role with the release
    assert suite.release_objects(kube, RELEASE, RELEASE_NS)
    suite.helm_uninstall(provider, RELEASE, RELEASE_NS)
    wait_for(lambda: suite.release_objects(kube, RELEASE, RELEASE_NS) == {}, 120,
             "every object of the release deleted", interval=0.5)
    # nor does Helm keep the release's record
    secrets = client.CoreV1Api(kube).list_namespaced_secret(RELEASE_NS, label_selector=f"owner=helm,name={RELEASE}")
    assert not secrets.items
    # the CRD stays (and with it every DisaggDeployment): Helm never deletes a chart's crds/
    suite.assert_crd_is_the_charts(kube)
