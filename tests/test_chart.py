"""The Helm chart (charts/disagg): lint, what renders with which values, RBAC equal to operator/rbac.yaml,
secure pod defaults, CRDs and dashboards in sync with their sources, metric names from
disagg.api.metrics, the alert rules checked and unit-tested by promtool, and the rendered objects and
the examples accepted by the local API server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from disagg.api import contract
from disagg.api import metrics as m

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "disagg"
MONITORING = "monitoring.coreos.com/v1"
MONITOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
# operator/rbac.yaml's rules for the optional gang backends: in the chart only when switched on
OPTIONAL_GROUPS = {"scheduling.x-k8s.io": "coscheduling", "scheduling.volcano.sh": "volcano"}


@pytest.fixture(scope="module")
def helm() -> Path:
    from disagg.e2e.localcluster import binaries

    return binaries() / "helm"


def render(helm: Path, *args: str, namespace: str = "disagg-system", release: str = "disagg") -> list[dict]:
    out = subprocess.run([str(helm), "template", release, str(CHART), "--namespace", namespace, *args],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def kinds(objs: list[dict]) -> list[str]:
    return sorted(o["kind"] for o in objs)


def one(objs: list[dict], kind: str, name_part: str = "") -> dict:
    found = [o for o in objs if o["kind"] == kind and name_part in o["metadata"]["name"]]
    assert len(found) == 1, f"{kind} *{name_part}*: {[o['metadata']['name'] for o in found]}"
    return found[0]


def source_roles() -> dict[str, list[dict]]:
    """operator/rbac.yaml: ClusterRole name -> rules."""
    return {d["metadata"]["name"]: d["rules"]
            for d in yaml.safe_load_all((REPO / "operator" / "rbac.yaml").read_text()) if d}


def operator_rules() -> list[dict]:
    return source_roles()["disagg-operator"]


def norm(rules: list[dict]) -> list[dict]:
    return [{k: list(r[k]) for k in ("apiGroups", "resources", "verbs")} for r in rules]


# ---------------------------------------------------------------- static checks


def test_helm_lint_is_clean(helm):
    for args in ([], ["--set", "operator.enabled=false"], ["--set", "gangBackends.volcano=true"],
                 ["--set", "inferencePool.installCRD=true"],
                 ["--set", "planner.enabled=false"],
                 ["--set", "operator.watchNamespaces={a,b}", "--set", "planner.defaultPrometheus=main", "--set-json",
                  'planner.prometheusEndpoints=[{"name": "main", "url": "https://p:9090", '
                  '"caSecret": {"name": "ca", "key": "ca.crt"}}]']):
        out = subprocess.run([str(helm), "lint", "--strict", str(CHART), *args], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        assert not re.search(r"\[(INFO|WARNING|ERROR)\]", out.stdout), out.stdout


def test_chart_crds_equal_crds_dir():
    ours = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*")}
    source = {p.name: p.read_bytes() for p in (REPO / "crds").glob("*")}
    assert ours == source, "charts/disagg/crds/ differs from crds/: cp crds/* charts/disagg/crds/"


def test_inference_pool_crd_is_generated_from_the_models_and_installed_only_when_asked(helm):
    """The InferencePool v1 CRD is a template generated from disagg/api/inferencepool.py (`disagg crds`),
    rendered only with inferencePool.installCRD=true (Helm's crds/ cannot be conditional), under the v1
    API's own names, with the chart's labels, kept on uninstall. (tests/test_operator_inferencepool.py applies it
    to the API server, with the pools the operator renders.)"""
    from disagg.api import crd

    for name, content in crd.render_chart_templates().items():
        assert (CHART / "templates" / name).read_text() == content, f"templates/{name} drifted: run `make crds`"
    assert "CustomResourceDefinition" not in kinds(render(helm))
    (ours,) = [o for o in render(helm, "--set", "inferencePool.installCRD=true", "--set", "commonLabels.team=ml")
               if o["kind"] == "CustomResourceDefinition"]
    generated = crd.inference_pool_crd()
    assert ours["metadata"]["name"] == "inferencepools.inference.networking.k8s.io"
    assert ours["spec"] == generated["spec"] and ours["spec"]["versions"][0]["name"] == "v1"
    assert ours["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert ours["metadata"]["labels"]["app.kubernetes.io/part-of"] == "disagg"
    assert ours["metadata"]["labels"]["team"] == "ml"


def test_dashboards_are_what_the_generator_writes():
    out = subprocess.run([sys.executable, str(CHART / "dashboards" / "generate.py"), "--check"],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr


def test_the_ttft_panel_asks_for_exemplars_and_grafana_gets_a_trace_data_source_they_link_to(helm):
    """The Overview's TTFT quantiles ask Grafana for exemplars; the chart's data sources (off by default) give
    Grafana the trace store at the configured URL, and a Prometheus whose exemplars' trace id label (the
    one the router writes) opens that trace store."""
    overview = json.loads((CHART / "dashboards" / "overview.json").read_text())
    (ttft,) = [p for p in overview["panels"] if p["title"] == "Time to first token"]
    quantiles = [t for t in ttft["targets"] if m.ROUTER_TTFT_SECONDS in t["expr"]]
    assert quantiles and all(t.get("exemplar") is True for t in quantiles)
    assert not [o for o in render(helm) if o["kind"] == "ConfigMap" and "datasources" in o["metadata"]["name"]]
    objs = render(helm, "--set", "monitoring.datasources.enabled=true",
                  "--set", "monitoring.datasources.traces.url=http://jaeger-query.monitoring:16686",
                  "--set", "monitoring.datasources.prometheusUrl=http://prometheus-operated.monitoring:9090")
    cm = one(objs, "ConfigMap", "grafana-datasources")
    assert cm["metadata"]["labels"]["grafana_datasource"] == "1"
    sources = {d["uid"]: d for d in yaml.safe_load(cm["data"]["disagg-datasources.yaml"])["datasources"]}
    traces, prom = sources["disagg-traces"], sources["disagg-prometheus"]
    assert (traces["type"], traces["url"]) == ("jaeger", "http://jaeger-query.monitoring:16686")
    assert (prom["type"], prom["url"]) == ("prometheus", "http://prometheus-operated.monitoring:9090")
    assert prom["jsonData"]["exemplarTraceIdDestinations"] == [{"name": m.EXEMPLAR_TRACE_ID,
                                                                 "datasourceUid": "disagg-traces"}]
    objs = render(helm, "--set", "monitoring.datasources.enabled=true", "--set", "monitoring.datasources.traces.type=tempo",
                  "--set", "monitoring.datasources.traces.url=http://tempo.monitoring:3200")
    (only,) = yaml.safe_load(one(objs, "ConfigMap", "grafana-datasources")["data"]["disagg-datasources.yaml"])[
        "datasources"]
    assert (only["type"], only["url"]) == ("tempo", "http://tempo.monitoring:3200")
    # switched on without a trace store: refused, naming the value
    out = subprocess.run([str(helm), "template", "x", str(CHART), "--set", "monitoring.datasources.enabled=true"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "monitoring.datasources.traces.url" in out.stderr, out.stderr


def test_values_schema_refuses_unknown_and_bad_values(helm):
    for bad, says in ((["--set", "operatr.enabled=false"], "operatr"),
                      (["--set", "monitoring.prometheusRule.slo.ttftSeconds=0.3"], "ttftSeconds"),
                      (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
                      (["--set", "inferencePool.installCRD=maybe"], "installCRD"),
                      (["--set", "monitoring.podMonitors.interval=soon"], "interval"),
                      (["--set", "monitoring.datasources.traces.type=zipkin"], "type"),
                      (["--set", "planner.otlpTracesEndpoint=collector:4317"], "otlpTracesEndpoint")):
        out = subprocess.run([str(helm), "template", "x", str(CHART), *bad], capture_output=True, text=True)
        assert out.returncode != 0 and says in out.stderr, (bad, out.stderr)


# ---------------------------------------------------------------- what renders


def test_defaults_render_no_monitors_without_the_prometheus_operator(helm):
    objs = render(helm)
    # operator and planner: a ServiceAccount, a Deployment and a metrics Service each; roles: the operator's
    # cluster-scoped one, its namespaced one and the planner's (bound cluster-wide: no watchNamespaces),
    # and the two aggregated user roles; the planner's Prometheus allowlist (a ConfigMap) and the admission
    # policy that refuses other names, and the policies on what the operator's and the planner's accounts write
    assert kinds(objs) == sorted(["ServiceAccount"] * 2 + ["ClusterRole"] * 5 + ["ClusterRoleBinding"] * 3
                                 + ["Service"] * 2 + ["Deployment"] * 2 + ["ConfigMap"] * 5
                                 + ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"] * 3)
    assert not MONITOR_KINDS & set(kinds(objs))
    dashboards = [o for o in objs if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]]
    for cm in dashboards:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        (text,) = cm["data"].values()
        assert json.loads(text)["uid"].startswith("disagg-")
    assert {json.loads(next(iter(c["data"].values())))["uid"] for c in dashboards} == {
        "disagg-overview", "disagg-prefill-decode", "disagg-router", "disagg-planner"}


def test_monitors_render_when_the_prometheus_operator_is_there(helm):
    objs = render(helm, "--api-versions", MONITORING)
    assert [k for k in kinds(objs) if k in MONITOR_KINDS] == ["PodMonitor", "PodMonitor", "PrometheusRule",
                                                              "ServiceMonitor"]
    sm = one(objs, "ServiceMonitor")
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics", "planner-metrics"]
    assert all(e["honorLabels"] for e in sm["spec"]["endpoints"])
    for component, ports in (("operator", ["metrics"]), ("planner", ["planner-metrics"])):
        svc = one(objs, "Service", component)
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert svc["metadata"]["labels"]["app.kubernetes.io/component"] in \
            sm["spec"]["selector"]["matchExpressions"][0]["values"]
        assert [p["name"] for p in svc["spec"]["ports"]] == ports
        dep = one(objs, "Deployment", component)
        assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        pod_ports = {p["name"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= pod_ports
    workers, routers = one(objs, "PodMonitor", "workers"), one(objs, "PodMonitor", "routers")
    targets = lambda pm: [r["targetLabel"] for r in pm["spec"]["podMetricsEndpoints"][0]["relabelings"]  # noqa: E731
                          if "targetLabel" in r]
    # (the second `role`: a flex worker's serving role, over its pool's name)
    assert targets(workers) == ["deployment", "role", "role"]
    # the router's own series carry `role`: a `role` target label would rename theirs to exported_role
    assert targets(routers) == ["endpoint", "deployment"]
    # every router process on its own port (spec.router.processes): no one port named, those the operator
    # names metrics-<i> kept
    (router_ep,) = routers["spec"]["podMetricsEndpoints"]
    assert "port" not in router_ep
    (keep,) = [r for r in router_ep["relabelings"] if r["action"] == "keep"]
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    assert keep["regex"] == contract.ROUTER_METRICS_PORT_NAMES

    # as e2e/monitoring.py translates them for a plain Prometheus (the real-node suite): the routers' job
    # filters on the monitor's own port-name rule only, and labels the endpoint with the port's name
    from disagg.e2e import monitoring

    jobs = {j["job_name"].split("/")[2]: j for j in monitoring.scrape_configs(objs, Path("kubeconfig"))}
    port_rules = lambda j: [r for r in j["relabel_configs"]  # noqa: E731
                            if r.get("source_labels") == ["__meta_kubernetes_pod_container_port_name"]]
    assert [(r["action"], r.get("regex")) for r in port_rules(jobs[routers["metadata"]["name"]])] == \
        [("keep", contract.ROUTER_METRICS_PORT_NAMES), ("replace", None)]
    assert [(r["action"], r["regex"]) for r in port_rules(jobs[workers["metadata"]["name"]])] == \
        [("keep", contract.WORKER_METRICS_PORT_NAME)]
    assert routers["spec"]["selector"]["matchExpressions"][0]["values"] == ["router"]
    assert workers["spec"]["selector"]["matchExpressions"][0]["values"] == ["prefill", "decode", "flex"]

    off = render(helm, "--api-versions", MONITORING, "--set", "monitoring.serviceMonitor.enabled=false",
                 "--set", "monitoring.podMonitors.enabled=false", "--set", "monitoring.prometheusRule.enabled=false",
                 "--set", "monitoring.dashboards.enabled=false")
    assert not MONITOR_KINDS & set(kinds(off))
    assert [o["metadata"]["name"] for o in off if o["kind"] == "ConfigMap"] == ["disagg-planner-prometheus"]


def test_operator_switched_off_renders_everything_but_the_operator_pod(helm):
    objs = render(helm, "--api-versions", MONITORING, "--set", "operator.enabled=false")
    assert "Deployment" not in kinds(objs) and "ServiceMonitor" not in kinds(objs) and "Service" not in kinds(objs)
    for component in ("operator", "planner"):
        sa = [o for o in objs if o["kind"] == "ServiceAccount" and
              o["metadata"]["labels"]["app.kubernetes.io/component"] == component][0]
        for binding in (o for o in objs if o["kind"] == "ClusterRoleBinding" and
                        o["metadata"]["labels"]["app.kubernetes.io/component"] == component):
            assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                            "namespace": "disagg-system"}]
    assert {"PodMonitor", "PrometheusRule", "ClusterRole"} <= set(kinds(objs))


def test_planner_switched_off_leaves_the_operator_alone(helm):
    objs = render(helm, "--api-versions", MONITORING, "--set", "planner.enabled=false")
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["operator"]
    assert [p["name"] for p in one(objs, "Service")["spec"]["ports"]] == ["metrics"]
    assert [e["port"] for e in one(objs, "ServiceMonitor")["spec"]["endpoints"]] == ["metrics"]
    assert not [o for o in objs if "planner" in o["metadata"]["name"] and o["kind"] != "ConfigMap"]


def test_operator_pod_runs_the_images_entrypoints_with_values(helm):
    objs = render(helm, "--set", "image.repository=registry.example/disagg/cp", "--set", "image.tag=1.2.3",
                  "--set-json", 'planner.prometheusEndpoints=[{"name": "main", "url": "http://prom.monitoring:9090"}]',
                  "--set", "operator.watchNamespaces={team-a}")
    pod = one(objs, "Deployment", "operator")["spec"]["template"]["spec"]
    planner_pod = one(objs, "Deployment", "planner")["spec"]["template"]["spec"]
    (op,), (planner,) = pod["containers"], planner_pod["containers"]
    assert op["image"] == planner["image"] == "registry.example/disagg/cp:1.2.3"
    assert op["args"][0] == "disagg.operator" and "--namespace=team-a" in op["args"]
    assert planner["args"][0] == "disagg.planner"
    assert "--prometheus-endpoints=/etc/disagg/prometheus/endpoints.yaml" in planner["args"]
    assert "--namespace=team-a" in planner["args"]
    # the planner's windows follow the scrape interval of the series it reads: the pod monitors', or its own value
    assert "--scrape-interval=15s" in planner["args"]
    planner = one(render(helm, "--set", "monitoring.podMonitors.interval=30s"), "Deployment", "planner")["spec"][
        "template"]["spec"]["containers"][0]
    assert "--scrape-interval=30s" in planner["args"]
    planner = one(render(helm, "--set", "planner.scrapeInterval=1m"), "Deployment", "planner")["spec"]["template"][
        "spec"]["containers"][0]
    assert "--scrape-interval=1m" in planner["args"]
    # several watched namespaces: one --namespace each (the planner's role is a Role in each of them)
    planner = one(render(helm, "--set", "operator.watchNamespaces={a,b}"), "Deployment", "planner")["spec"][
        "template"]["spec"]["containers"][0]
    assert "--namespace=a" in planner["args"] and "--namespace=b" in planner["args"]
    # decisions traced only when the planner is given a collector
    assert not [a for a in planner["args"] if a.startswith("--otlp-traces-endpoint")]
    planner = one(render(helm, "--set", "planner.otlpTracesEndpoint=http://otel.monitoring:4317"), "Deployment",
                  "planner")["spec"]["template"]["spec"]["containers"][0]
    assert "--otlp-traces-endpoint=http://otel.monitoring:4317" in planner["args"]
    assert {"name": "DISAGG_OPERATOR_METRICS_PORT", "value": "8000"} in op["env"]
    # glibc's malloc arenas capped (operator/memory.py; bench/operator_scale.py runs it the same way)
    assert {"name": "MALLOC_ARENA_MAX", "value": "2"} in op["env"]
    assert {"name": "PYTHONMALLOC", "value": "malloc"} in op["env"]
    # each its own ServiceAccount
    assert pod["serviceAccountName"] == "disagg"
    assert planner_pod["serviceAccountName"] == "disagg-planner"
    digest = "sha256:" + "a" * 64
    pod = one(render(helm, "--set", f"image.digest={digest}"), "Deployment", "operator")["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == f"disagg/control-plane@{digest}"
    # the default tag is the chart's appVersion (the Dockerfile's control-plane image the operator runs too)
    from disagg.operator.render import CONTROL_PLANE_IMAGE

    default = one(render(helm), "Deployment", "operator")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert default == CONTROL_PLANE_IMAGE


def test_routers_run_the_operators_own_image(helm, monkeypatch):
    """The operator renders routers from the image the chart runs it from (a mirror, a digest, a pull
    policy), never from a built-in name nobody installed."""
    from disagg.e2e.testing import dd_manifest
    from disagg.operator import render as r
    from disagg.api.v1alpha1 import DisaggDeployment

    pod = one(render(helm, "--set", "image.repository=mirror.example/disagg/cp", "--set", "image.tag=9.9",
                     "--set", "image.pullPolicy=Never"), "Deployment", "operator")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env[r.ROUTER_IMAGE_ENV] == pod["containers"][0]["image"] == "mirror.example/disagg/cp:9.9"
    assert env[r.ROUTER_PULL_POLICY_ENV] == "Never"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    dd = DisaggDeployment.model_validate({**dd_manifest("x"), "metadata": {"name": "x", "namespace": "ns"}})
    router = r.router_deployment(dd, "uid")["spec"]["template"]["spec"]["containers"][0]
    assert (router["image"], router["imagePullPolicy"]) == ("mirror.example/disagg/cp:9.9", "Never")


@pytest.mark.parametrize("component", ["operator", "planner"])
def test_secure_pod_defaults(helm, component):
    pod = one(render(helm), "Deployment", component)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"] is True
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert c["resources"]["limits"]["memory"] and c["resources"]["requests"]["cpu"]
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]  # the one writable place


# ---------------------------------------------------------------- RBAC


def grants(objs: list[dict]) -> dict[tuple[str, str, str], list[dict]]:
    """(kind, namespace, name) of each rendered ClusterRole/Role -> its rules."""
    return {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): norm(o["rules"])
            for o in objs if o["kind"] in ("ClusterRole", "Role") and "aggregate" not in str(o["metadata"]["labels"])}


def test_rbac_equals_operator_rbac_without_switched_off_backends(helm):
    source = source_roles()
    rules = operator_rules()
    without = [r for r in rules if not set(r["apiGroups"]) & OPTIONAL_GROUPS.keys()]
    assert len(without) == len(rules) - 2
    cluster = ("ClusterRole", "")
    assert grants(render(helm)) == {(*cluster, "disagg-operator-cluster"): norm(source["disagg-operator-cluster"]),
                                    (*cluster, "disagg-operator"): norm(without),
                                    (*cluster, "disagg-planner"): norm(source["disagg-planner"])}
    both = grants(render(helm, "--set", "gangBackends.coscheduling=true", "--set", "gangBackends.volcano=true"))
    assert both[(*cluster, "disagg-operator")] == norm(rules)
    volcano = grants(render(helm, "--set", "gangBackends.volcano=true"))
    assert volcano[(*cluster, "disagg-operator")] == norm(
        [r for r in rules if "scheduling.x-k8s.io" not in r["apiGroups"]])


def test_watched_namespaces_get_roles_and_only_what_cannot_be_namespaced_is_cluster_wide(helm):
    source = source_roles()
    objs = render(helm, "--set", "operator.watchNamespaces={team-a,team-b}", "--set", "gangBackends.volcano=true",
                  "--set", "gangBackends.coscheduling=true")
    expected = {("ClusterRole", "", "disagg-operator-cluster"): norm(source["disagg-operator-cluster"])}
    for ns in ("team-a", "team-b"):
        expected[("Role", ns, "disagg-operator")] = norm(source["disagg-operator"])
        expected[("Role", ns, "disagg-planner")] = norm(source["disagg-planner"])
    assert grants(objs) == expected
    # what stays cluster-wide: list nodes (free GPUs on every node); no tenant's pod specs: the pods counted are
    # the watched namespaces' (operator/fleet.py), and the operator is told so
    assert norm(source["disagg-operator-cluster"]) == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]
    env = {e["name"]: e["value"] for e in one(objs, "Deployment", "operator")["spec"]["template"]["spec"][
        "containers"][0]["env"] if "value" in e}
    assert env["DISAGG_CAPACITY_ALL_NAMESPACES"] == "false"
    # counting every namespace's pods is a choice, with its grant
    wide = render(helm, "--set", "operator.watchNamespaces={team-a}", "--set", "operator.capacity.countAllNamespaces=true")
    (cluster_role,) = [o for o in wide if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "disagg-operator-cluster"]
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]} in cluster_role["rules"]
    env = {e["name"]: e["value"] for e in one(wide, "Deployment", "operator")["spec"]["template"]["spec"][
        "containers"][0]["env"] if "value" in e}
    assert env["DISAGG_CAPACITY_ALL_NAMESPACES"] == "true"
    everywhere = render(helm)   # all namespaces: every pod is readable anyway, and counted
    env = {e["name"]: e["value"] for e in one(everywhere, "Deployment", "operator")["spec"]["template"]["spec"][
        "containers"][0]["env"] if "value" in e}
    assert env["DISAGG_CAPACITY_ALL_NAMESPACES"] == "true"
    bindings = sorted((o["kind"], o["metadata"].get("namespace", ""), o["roleRef"]["kind"], o["roleRef"]["name"],
                       o["subjects"][0]["name"]) for o in objs if o["kind"] in ("ClusterRoleBinding", "RoleBinding"))
    assert bindings == sorted([("ClusterRoleBinding", "", "ClusterRole", "disagg-operator-cluster", "disagg")] + [
        ("RoleBinding", ns, "Role", f"disagg-{who}", "disagg" if who == "operator" else "disagg-planner")
        for ns in ("team-a", "team-b") for who in ("operator", "planner")])


def test_no_role_reads_secrets_or_anything_cluster_wide_it_need_not(helm):
    for args in ([], ["--set", "operator.watchNamespaces={a}"]):
        for role in (o for o in render(helm, *args) if o["kind"] in ("ClusterRole", "Role")):
            for rule in role["rules"]:
                assert "secrets" not in rule["resources"] and "*" not in rule["verbs"] + rule["resources"], rule
                assert not {"customresourcedefinitions", "namespaces", "leases"} & set(rule["resources"]), rule


def test_each_account_is_bound_to_its_own_roles_only(helm):
    objs = render(helm)
    accounts = {o["metadata"]["labels"]["app.kubernetes.io/component"]: o["metadata"]["name"]
                for o in objs if o["kind"] == "ServiceAccount"}
    assert accounts == {"operator": "disagg", "planner": "disagg-planner"}
    bound = {a: sorted(b["roleRef"]["name"] for b in objs if b["kind"] in ("ClusterRoleBinding", "RoleBinding")
                       and any(s.get("name") == name for s in b["subjects"])) for a, name in accounts.items()}
    assert bound == {"operator": ["disagg-operator", "disagg-operator-cluster"], "planner": ["disagg-planner"]}
    # the aggregated user roles never grant more than DisaggDeployments
    for role in (o for o in objs if o["kind"] == "ClusterRole" and "aggregate" in str(o["metadata"]["labels"])):
        assert {g for r in role["rules"] for g in r["apiGroups"]} == {"serving.disagg.dev"}


# ---------------------------------------------------------------- metric names and rules


NAME = re.compile(r"(?<![\w:])(disagg_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
KNOWN = {v for k, v in vars(m).items() if k.isupper() and isinstance(v, str) and
         (v.startswith(m.PREFIX) or v.startswith("vllm:"))}


def metric_names(text: str) -> set[str]:
    return set(NAME.findall(text))


def unknown(names: set[str]) -> set[str]:
    def known(name: str) -> bool:
        if name in KNOWN:
            return True
        for suffix in ("_bucket", "_sum", "_count", "_total", "_created"):
            if name.endswith(suffix) and name.removesuffix(suffix) in KNOWN:
                return True
        return False
    return {n for n in names if not known(n)}


def rule_groups(helm: Path, *args: str) -> list[dict]:
    return one(render(helm, "--api-versions", MONITORING, *args), "PrometheusRule")["spec"]["groups"]


def test_every_metric_name_in_dashboards_and_rules_is_in_disagg_api_metrics(helm):
    dashboards = {p.name: p.read_text() for p in (CHART / "dashboards").glob("*.json")}
    assert len(dashboards) == 4
    for name, text in dashboards.items():
        names = metric_names(text)
        assert names, name
        assert not unknown(names), f"{name}: not in disagg/api/metrics.py: {sorted(unknown(names))}"
    rules = yaml.safe_dump(rule_groups(helm))
    names = metric_names(rules)
    assert {m.ROUTER_WORKERS, m.PLANNER_METRICS_AVAILABLE, m.VLLM_NIXL_FAILED_TRANSFERS + "_total",
            m.OPERATOR_CONDITION, m.ROUTER_MIGRATIONS, m.ROUTER_PAIRING_REFUSALS, m.ROUTER_KV_INDEX_RESYNCS,
            m.ROUTER_REJECTED, m.ROUTER_QUEUE_DEPTH} <= names
    assert not unknown(names), sorted(unknown(names))
    assert not unknown({"disagg_router_ttft_seconds_bucket"}) and unknown({"disagg_router_ttft_secs"})


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
    if not path:
        pytest.skip("promtool is not installed: `make prometheus` installs Debian's prometheus package")
    return path


def test_promtool_checks_every_rule(helm, promtool, tmp_path):
    for args in ([], ["--set", "monitoring.prometheusRule.slo.ttftSeconds=0.5",
                      "--set", "monitoring.prometheusRule.slo.itlSeconds=0.025",
                      "--set", "monitoring.prometheusRule.slo.objective=0.99",
                      "--set", "monitoring.prometheusRule.burnRate.fast.factor=14.4"]):
        groups = rule_groups(helm, *args)
        path = tmp_path / "rules.yaml"
        path.write_text(yaml.safe_dump({"groups": groups}))
        out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
        assert alerts == {"DisaggTTFTSLOBurnFast", "DisaggTTFTSLOBurnSlow", "DisaggITLSLOBurnFast",
                          "DisaggITLSLOBurnSlow", "DisaggNoReadyDecode", "DisaggNoReadyPrefill",
                          "DisaggNIXLTransferFailures", "DisaggPlannerMetricsUnavailable", "DisaggGangNotScheduled",
                          "DisaggMigrationsFailing", "DisaggPairingRefused", "DisaggKVIndexResyncsDropped",
                          "DisaggRouterRejecting", "DisaggRouterQueueing"}
    exprs = " ".join(str(r["expr"]) for g in groups for r in g["rules"])
    assert 'le=~"0.5|0.5.0"' in exprs and "(14.4 * (1 - 0.99))" in exprs
    off = rule_groups(helm, "--set", "monitoring.prometheusRule.alerts.noReadyPrefill.enabled=false")
    assert "DisaggNoReadyPrefill" not in {r.get("alert") for g in off for r in g["rules"]}


def test_promtool_unit_tests_fire_the_alerts(helm, promtool, tmp_path):
    """charts/disagg/promtool/alerts_test.yaml: no ready decode, no ready prefill, NIXL failures, TTFT burn,
    planner without metrics, gang not scheduled, mid-stream failures not continued, pairing refused, KV
    index resyncs dropped, and routers refusing (429) or queueing requests fire (and do not where they
    should not)."""
    groups = rule_groups(helm)
    for g in groups:
        for r in g["rules"]:
            r.pop("annotations", None)   # promtool compares annotations too; their templates are checked above
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    shutil.copy(CHART / "promtool" / "alerts_test.yaml", tmp_path)
    out = subprocess.run([promtool, "test", "rules", "alerts_test.yaml"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", (CHART / "promtool" / "alerts_test.yaml").read_text()))
    assert {"DisaggNoReadyDecode", "DisaggNIXLTransferFailures", "DisaggGangNotScheduled", "DisaggMigrationsFailing",
            "DisaggPairingRefused", "DisaggKVIndexResyncsDropped", "DisaggRouterRejecting",
            "DisaggRouterQueueing"} <= tested


# ---------------------------------------------------------------- the local API server


@pytest.fixture(scope="module")
def monitoring_crds(cluster):
    """Minimal CRDs of the Prometheus Operator's kinds (e2e/crds/monitoring)."""
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "e2e" / "crds" / "monitoring"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=300s",
                    *(f"crd/{p}.monitoring.coreos.com" for p in ("servicemonitors", "podmonitors", "prometheusrules")))
    return True


