"""The planner on the local control plane: server-side apply under `disagg-planner`, status, events, and a
user's later `kubectl apply` (client-side and server-side) of a manifest without replicas not undoing it.

Metrics come from a real Prometheus scraping an exporter the test drives; the operator is not needed. The
planner runs under its own ServiceAccount bound to operator/rbac.yaml's disagg-planner role only, as the chart
runs it: a call that role does not allow fails the test.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from disagg.api import metrics as m
from disagg.api.names import GROUP
from disagg.api.v1alpha1 import PLURAL, VERSION
from disagg.e2e.prometheus import LocalPrometheus, MetricsExporter
from disagg.e2e.testing import wait_for
from disagg.planner import decide as dc
from disagg.planner.apply import FIELD_MANAGER, Executor, PlannerMetrics, replicas_owner
from disagg.planner.endpoints import Allowlist, Endpoint
from disagg.planner.loop import PlannerLoop, resolve_gpu, resolve_model_name
from disagg.planner import reasons, slo
from disagg.planner.metrics_source import PrometheusSource, parse_duration

pytestmark = pytest.mark.cluster
NAME = "llama"
ENDPOINT = "test"  # the name deployments give (spec.planner.prometheus); the allowlist maps it to the URL


def allowlist(prom) -> Allowlist:
    return Allowlist({ENDPOINT: Endpoint(ENDPOINT, prom.url)})


def manifest(namespace, image="disagg/worker:0.1.0"):
    """What a user keeps in git: no replica counts (the planner owns them)."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DisaggDeployment",
            "metadata": {"name": NAME, "namespace": namespace},
            "spec": {"model": {"name": "llama-3.1-8b", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
                     "engine": {"image": image},
                     "prefill": {"tensorParallelSize": 1, "maxReplicas": 8},
                     "decode": {"tensorParallelSize": 1, "maxReplicas": 8},
                     "slo": {"ttftMs": 1000, "itlMs": 50, "percentile": 90},
                     "planner": {"enabled": True, "intervalSeconds": 5, "gpuBudget": 16,
                                 "scaleDownCooldownSeconds": 60, "prometheus": ENDPOINT}}}


@pytest.fixture
def metrics_world(namespace, tmp_path):
    exporter = MetricsExporter(namespace, NAME)
    prom = LocalPrometheus(tmp_path / "prometheus", [f"127.0.0.1:{exporter.port}"]).start()
    yield exporter, prom
    prom.stop()
    exporter.close()


@pytest.fixture(scope="module")
def planner_api(cluster, api_client, crd_installed, tmp_path_factory):
    """An API client holding a token of the planner's ServiceAccount (its role only)."""
    from kubernetes import config

    from disagg.e2e.operator_fixture import planner_kubeconfig

    path = planner_kubeconfig(cluster, api_client, tmp_path_factory.mktemp("planner") / "kubeconfig")
    api = config.new_client_from_config(str(path))
    yield api
    api.close()


def _get(api_client, namespace):
    from kubernetes import client

    return client.CustomObjectsApi(api_client).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME)


def _replicas(obj):
    return obj["spec"]["prefill"]["replicas"], obj["spec"]["decode"]["replicas"]


def _kubectl_apply(cluster, doc, *flags):
    return cluster.kubectl("apply", *flags, "-f", "-", input=yaml.safe_dump(doc), check=False)


