"""The planner on the local control plane: server-side apply under `disagg-planner`, status, events, and a
user's later `kubectl apply` (client-side and server-side) of a manifest without replicas not undoing it.

Metrics come from a real Prometheus scraping an exporter the test drives; the operator is not needed. The
planner runs under its own ServiceAccount bound to operator/rbac.yaml's disagg-planner role only, as the chart
runs it: a call that role does not allow fails the test.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from disagg.api import metrics as m
from disagg.api.names import GROUP
from disagg.api.v1alpha1 import PLURAL, VERSION
from disagg.e2e.prometheus import scraped_exporter
from disagg.e2e.testing import wait_for
from disagg.perf import model as perfmodel
from disagg.planner import decide as dc
from disagg.planner import reasons, slo
from disagg.planner.apply import FIELD_MANAGER, Executor, PlannerMetrics, replicas_owner
from disagg.planner.endpoints import Allowlist, Endpoint
from disagg.planner.loop import GPU_ANNOTATION, PlannerLoop, resolve_gpu, resolve_model_name, unplannable
from disagg.planner.metrics_source import PrometheusSource, parse_duration
from disagg.planner.tracing import DecisionTracer

pytestmark = pytest.mark.cluster
NAME = "llama"
ENDPOINT = "test"  # the name deployments give (spec.planner.prometheus); the allowlist maps it to the URL


def allowlist(prom) -> Allowlist:
    return Allowlist({ENDPOINT: Endpoint(ENDPOINT, prom.url)})


def manifest(namespace, image="disagg/worker:0.1.0"):
    """What a user keeps in git: no replica counts (the planner owns them)."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DisaggDeployment",
            # the GPU the planner sizes for (it holds when none is named)
            "metadata": {"name": NAME, "namespace": namespace, "annotations": {GPU_ANNOTATION: "H100-SXM"}},
            "spec": {"model": {"name": "llama-3.1-8b", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
                     "engine": {"image": image},
                     "prefill": {"tensorParallelSize": 1, "maxReplicas": 8},
                     "decode": {"tensorParallelSize": 1, "maxReplicas": 8},
                     "slo": {"ttftMs": 1000, "itlMs": 50, "percentile": 90},
                     "planner": {"enabled": True, "intervalSeconds": 5, "gpuBudget": 16,
                                 "scaleDownCooldownSeconds": 60, "prometheus": ENDPOINT}}}


@pytest.fixture
def metrics_world(namespace, tmp_path):
    with scraped_exporter(namespace, NAME, tmp_path / "prometheus") as world:
        yield world


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
    spans = InMemorySpanExporter()
    loop = PlannerLoop(planner_api, Executor(planner_api, metrics), lambda endpoint: source, allowlist(prom), namespace=namespace,
                       scrape_interval=parse_duration(prom.scrape_interval), tracer=DecisionTracer(exporter=spans))
    [(ns, name, decision)] = loop.step(now=1000.0)
    assert (ns, name) == (namespace, NAME)
    assert decision.metrics_ok and decision.prefill.replicas > 1 and decision.decode.replicas > 1
    want = (decision.prefill.replicas, decision.decode.replicas)
    # the decision's span: what it decided, against which Prometheus (by its allowlist name), from which reads
    (span,) = spans.get_finished_spans()
    assert (span.attributes["disagg.deployment"], span.attributes["disagg.planner.reason"]) == (NAME, dc.SCALED)
    assert span.attributes["disagg.planner.prometheus"] == ENDPOINT
    assert (span.attributes["disagg.planner.prefill.decided"], span.attributes["disagg.planner.decode.decided"]) == want
    assert len([e for e in span.events if e.name == "prometheus.query"]) > 10

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
    # nothing made up: a model or GPU the performance model lacks is None (the planner then holds), and a
    # measured profile names both as a last resort
    spec = DisaggDeploymentSpec.model_validate({"model": {"name": "my-finetune", "source": "pvc://models/ft"}})
    assert resolve_model_name(spec) is None and resolve_gpu({"metadata": {}}, spec) is None
    assert resolve_gpu({"metadata": {"annotations": {"serving.disagg.dev/gpu": "TPU-v5"}}}, spec) is None
    profile = perfmodel.Profile(
        model="Qwen/Qwen2.5-7B-Instruct", gpu="L40S", tensor_parallel_size=1,
        prefill=tuple({"tokens": t, "batch": 1, "seconds": t / 1e4} for t in (64, 128, 256)),
        decode=tuple({"concurrency": c, "context": 128, "seconds": 0.01 * c} for c in (1, 2, 4)))
    assert resolve_model_name(spec, profile) == "Qwen/Qwen2.5-7B-Instruct"
    assert resolve_gpu({"metadata": {}}, spec, profile) == "L40S"
    problem = unplannable({"metadata": {}}, spec)
    assert problem.reason == reasons.UNKNOWN_MODEL and "'pvc://models/ft'" in problem.message
    assert "no GPU named" in problem.message and GPU_ANNOTATION in problem.message


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