def dry_run(cluster, objs: list[dict], namespace: str) -> subprocess.CompletedProcess:
    text = "---\n".join(yaml.safe_dump(o) for o in objs)
    return cluster.kubectl("apply", "--server-side", "--dry-run=server", "--validate=strict",
                           "--field-manager=chart-test", "-n", namespace, "-f", "-", input=text, check=False)


@pytest.mark.cluster
def test_api_server_accepts_everything_the_chart_renders(helm, cluster, crd_installed, monitoring_crds, namespace):
    for args in ([], ["--set", "gangBackends.coscheduling=true", "--set", "gangBackends.volcano=true",
                      "--set", f"operator.watchNamespaces={{{namespace}}}",  # a Role each: in this one
                      "--set-json", 'planner.prometheusEndpoints=[{"name": "p", "url": "https://p:9090", '
                                    '"caSecret": {"name": "p-ca", "key": "ca.crt"}}]',
                      "--set", "planner.defaultPrometheus=p"],
                 ["--set", "operator.enabled=false", "--set", "rbac.aggregateToDefaultRoles=false"]):
        objs = render(helm, "--api-versions", MONITORING, *args, namespace=namespace, release="chart-test")
        assert MONITOR_KINDS <= set(kinds(objs)) or "operator.enabled=false" in args
        out = dry_run(cluster, objs, namespace)
        assert out.returncode == 0, f"{args}: {out.stderr}"
        assert "unknown field" not in out.stderr.lower() and "warning" not in out.stderr.lower(), out.stderr
        assert out.stdout.count("serverside-applied (server dry run)") == len(objs), out.stdout