def test_decision_lands_and_a_users_apply_without_replicas_keeps_it(cluster, api_client, crd_installed, namespace,
                                                                    metrics_world, planner_api):
    from kubernetes import client

    exporter, prom = metrics_world
    doc = manifest(namespace)
    out = _kubectl_apply(cluster, doc)  # client-side, as most users do
    assert out.returncode == 0, out.stderr
    assert _replicas(_get(api_client, namespace)) == (1, 1)  # schema defaults

    # traffic that breaks both targets
    exporter.traffic = replace(exporter.traffic, rate=20.0, ttft=3.0, itl=0.2, prefill_waiting=10)
    source = PrometheusSource.for_endpoint(allowlist(prom).endpoints[ENDPOINT], timeout=3)
    wait_for(lambda: (lambda o: o.ttft and o.ttft > 2 and o.itl and o.itl > 0.1 and o.request_rate > 12)(
        source.observe(namespace, NAME, 90, 10)), 60, "breaching traffic in Prometheus", interval=0.5)
    metrics = PlannerMetrics()
    loop = PlannerLoop(planner_api, Executor(planner_api, metrics), lambda endpoint: source, allowlist(prom), namespace=namespace,
                       scrape_interval=parse_duration(prom.scrape_interval))
    [(ns, name, decision)] = loop.step(now=1000.0)
    assert (ns, name) == (namespace, NAME)
    assert decision.metrics_ok and decision.prefill.replicas > 1 and decision.decode.replicas > 1
    want = (decision.prefill.replicas, decision.decode.replicas)

    obj = _get(api_client, namespace)
    assert _replicas(obj) == want
    assert replicas_owner(obj) == FIELD_MANAGER
    planner = obj["status"]["planner"]
    assert planner["replicasManagedBy"] == FIELD_MANAGER
    assert (planner["prefillReplicas"], planner["decodeReplicas"]) == want and planner["reason"] == dc.SCALED
    assert planner["inputs"]["ttft"] > 2 and planner["prediction"]["requestRate"] > 10
    cond = next(c for c in obj["status"]["conditions"] if c["type"] == "PlannerActive")
    assert cond["status"] == "True" and cond["reason"] == "MetricsAvailable"
    # the same observation, against spec.slo: both targets missed, with the numbers
    met = next(c for c in obj["status"]["conditions"] if c["type"] == "SLOMet")
    assert met["status"] == "False" and met["reason"] == reasons.BOTH_ABOVE and "target 1000 ms" in met["message"]
    assert obj["status"]["latency"]["ttftMs"] > 2000 and obj["status"]["latency"]["percentile"] == 90
    events = client.CoreV1Api(api_client).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={NAME}").items
    assert any(e.reason == dc.SCALED and e.source.component == FIELD_MANAGER and "prefill 1->" in e.message
               for e in events)
    sample = metrics.registry.get_sample_value(m.PLANNER_DESIRED_REPLICAS,
                                               {"namespace": namespace, "deployment": NAME, "role": "prefill"})
    assert sample == want[0]

    # the user re-applies the same manifest (a new image, still no replicas): client-side ...
    out = _kubectl_apply(cluster, manifest(namespace, image="disagg/worker:0.1.1"))
    assert out.returncode == 0, out.stderr
    obj = _get(api_client, namespace)
    assert obj["spec"]["engine"]["image"] == "disagg/worker:0.1.1" and _replicas(obj) == want
    # ... and server-side, as kubectl's own field manager
    out = _kubectl_apply(cluster, manifest(namespace, image="disagg/worker:0.1.2"), "--server-side")
    assert out.returncode == 0, out.stderr
    obj = _get(api_client, namespace)
    assert obj["spec"]["engine"]["image"] == "disagg/worker:0.1.2" and _replicas(obj) == want
    assert replicas_owner(obj) == FIELD_MANAGER

    # a user who does put replicas in a server-side apply is told who owns them
    with_replicas = manifest(namespace, image="disagg/worker:0.1.2")
    with_replicas["spec"]["prefill"]["replicas"] = 1
    out = _kubectl_apply(cluster, with_replicas, "--server-side")
    assert out.returncode != 0 and "conflict" in out.stderr.lower() and FIELD_MANAGER in out.stderr
    assert _replicas(_get(api_client, namespace)) == want

    # Prometheus goes away: the planner holds the size and says why
    prom.stop()
    [(_, _, held)] = loop.step(now=1010.0)
    assert held.reason == dc.PROMETHEUS_UNREACHABLE and (held.prefill.replicas, held.decode.replicas) == want
    obj = _get(api_client, namespace)
    assert _replicas(obj) == want
    assert obj["status"]["planner"]["reason"] == dc.PROMETHEUS_UNREACHABLE
    cond = next(c for c in obj["status"]["conditions"] if c["type"] == "PlannerActive")
    # the endpoint by its allowlist name and the exception's class: nothing the remote end said
    unreachable = f"Prometheus endpoint '{ENDPOINT}' unreachable (ConnectionError)"
    assert cond["status"] == "False" and cond["reason"] == dc.PROMETHEUS_UNREACHABLE and unreachable in cond["message"]
    met = next(c for c in obj["status"]["conditions"] if c["type"] == "SLOMet")
    assert met["status"] == "Unknown" and met["reason"] == reasons.PROMETHEUS_UNREACHABLE and unreachable in met["message"]
    assert "ttftMs" not in obj["status"]["latency"]      # no stale figure once nothing is measured
    assert metrics.registry.get_sample_value(m.PLANNER_METRICS_AVAILABLE,
                                             {"namespace": namespace, "deployment": NAME}) == 0
    warnings = client.CoreV1Api(api_client).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={NAME},type=Warning").items
    assert any(e.reason == dc.PROMETHEUS_UNREACHABLE for e in warnings)
    # within one interval nothing is re-planned
    assert loop.step(now=1012.0) == []