def _planner_lines(caplog, level):
    """The planner's log lines at ``level``, each one JSON object (what a log pipeline reads)."""
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "disagg.planner" and r.levelno == level]


def test_a_failed_list_costs_passes_not_the_planner_or_its_memory(cluster, api_client, crd_installed, namespace,
                                                                   metrics_world, planner_api, tmp_path, caplog):
    """The API error is real: the planner runs as a ServiceAccount bound to the disagg-planner role in this
    namespace only, and the test deletes that RoleBinding mid-run (the API server answers 403 to its list),
    then binds it again. The loop runs in a thread as in the planner process (``run``): it must survive the
    failed passes, count and log them, and carry on with the memory it had."""
    import logging
    import threading

    from kubernetes import client, config

    from disagg.e2e.operator_fixture import token_kubeconfig

    exporter, prom = metrics_world
    caplog.set_level(logging.INFO, logger="disagg.planner")
    rbac = client.RbacAuthorizationV1Api(api_client)
    client.CoreV1Api(api_client).create_namespaced_service_account(namespace, {"metadata": {"name": "planner"}})
    binding = {"metadata": {"name": "planner"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "disagg-planner"},
               "subjects": [{"kind": "ServiceAccount", "name": "planner", "namespace": namespace}]}
    rbac.create_namespaced_role_binding(namespace, binding)
    api = config.new_client_from_config(str(token_kubeconfig(cluster.kubeconfig, api_client, namespace, "planner",
                                                             tmp_path / "kubeconfig")))
    out = _kubectl_apply(cluster, manifest(namespace))
    assert out.returncode == 0, out.stderr
    exporter.traffic = replace(exporter.traffic, rate=4.0, ttft=0.3, itl=0.02, prefill_waiting=0, decode_waiting=0)
    source = PrometheusSource.for_endpoint(allowlist(prom).endpoints[ENDPOINT], timeout=3)
    wait_for(lambda: (lambda o: o.request_rate and o.ttft and o.ttft < 0.5)(source.observe(namespace, NAME, 90, 10)),
             120, "steady traffic in Prometheus", interval=0.5)
    metrics = PlannerMetrics()
    # the clock stands inside the first decision's interval and short of a scrape interval after it: every
    # pass of run() below lists and does nothing else
    loop = PlannerLoop(api, Executor(api, metrics), lambda endpoint: source, allowlist(prom), namespace=namespace,
                       clock=lambda: 1000.5, scrape_interval=parse_duration(prom.scrape_interval))
    [(_, _, first)] = loop.step(now=1000.0)
    assert first.metrics_ok
    uid = _get(api_client, namespace)["metadata"]["uid"]
    state = loop.state[uid]
    memory = state.memory
    assert len(memory.rate) == 1 and memory.last_scale_up_prefill == 1000.0

    def failed_lists():
        return metrics.registry.get_sample_value(m.PLANNER_ERRORS, {"stage": "list", "error": "http_403"}) or 0

    rbac.delete_namespaced_role_binding("planner", namespace)
    stop = threading.Event()
    runner = threading.Thread(target=loop.run, args=(stop, 0.1), daemon=True)
    runner.start()
    try:
        wait_for(lambda: failed_lists() >= 3, 60, "three failed passes")
        assert runner.is_alive()
    finally:
        stop.set()
        runner.join(30)
    assert not runner.is_alive()
    # one JSON line a failure, naming what failed where
    logged = [r for r in _planner_lines(caplog, logging.ERROR) if r.get("event") == "planner_error"]
    assert len(logged) >= 3 and all(r["stage"] == "list" and r["error"] == "http_403" and
                                    r["deployment"] == f"{namespace}/*" and "forbidden" in r["message"]
                                    for r in logged), logged
    # a namespace that could not be listed is not a namespace whose deployments are gone
    assert loop.state[uid] is state and state.memory is memory and state.last == 1000.0

    rbac.create_namespaced_role_binding(namespace, binding)
    [(_, _, second)] = wait_for(lambda: loop.step(now=1010.0), 60, "a decision once the planner may list again")
    assert second.metrics_ok
    # the history and the cooldown clock go on from before the failures (a new process would start both over)
    after = loop.state[uid].memory
    assert len(after.rate) == 2 and after.rate[0] == memory.rate[0] and after.last_scale_up_prefill == 1000.0
    api.close()