@pytest.mark.cluster
def test_api_server_refuses_a_misspelt_monitor_field(cluster, monitoring_crds, namespace, helm):
    """The minimal monitoring CRDs are strict enough to catch a wrong field name."""
    objs = render(helm, "--api-versions", MONITORING, namespace=namespace, release="chart-test")
    pm = one(objs, "PodMonitor", "workers")
    pm["spec"]["podMetricsEndpoints"][0]["relabelling"] = pm["spec"]["podMetricsEndpoints"][0].pop("relabelings")
    out = dry_run(cluster, [pm], namespace)
    assert out.returncode != 0 and "relabelling" in out.stderr, out.stderr


EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_examples_cover_small_large_and_planned():
    specs = {p.name: yaml.safe_load(p.read_text())["spec"] for p in EXAMPLES}
    small = specs["small.yaml"]
    assert small["prefill"]["tensorParallelSize"] == small["decode"]["tensorParallelSize"] == 1
    large = [s for s in specs.values() if s["prefill"].get("tensorParallelSize", 1) > 1
             and s["decode"].get("tensorParallelSize", 1) > 1 and s["scheduling"].get("topology", {}).get("key")]
    assert large, "no example with TP on each side and a topology key"
    planned = [s for s in specs.values() if s.get("planner", {}).get("enabled") and s.get("slo")]
    assert planned, "no example with the planner on and SLOs"