def test_model_and_gpu_are_resolved_from_the_spec():
    from disagg.api.v1alpha1 import DisaggDeploymentSpec

    spec = DisaggDeploymentSpec.model_validate({
        "model": {"name": "whatever", "source": "hf://Qwen/Qwen2.5-7B-Instruct"},
        "decode": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}}})
    assert resolve_model_name(spec) == "Qwen/Qwen2.5-7B-Instruct"
    assert resolve_gpu({"metadata": {}}, spec) == "A100-SXM-80GB"
    assert resolve_gpu({"metadata": {"annotations": {"serving.disagg.dev/gpu": "H200-SXM"}}}, spec) == "H200-SXM"
    spec = DisaggDeploymentSpec.model_validate({"model": {"name": "Llama-3.1-70B-Instruct", "source": "pvc://m/x"}})
    assert resolve_model_name(spec) == "meta-llama/Llama-3.1-70B-Instruct"


def test_planner_example_is_admitted_and_planned(cluster, api_client, crd_installed, namespace):
    from disagg.api.v1alpha1 import DisaggDeployment

    path = Path(__file__).resolve().parent.parent / "examples" / "with-planner.yaml"
    doc = yaml.safe_load(path.read_text())
    dd = DisaggDeployment.model_validate(doc)
    assert dd.spec.planner.enabled and "replicas" not in doc["spec"]["prefill"]
    out = cluster.kubectl("apply", "-n", namespace, "-f", str(path), check=False)
    assert out.returncode == 0, out.stderr
    t = dc.Target.from_spec(dd.spec)
    assert (t.prefill, t.decode, t.gpu_budget, t.predictor) == (1, 1, 16, "holt-winters")
    assert resolve_model_name(dd.spec) == "meta-llama/Llama-3.1-8B-Instruct"


def test_latency_and_slo_met_without_the_planner_fill_kubectls_columns(cluster, api_client, crd_installed, namespace,
                                                                       metrics_world, planner_api):
    """A deployment with spec.slo and the planner off: latency and SLOMet are still written (the
    TTFT-MS and ITL-MS columns), and its replicas are left alone."""
    exporter, prom = metrics_world
    doc = manifest(namespace)
    doc["spec"]["planner"] = {"prometheus": ENDPOINT, "intervalSeconds": 5}
    out = _kubectl_apply(cluster, doc)
    assert out.returncode == 0, out.stderr
    exporter.traffic = replace(exporter.traffic, rate=10.0, ttft=0.3, itl=0.02, prefill_waiting=0)
    source = PrometheusSource(prom.url, timeout=3)
    wait_for(lambda: (lambda o: o.request_rate and o.ttft and o.ttft < 0.5 and o.itl and o.itl < 0.03)(
        source.observe(namespace, NAME, 90, 10)), 60, "steady traffic in Prometheus", interval=0.5)
    loop = PlannerLoop(planner_api, Executor(planner_api), lambda endpoint: source, allowlist(prom), namespace=namespace,
                       scrape_interval=parse_duration(prom.scrape_interval))
    [(_, _, verdict)] = loop.step(now=1000.0)
    assert isinstance(verdict, slo.Verdict) and verdict.status == "True"
    obj = _get(api_client, namespace)
    met = next(c for c in obj["status"]["conditions"] if c["type"] == "SLOMet")
    assert met["status"] == "True" and met["reason"] == reasons.TARGETS_MET and "p90 TTFT" in met["message"]
    assert 200 < obj["status"]["latency"]["ttftMs"] <= 400 and 10 < obj["status"]["latency"]["itlMs"] <= 30
    assert _replicas(obj) == (1, 1) and not (obj["status"].get("planner") or {}).get("lastDecisionTime")
    row = cluster.kubectl("get", "dd", NAME, "-n", namespace, "--no-headers").stdout.split()
    header = cluster.kubectl("get", "dd", NAME, "-n", namespace).stdout.splitlines()[0].split()
    columns = dict(zip(header, row))
    assert float(columns["TTFT-MS"]) == obj["status"]["latency"]["ttftMs"]
    assert float(columns["ITL-MS"]) == obj["status"]["latency"]["itlMs"]