def test_an_unknown_model_or_gpu_holds_and_says_so(cluster, api_client, crd_installed, namespace, metrics_world,
                                                   planner_api, caplog):
    """Traffic that breaks both targets, a model the performance model lacks: no sizing on a made-up model.
    The planner holds the size and says why in status, an event, a log line and a metric, while the same
    observation still gives SLOMet (the metrics were read: the metrics alert stays quiet). Then an unknown
    GPU, then none named; then a known one, and it plans."""
    import logging

    from kubernetes import client

    exporter, prom = metrics_world
    caplog.set_level(logging.INFO, logger="disagg.planner")
    custom = client.CustomObjectsApi(api_client)
    doc = manifest(namespace)
    doc["spec"]["model"] = {"name": "my-finetune", "source": "pvc://models/my-finetune"}
    out = _kubectl_apply(cluster, doc)
    assert out.returncode == 0, out.stderr
    exporter.traffic = replace(exporter.traffic, rate=20.0, ttft=3.0, itl=0.2, prefill_waiting=10)
    source = PrometheusSource.for_endpoint(allowlist(prom).endpoints[ENDPOINT], timeout=3)
    wait_for(lambda: (lambda o: o.ttft and o.ttft > 2 and o.itl and o.itl > 0.1 and o.request_rate > 12)(
        source.observe(namespace, NAME, 90, 10)), 60, "breaching traffic in Prometheus", interval=0.5)
    metrics = PlannerMetrics()
    loop = PlannerLoop(planner_api, Executor(planner_api, metrics), lambda endpoint: source, allowlist(prom),
                       namespace=namespace, scrape_interval=parse_duration(prom.scrape_interval))
    lab = {"namespace": namespace, "deployment": NAME}

    [(_, _, held)] = loop.step(now=1000.0)
    assert held.reason == reasons.UNKNOWN_MODEL and not held.metrics_ok
    assert (held.prefill.replicas, held.decode.replicas) == (1, 1)
    assert "'pvc://models/my-finetune'" in held.message and "meta-llama/Llama-3.1-8B-Instruct" in held.message
    assert held.inputs["ttft"] > 2  # what was observed is shown, not planned on
    obj = _get(api_client, namespace)
    assert _replicas(obj) == (1, 1) and obj["status"]["planner"]["reason"] == reasons.UNKNOWN_MODEL
    cond = next(c for c in obj["status"]["conditions"] if c["type"] == "PlannerActive")
    assert cond["status"] == "False" and cond["reason"] == reasons.UNKNOWN_MODEL and "model unknown" in cond["message"]
    met = next(c for c in obj["status"]["conditions"] if c["type"] == "SLOMet")
    assert met["status"] == "False" and met["reason"] == reasons.BOTH_ABOVE
    warnings = client.CoreV1Api(api_client).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={NAME},type=Warning").items
    assert any(e.reason == reasons.UNKNOWN_MODEL for e in warnings)
    assert metrics.registry.get_sample_value(m.PLANNER_MODEL_KNOWN, lab) == 0
    assert metrics.registry.get_sample_value(m.PLANNER_METRICS_AVAILABLE, lab) == 1
    assert metrics.registry.get_sample_value(m.PLANNER_DECISIONS, {**lab, "role": "prefill", "direction": "hold",
                                                                   "reason": reasons.UNKNOWN_MODEL}) == 1
    said = [r for r in _planner_lines(caplog, logging.WARNING) if r.get("event") == "unplannable"]
    assert [(r["deployment"], r["reason"]) for r in said] == [(f"{namespace}/{NAME}", reasons.UNKNOWN_MODEL)]
    uid = obj["metadata"]["uid"]
    assert loop.state[uid].memory == dc.Memory()  # nothing learnt for a model it does not know

    def replan(now, patch):
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME, patch)
        [(_, _, d)] = loop.step(now=now)
        return d

    known_model = {"spec": {"model": {"name": "llama-3.1-8b", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"}}}
    d = replan(1010.0, {**known_model, "metadata": {"annotations": {GPU_ANNOTATION: "TPU-v5"}}})
    assert d.reason == reasons.UNKNOWN_GPU and "GPU 'TPU-v5' unknown" in d.message and d.prefill.replicas == 1
    d = replan(1020.0, {"metadata": {"annotations": {GPU_ANNOTATION: None}}})
    assert d.reason == reasons.UNKNOWN_GPU and "no GPU named" in d.message and d.prefill.replicas == 1
    assert metrics.registry.get_sample_value(m.PLANNER_MODEL_KNOWN, lab) == 0
    d = replan(1030.0, {"metadata": {"annotations": {GPU_ANNOTATION: "H100-SXM"}}})
    assert d.metrics_ok and d.prefill.replicas > 1 and d.decode.replicas > 1
    assert metrics.registry.get_sample_value(m.PLANNER_MODEL_KNOWN, lab) == 1
    cond = next(c for c in _get(api_client, namespace)["status"]["conditions"] if c["type"] == "PlannerActive")
    assert cond["status"] == "True"


def test_a_departed_deployment_leaves_the_planners_memory_and_metrics(cluster, api_client, crd_installed, namespace,
                                                                     planner_api):
    """Prometheus unreachable (a port nothing listens on), so each planned deployment's
    ``disagg_planner_metrics_available`` is 0: the condition of DisaggPlannerMetricsUnavailable. A deployment
    deleted, or no longer planned, must leave the loop's memory and take its series with it; the others stay."""
    from kubernetes import client

    custom = client.CustomObjectsApi(api_client)
    for name in (NAME, "other"):
        doc = manifest(namespace)
        doc["metadata"]["name"] = name
        out = _kubectl_apply(cluster, doc)
        assert out.returncode == 0, out.stderr
    metrics = PlannerMetrics()
    loop = PlannerLoop(planner_api, Executor(planner_api, metrics), PrometheusSource.for_endpoint,
                       Allowlist({ENDPOINT: Endpoint(ENDPOINT, "http://127.0.0.1:9")}), namespace=namespace)
    done = loop.step(now=1000.0)
    assert sorted((name, d.reason) for _, name, d in done) == [(NAME, reasons.PROMETHEUS_UNREACHABLE),
                                                                ("other", reasons.PROMETHEUS_UNREACHABLE)]
    uids = {o["metadata"]["name"]: o["metadata"]["uid"]
            for o in custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]}
    assert set(loop.state) == set(uids.values())

    def series(name):
        return sorted((s.name, tuple(sorted(s.labels.items()))) for f in metrics.registry.collect() for s in f.samples
                      if s.labels.get("namespace") == namespace and s.labels.get("deployment") == name)

    assert metrics.registry.get_sample_value(m.PLANNER_METRICS_AVAILABLE,
                                             {"namespace": namespace, "deployment": NAME}) == 0
    assert series(NAME) and series("other")

    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME)
    wait_for(lambda: NAME not in {o["metadata"]["name"] for o in custom.list_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL)["items"]}, 30, "the deployment deleted")
    assert loop.step(now=1001.0) == []  # (inside the interval: nothing planned, only listed)
    assert set(loop.state) == {uids["other"]} and series(NAME) == []
    assert metrics.registry.get_sample_value(m.PLANNER_METRICS_AVAILABLE,
                                             {"namespace": namespace, "deployment": "other"}) == 0

    # the planner switched off, spec.slo kept: latency is still reported, the sizing series go
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "other",
                                          {"spec": {"planner": {"enabled": False}}})
    [(_, _, verdict)] = loop.step(now=1010.0)
    assert isinstance(verdict, slo.Verdict) and series("other") == []