def test_the_gateway_example_routes_to_the_pool_the_operator_renders_for_its_deployment():
    """examples/gateway/ (a Gateway and an HTTPRoute: their CRDs, the Gateway API's, are not on the local
    cluster) routes to the InferencePool the operator renders for examples/behind-a-gateway.yaml, from a
    Gateway in a namespace whose pods that deployment's NetworkPolicies admit."""
    from disagg.api.v1alpha1 import DisaggDeployment
    from disagg.operator import render as operator

    dd = DisaggDeployment.model_validate({**yaml.safe_load((REPO / "examples" / "behind-a-gateway.yaml").read_text()),
                                          "metadata": {"name": "qwen-gateway", "namespace": "serving"}})
    pool = operator.inference_pool(dd, "uid")
    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "examples" / "gateway" / "inference-gateway.yaml")
                                                     .read_text())}
    assert set(docs) == {"Gateway", "HTTPRoute"}
    gateway, route = docs["Gateway"], docs["HTTPRoute"]
    (backend,) = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        pool["apiVersion"].split("/")[0], pool["kind"], pool["metadata"]["name"])
    (parent,) = route["spec"]["parentRefs"]
    assert (parent["name"], parent["namespace"]) == (gateway["metadata"]["name"], gateway["metadata"]["namespace"])
    selector = dd.spec.router.picker.gateway_namespace_selector.manifest()
    assert selector == {"matchLabels": {"kubernetes.io/metadata.name": gateway["metadata"]["namespace"]}}