def test_a_prometheus_name_outside_the_allowlist_holds_and_names_the_field(cluster, api_client, crd_installed,
                                                                          namespace, planner_api):
    """A deployment admitted without the chart's admission policy (or before the list changed) naming an
    endpoint the planner does not know: nothing is fetched, the planner holds and says which field to change."""
    doc = manifest(namespace)
    doc["spec"]["planner"]["prometheus"] = "elsewhere"
    out = _kubectl_apply(cluster, doc)
    assert out.returncode == 0, out.stderr
    fetched = []
    loop = PlannerLoop(planner_api, Executor(planner_api), lambda endpoint: fetched.append(endpoint),
                       Allowlist({ENDPOINT: Endpoint(ENDPOINT, "http://127.0.0.1:9")}), namespace=namespace)
    [(_, _, decision)] = loop.step(now=1000.0)
    assert fetched == [] and decision.reason == reasons.PROMETHEUS_NOT_ALLOWED
    assert (decision.prefill.replicas, decision.decode.replicas) == (1, 1)
    cond = next(c for c in _get(api_client, namespace)["status"]["conditions"] if c["type"] == "PlannerActive")
    assert cond["status"] == "False" and cond["reason"] == reasons.PROMETHEUS_NOT_ALLOWED
    assert "spec.planner.prometheus: 'elsewhere' is not an allowed Prometheus endpoint (allowed: test)" in \
        cond["message"]


def test_between_decisions_a_growing_queue_scales_up_at_once(cluster, api_client, crd_installed, namespace,
                                                             metrics_world, planner_api):
    """The fast path: after a decision, a prefill queue that grows faster than its replicas drain it is
    answered within a scrape interval or two, long before the next decision (the interval is 5 minutes)."""
    from kubernetes import client

    exporter, prom = metrics_world
    doc = manifest(namespace)
    doc["spec"]["planner"]["intervalSeconds"] = 300
    out = _kubectl_apply(cluster, doc)
    assert out.returncode == 0, out.stderr
    # the operator's word that the deployment serves (no operator runs here): the fast path acts only then
    obj = _get(api_client, namespace)
    client.CustomObjectsApi(api_client).patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, NAME,
        {"status": {"observedGeneration": obj["metadata"]["generation"], "conditions": [
            {"type": "Ready", "status": "True", "reason": "Test", "message": "serving",
             "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": obj["metadata"]["generation"]}]}})
    exporter.traffic = replace(exporter.traffic, rate=4.0, ttft=0.3, itl=0.02, prefill_waiting=0, decode_waiting=0)
    source = PrometheusSource.for_endpoint(allowlist(prom).endpoints[ENDPOINT], timeout=3)
    wait_for(lambda: (lambda o: o.request_rate and o.ttft and o.ttft < 0.5 and o.prefill_queue == 0)(
        source.observe(namespace, NAME, 90, 10)), 120, "steady traffic in Prometheus", interval=0.5)
    scrape = parse_duration(prom.scrape_interval)
    loop = PlannerLoop(planner_api, Executor(planner_api), lambda endpoint: source, allowlist(prom),
                       namespace=namespace, scrape_interval=scrape)
    [(_, _, first)] = loop.step(now=1000.0)
    assert first.metrics_ok and (first.prefill.replicas, first.decode.replicas) == (1, 1)
    clock = iter(1000.0 + scrape * k for k in range(1, 100_000))

    def scaled():
        # the queue keeps growing; each pass is one scrape interval later, well inside the interval
        exporter.traffic = replace(exporter.traffic, prefill_waiting=exporter.traffic.prefill_waiting + 20)
        assert loop.step(now=next(clock)) == []  # (reactions are not decisions)
        return (lambda o: o if _replicas(o)[0] > 1 else None)(_get(api_client, namespace))

    obj = wait_for(scaled, 120, "the fast path's scale-up", interval=0.5)
    assert _replicas(obj)[1] == 1  # decode's queue did not grow: untouched
    assert obj["status"]["planner"]["message"].startswith("queue growing: prefill 1->")
    assert FIELD_MANAGER in replicas_owner(obj)