@pytest.mark.cluster
@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_applies_cleanly(cluster, crd_installed, namespace, example):
    out = cluster.kubectl("apply", "--server-side", "--validate=strict", "-n", namespace, "-f", str(example),
                          check=False)
    assert out.returncode == 0, out.stderr
    assert "warning" not in out.stderr.lower(), out.stderr
    name = yaml.safe_load(example.read_text())["metadata"]["name"]
    got = json.loads(cluster.kubectl("get", "dd", name, "-n", namespace, "-o", "json").stdout)
    assert got["spec"]["model"] == yaml.safe_load(example.read_text())["spec"]["model"]


def test_network_policy_option_reaches_the_operator(helm, monkeypatch):
    """networkPolicy.enabled and networkPolicy.prometheus become the operator's environment, which
    operator/render.py reads; the chart's default peers are the operator's own default."""
    from disagg.operator import render as r

    def operator_env(*args: str) -> dict[str, str]:
        pod = one(render(helm, *args), "Deployment", "operator")["spec"]["template"]["spec"]
        return {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}

    default = operator_env()
    assert default[r.NETWORK_POLICY_ENV] == "true"
    assert json.loads(default[r.NETWORK_POLICY_PROMETHEUS_ENV]) == r.DEFAULT_PROMETHEUS_PEERS
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
             {"ipBlock": {"cidr": "10.1.0.0/16"}}]
    off = operator_env("--set", "networkPolicy.enabled=false", "--set-json", f"networkPolicy.prometheus={json.dumps(peers)}")
    for env in (default, off):
        for name in (r.NETWORK_POLICY_ENV, r.NETWORK_POLICY_PROMETHEUS_ENV):
            monkeypatch.setenv(name, env[name])
        assert r.network_policy_enabled() is (env is default)
        assert r.prometheus_peers() == (r.DEFAULT_PROMETHEUS_PEERS if env is default else peers)
    # a misspelt peer field is refused, not rendered into a rule that admits more than meant
    bad = subprocess.run([str(helm), "template", "x", str(CHART), "--set-json",
                          'networkPolicy.prometheus=[{"podSelektor": {}}]'], capture_output=True, text=True)
    assert bad.returncode != 0 and "podSelektor" in bad.stderr, bad.stderr


# ---------------------------------------------------------------- the planner's Prometheus allowlist


def test_prometheus_allowlist_reaches_the_planner_as_a_file_with_its_ca(helm):
    from disagg.planner.endpoints import Allowlist

    objs = render(helm, "--set-json", 'planner.prometheusEndpoints=[{"name": "main", "url": "https://prom:9090", '
                                      '"caSecret": {"name": "prom-ca", "key": "tls.ca"}}, '
                                      '{"name": "lab", "url": "http://lab:9090", "insecureSkipVerify": true}]',
                  "--set", "planner.defaultPrometheus=main")
    cm = one(objs, "ConfigMap", "planner-prometheus")
    allowlist = Allowlist.from_dict(yaml.safe_load(cm["data"]["endpoints.yaml"]))
    assert allowlist.default == "main" and sorted(allowlist.endpoints) == ["lab", "main"]
    main, lab = allowlist.endpoints["main"], allowlist.endpoints["lab"]
    assert (main.url, main.verify) == ("https://prom:9090", "/etc/disagg/prometheus-ca/main/ca.crt")
    assert (lab.url, lab.verify) == ("http://lab:9090", False)
    pod = one(objs, "Deployment", "planner")["spec"]["template"]["spec"]
    (planner,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in planner["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["prometheus-endpoints"]["configMap"]["name"] == cm["metadata"]["name"]
    assert mounts["prometheus-endpoints"] == "/etc/disagg/prometheus"
    # the CA comes from a Secret the kubelet mounts: the planner's ServiceAccount reads no Secret
    assert volumes["prometheus-ca-main"]["secret"] == {"secretName": "prom-ca", "items": [{"key": "tls.ca",
                                                                                         "path": "ca.crt"}]}
    assert mounts["prometheus-ca-main"] == "/etc/disagg/prometheus-ca/main" and "prometheus-ca-lab" not in mounts
    # the defaults: an empty allowlist (deployments with the planner hold, naming the field)
    empty = Allowlist.from_dict(yaml.safe_load(one(render(helm), "ConfigMap", "planner-prometheus")["data"][
        "endpoints.yaml"]))
    assert empty.endpoints == {} and empty.default is None


def test_a_default_that_is_not_in_the_allowlist_is_refused(helm):
    out = subprocess.run([str(helm), "template", "x", str(CHART), "--set", "planner.defaultPrometheus=nope"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "planner.defaultPrometheus" in out.stderr
    out = subprocess.run([str(helm), "template", "x", str(CHART), "--set", "planner.prometheusUrl=http://p:9090"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "prometheusUrl" in out.stderr   # removed: the schema refuses it


@pytest.mark.cluster
def test_admission_refuses_a_prometheus_name_not_in_the_allowlist(helm, cluster, crd_installed, namespace):
    """The chart's ValidatingAdmissionPolicy on the real API server (bound to this namespace only)."""
    from disagg.e2e.testing import dd_manifest, wait_for

    objs = render(helm, "--set-json", 'planner.prometheusEndpoints=[{"name": "main", "url": "http://p:9090"}]',
                  "--set", f"operator.watchNamespaces={{{namespace}}}", release=namespace, namespace=namespace)
    policy = [o for o in objs if o["kind"].startswith("ValidatingAdmissionPolicy")
              and o["metadata"]["name"].endswith("prometheus-endpoints")]
    assert len(policy) == 2
    text = "---\n".join(yaml.safe_dump(o) for o in policy)
    cluster.kubectl("apply", "--server-side", "-f", "-", input=text)
    try:
        def create(name: str, prometheus: str) -> subprocess.CompletedProcess:
            doc = dd_manifest(name, slo={"ttftMs": 1000, "itlMs": 50},
                              planner={"enabled": True, "prometheus": prometheus})
            doc["metadata"]["namespace"] = namespace
            return cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(doc), check=False)

        def refused_once() -> subprocess.CompletedProcess | None:
            out = create("probe", "elsewhere")
            if out.returncode == 0:   # admitted before the API server loaded the policy: try again
                cluster.kubectl("delete", "dd", "probe", "-n", namespace, check=False)
                return None
            return out

        refused = wait_for(refused_once, 60, "the admission policy to refuse an unknown name")
        assert 'spec.planner.prometheus: "elsewhere" is not an allowed Prometheus endpoint (allowed: main)' in \
            refused.stderr, refused.stderr
        out = create("allowed", "main")
        assert out.returncode == 0, out.stderr
        # the removed URL field: refused by the CRD, naming the field and its replacement
        doc = dd_manifest("url", slo={"ttftMs": 1000, "itlMs": 50},
                          planner={"enabled": True, "prometheusUrl": "http://169.254.169.254/"})
        doc["metadata"]["namespace"] = namespace
        out = cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(doc), check=False)
        assert out.returncode != 0 and "spec.planner.prometheusUrl" in out.stderr
        assert "spec.planner.prometheus instead" in out.stderr, out.stderr
    finally:
        cluster.kubectl("delete", "-f", "-", "--ignore-not-found", input=text, check=False)


def test_own_service_accounts_need_both_names_and_the_planners_only_with_the_planner(helm):
    objs = render(helm, "--set", "serviceAccount.create=false", "--set", "serviceAccount.name=op",
                  "--set", "serviceAccount.plannerName=pl")
    assert "ServiceAccount" not in kinds(objs)
    subjects = {b["roleRef"]["name"]: b["subjects"][0]["name"] for b in objs if b["kind"] == "ClusterRoleBinding"}
    assert subjects == {"disagg-operator-cluster": "op", "disagg-operator": "op", "disagg-planner": "pl"}
    assert one(objs, "Deployment", "planner")["spec"]["template"]["spec"]["serviceAccountName"] == "pl"
    out = subprocess.run([str(helm), "template", "x", str(CHART), "--set", "serviceAccount.create=false",
                          "--set", "serviceAccount.name=op"], capture_output=True, text=True)
    assert out.returncode != 0 and "serviceAccount.plannerName is required" in out.stderr
    off = render(helm, "--set", "serviceAccount.create=false", "--set", "serviceAccount.name=op",
                 "--set", "planner.enabled=false")
    assert not [o for o in off if o["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
                and o["metadata"]["name"].endswith("-planner")]
