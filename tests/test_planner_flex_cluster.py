"""The planner process driving a flex pool (spec.flex) on the local control plane: the operator (in this process,
under its own role) renders the pool and labels new flex pods; the planner loop, under the planner's own role,
reads the pods and a real Prometheus (scraping an exporter the test drives, in the routers' and engines' names)
and carries decide_flex out: a role switch as the pod's serving-role label, written before any replica count;
the pool grown (by a decision, and by the fast path between decisions) or shrunk as spec.flex.replicas, the
worker it removes marked so its ReplicaSet removes that one; a hold without metrics. Every decision's reason in
status, events and metrics. No engine runs here (kwok pods): tests/test_router_pd.py has the routers' drain and
flip on real engines.
"""

from dataclasses import replace

import pytest
from kubernetes import client

from disagg.api import metrics as m
from disagg.api.names import (ANNOTATION_POD_DELETION_COST, ANNOTATION_SERVING_ROLE_SINCE, LABEL_DEPLOYMENT,
                              LABEL_ROLE, LABEL_SERVING_ROLE, ROLE_FLEX)
from disagg.api.v1alpha1 import PLURAL, VERSION
from disagg.e2e.prometheus import scraped_exporter
from disagg.e2e.testing import GROUP, wait_for
from disagg.planner import reasons
from disagg.planner.apply import FIELD_MANAGER, REMOVE_COST, Executor, PlannerMetrics, owns_flex_replicas
from disagg.planner.endpoints import Allowlist, Endpoint
from disagg.planner.flex import SERVING, SWITCHING
from disagg.planner.loop import GPU_ANNOTATION, PlannerLoop
from disagg.planner.metrics_source import PrometheusSource, parse_duration

pytestmark = pytest.mark.cluster
NAME = "flexy"
ENDPOINT = "test"


def manifest(namespace):
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DisaggDeployment",
            "metadata": {"name": NAME, "namespace": namespace, "annotations": {GPU_ANNOTATION: "H100-SXM"}},
            "spec": {"model": {"name": "llama-3.1-8b", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
                     "prefill": {"replicas": 1, "maxReplicas": 1}, "decode": {"replicas": 1, "maxReplicas": 1},
                     "flex": {"replicas": 2, "minReplicas": 1, "maxReplicas": 6},
                     "slo": {"ttftMs": 1000, "itlMs": 50, "percentile": 90},
                     "planner": {"enabled": True, "intervalSeconds": 5, "gpuBudget": 16,
                                 "scaleDownCooldownSeconds": 60, "prometheus": ENDPOINT}}}


@pytest.fixture
def world(namespace, tmp_path):
    with scraped_exporter(namespace, NAME, tmp_path / "prometheus") as world:
        yield world


def flex_pods(core, namespace) -> dict[str, client.V1Pod]:
    return {p.metadata.name: p for p in core.list_namespaced_pod(
        namespace, label_selector=f"{LABEL_DEPLOYMENT}={NAME},{LABEL_ROLE}={ROLE_FLEX}").items
        if p.metadata.deletion_timestamp is None}


def roles(core, namespace) -> dict[str, str | None]:
    return {n: (p.metadata.labels or {}).get(LABEL_SERVING_ROLE) for n, p in flex_pods(core, namespace).items()}


def ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def test_the_planner_switches_flex_workers_before_it_scales_grows_and_shrinks_the_pool_and_holds_without_metrics(
        cluster, api_client, crd_installed, namespace, operator, planner_api, world):
    exporter, prom = world
    core, custom = client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest(namespace))
    get = lambda: custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME)  # noqa: E731
    # the operator's pool: two flex pods, ready, each given a role (one per role: the role fewer serve)
    wait_for(lambda: len(flex_pods(core, namespace)) == 2 and all(ready(p) for p in flex_pods(core, namespace).values())
             and sorted(map(str, roles(core, namespace).values())) == ["decode", "prefill"], 120, "the operator's flex pool")
    wait_for(lambda: (get().get("status") or {}).get("phase") == "Ready", 120, "the deployment Ready")
    before = roles(core, namespace)
    (decode_worker,) = [n for n, r in before.items() if r == "decode"]

    # prompt-heavy traffic: TTFT well over its target, ITL well under; the routers drain nothing
    exporter.traffic = replace(exporter.traffic, rate=15.0, ttft=3.0, itl=0.01, prefill_ttft=2.5, input_tokens=8000,
                               output_tokens=50, prefill_waiting=0,
                               flex_pods={n: (r, 3.0 if r == "decode" else 1.0) for n, r in before.items()})
    source = PrometheusSource.for_endpoint(Endpoint(ENDPOINT, prom.url), timeout=3)
    wait_for(lambda: (lambda o: o.ttft and o.ttft > 2 and 13 < o.request_rate < 17 and o.input_tokens_mean > 7900)(
        source.observe(namespace, NAME, 90, 5))
             and source.observe_flex(namespace, NAME).load.get(decode_worker) == 3.0, 60,
             "the traffic and the flex pods' load in Prometheus", interval=0.5)
    metrics = PlannerMetrics()
    loop = PlannerLoop(planner_api, Executor(planner_api, metrics), lambda endpoint: source,
                       Allowlist({ENDPOINT: Endpoint(ENDPOINT, prom.url)}), namespace=namespace,
                       scrape_interval=parse_duration(prom.scrape_interval))
    lab = {"namespace": namespace, "deployment": NAME}
    rv_before = int(get()["metadata"]["resourceVersion"])

    # 1. switch before scale: prefill is short and decode has a flex worker to spare: it switches, and no
    # replica is asked for (prefill's dedicated pool is at its maximum, the pool at two)
    [(_, _, decision)] = loop.step(now=1000.0)
    print("decision 1:", decision.reason, decision.message)
    assert decision.metrics_ok and decision.reason == reasons.ROLE_SWITCHED, decision.message
    assert "1 decode->prefill switched" in decision.message
    pods = flex_pods(core, namespace)
    assert roles(core, namespace) == {**before, decode_worker: "prefill"}
    switched = pods[decode_worker]
    assert switched.metadata.annotations[ANNOTATION_SERVING_ROLE_SINCE] == "1000"
    obj = get()
    assert obj["spec"]["flex"]["replicas"] == 2 and owns_flex_replicas(obj)
    # the label was written before the replicas (resource versions are etcd's revisions, in write order)
    assert rv_before < int(switched.metadata.resource_version) < int(obj["metadata"]["resourceVersion"])
    planner = obj["status"]["planner"]
    assert planner["reason"] == reasons.ROLE_SWITCHED and (planner["flexPrefill"], planner["flexDecode"]) == (2, 0)
    assert planner["flexReplicas"] == 2
    assert metrics.registry.get_sample_value(m.PLANNER_DECISIONS, {
        **lab, "role": "prefill", "direction": "up", "reason": reasons.ROLE_SWITCHED}) == 1
    assert metrics.registry.get_sample_value(m.PLANNER_FLEX_WORKERS, {**lab, "role": "prefill"}) == 2
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={NAME}").items
    assert any(e.reason == reasons.ROLE_SWITCHED and e.source.component == FIELD_MANAGER for e in events)
    # the operator sees the label change and reports it (its event, status.flex)
    wait_for(lambda: any(e.reason == "RoleSwitched" and decode_worker in e.message and "decode -> prefill" in e.message
                         for e in core.list_namespaced_event(namespace).items), 60, "the operator's RoleSwitched")
    wait_for(lambda: ((get().get("status") or {}).get("flex") or {}).get("prefill") == 2, 60, "status.flex")

    # 2. while its routers drain it, the worker is switching; a drain gauge at 0 is not the end (it reads 0
    # before a router has seen the label too): once they report no drain and their flip, the switch is counted
    exporter.traffic = replace(exporter.traffic, flex_draining={"decode": 1})
    wait_for(lambda: source.observe_flex(namespace, NAME).draining.get("decode") == 1, 30, "the drain in Prometheus",
             interval=0.5)
    state = loop.state[obj["metadata"]["uid"]]
    spec_now, target_now = _spec_and_target(get())
    pool = loop.flex_pool(get(), spec_now, target_now, state, 1002.0)
    assert {w.name: w.state for w in pool.target.workers}[decode_worker] == SWITCHING
    exporter.traffic = replace(exporter.traffic, flex_draining={})
    wait_for(lambda: not source.observe_flex(namespace, NAME).draining.get("decode"), 30, "the drain over",
             interval=0.5)
    pool = loop.flex_pool(get(), spec_now, target_now, state, 1003.0)
    assert {w.name: w.state for w in pool.target.workers}[decode_worker] == SWITCHING
    exporter.traffic = replace(exporter.traffic, flex_switched={("decode", "prefill"): 1})
    wait_for(lambda: source.observe_flex(namespace, NAME).flips("decode", "prefill") == (1, 0), 30,
             "the routers' flip in Prometheus", interval=0.5)
    pool = loop.flex_pool(get(), spec_now, target_now, state, 1003.0)
    assert {w.name: w.state for w in pool.target.workers}[decode_worker] == SERVING
    assert metrics.registry.get_sample_value(m.PLANNER_ROLE_SWITCHES, {
        **lab, "from_role": "decode", "to_role": "prefill", "outcome": m.SWITCH_SWITCHED}) == 1

    # 3. between decisions (the fast path), a prefill queue growing faster than its workers drain it: decode
    # keeps its one dedicated worker (the last decision's keep), so the pool grows by a prefill worker
    clock = iter(1001.0 + k / 100 for k in range(100_000))

    def reacted():
        exporter.traffic = replace(exporter.traffic, prefill_waiting=exporter.traffic.prefill_waiting + 20)
        return loop.react_one(get(), now=next(clock))

    fast = wait_for(reacted, 120, "the fast path's reaction", interval=0.5)
    print("fast path:", fast.reason, fast.message)
    n3 = get()["spec"]["flex"]["replicas"]
    assert fast.reason == reasons.FLEX_GROWN and f"new {n3 - 2} prefill)" in fast.message and n3 > 2, fast.message
    assert roles(core, namespace)[decode_worker] == "prefill"
    wait_for(lambda: len(flex_pods(core, namespace)) == n3 and all(roles(core, namespace).values()), 120,
             "the new flex pods, each given a role")
    # the operator gave each new pod the role the planner asked for (its split in status.planner), so the
    # planner has none to relabel: no pod it grew the pool by drains before it serves
    grown = {n: p for n, p in flex_pods(core, namespace).items() if n not in before}
    assert len(grown) == n3 - 2 and {roles(core, namespace)[n] for n in grown} == {"prefill"}
    assert not any(ANNOTATION_SERVING_ROLE_SINCE in (p.metadata.annotations or {}) for p in grown.values())
    wait_for(lambda: all(any(n in e.message and "the planner's split of the pool" in e.message
                             for e in core.list_namespaced_event(namespace).items if e.reason == "FlexRoleAssigned")
                         for n in grown), 30, "the operator's FlexRoleAssigned events, by the planner's split")
    exporter.traffic = replace(exporter.traffic, prefill_waiting=0)

    # 4. both roles busy: no flex worker to spare (decode has none; the one that just switched does not switch
    # back within its dwell, prefill keeps all it has): the pool grows, for decode, and the new pods start in it
    exporter.traffic = replace(exporter.traffic, itl=0.2, output_tokens=400)
    wait_for(lambda: (lambda o: o.itl and o.itl > 0.1 and o.output_tokens_mean > 390)(
        source.observe(namespace, NAME, 90, 5)), 60,
             "decode's ITL over its target in Prometheus", interval=0.5)
    [(_, _, decision)] = loop.step(now=1010.0)
    print("decision 4:", decision.reason, decision.message)
    n4 = get()["spec"]["flex"]["replicas"]
    assert decision.reason == reasons.FLEX_GROWN and n4 > n3 and f"new {n4 - n3} decode)" in decision.message, \
        decision.message
    assert list(roles(core, namespace).values()).count("prefill") == n3
    assert metrics.registry.get_sample_value(m.PLANNER_DECISIONS, {
        **lab, "role": "flex", "direction": "up", "reason": reasons.FLEX_GROWN}) == 2
    # (ready: a ReplicaSet removes a pod that is not before any other, whatever its deletion cost)
    wait_for(lambda: len(flex_pods(core, namespace)) == n4 and all(roles(core, namespace).values())
             and all(ready(p) for p in flex_pods(core, namespace).values()), 120, "the new flex pods, ready")
    grown4 = {n: p for n, p in flex_pods(core, namespace).items() if n not in before and n not in grown}
    assert {roles(core, namespace)[n] for n in grown4} == {"decode"}
    assert not any(ANNOTATION_SERVING_ROLE_SINCE in (p.metadata.annotations or {}) for p in grown4.values())
    # nor did the planner's pass relabel them, or the fast path's
    assert not any(ANNOTATION_SERVING_ROLE_SINCE in (p.metadata.annotations or {})
                   for n, p in flex_pods(core, namespace).items() if n not in before)

    # 5. Prometheus gone: the planner holds (no switch, no size change) and says so
    labelled = roles(core, namespace)
    prom.stop()
    [(_, _, held)] = loop.step(now=1020.0)
    assert held.reason == reasons.PROMETHEUS_UNREACHABLE and not held.metrics_ok
    obj = get()
    assert obj["spec"]["flex"]["replicas"] == n4 and roles(core, namespace) == labelled
    assert obj["status"]["planner"]["reason"] == reasons.PROMETHEUS_UNREACHABLE
    active = next(c for c in obj["status"]["conditions"] if c["type"] == "PlannerActive")
    assert active["status"] == "False" and "unreachable" in active["message"]
    assert metrics.registry.get_sample_value(m.PLANNER_METRICS_AVAILABLE, lab) == 0

    # 6. both roles idle, past the cooldown: the pool shrinks first, down to its minimum; the worker removed is
    # the one the planner chose (its deletion cost), not the ReplicaSet's pick
    prom.start()
    exporter.traffic = replace(exporter.traffic, rate=0.5, ttft=0.1, itl=0.01, prefill_ttft=0.1, output_tokens=50,
                               input_tokens=200, prefill_waiting=0, decode_waiting=0)
    wait_for(lambda: (lambda o: o.ttft and o.ttft < 0.5 and o.itl and o.itl < 0.05 and o.request_rate < 1)(
        source.observe(namespace, NAME, 90, 5)), 90, "idle traffic in Prometheus", interval=0.5)
    now, shrunk = 1100.0, None
    for _ in range(40):   # the load history's peak ages out interval by interval
        [(_, _, shrunk)] = loop.step(now=now)
        if shrunk.reason == reasons.FLEX_SHRUNK:
            break
        now += 5.0
    print("decision 6:", shrunk.reason, shrunk.message)
    assert shrunk.reason == reasons.FLEX_SHRUNK, shrunk.message
    fd = state.last_flex
    assert fd.remove and get()["spec"]["flex"]["replicas"] == n4 - len(fd.remove) >= 1
    marked = {n for n, p in flex_pods(core, namespace).items()
              if (p.metadata.annotations or {}).get(ANNOTATION_POD_DELETION_COST) == REMOVE_COST}
    assert marked == set(fd.remove)
    wait_for(lambda: not set(fd.remove) & set(flex_pods(core, namespace)) and
             len(flex_pods(core, namespace)) == n4 - len(fd.remove), 120, "the marked workers removed, the others kept")
    assert metrics.registry.get_sample_value(m.PLANNER_DECISIONS, {
        **lab, "role": "flex", "direction": "down", "reason": reasons.FLEX_SHRUNK}) == 1


def _spec_and_target(obj):
    from disagg.api.v1alpha1 import DisaggDeploymentSpec
    from disagg.planner.decide import Target
    from disagg.planner.loop import readiness

    spec = DisaggDeploymentSpec.model_validate(obj["spec"])
    is_ready, rolling = readiness(obj)
    return spec, Target.from_spec(spec, ready=is_ready, rolling=rolling)


def test_a_switch_keeps_its_event_when_the_status_write_after_its_label_fails(api_client, crd_installed, namespace,
                                                                               planner_api):
    """The labels are the switch (the routers act on them): when the planner's status write after them fails,
    the switch's RoleSwitched event is there all the same, and the next pass, seeing the roles already given,
    has nothing left to report it by. The failure is real: a ValidatingAdmissionPolicy refuses the planner's
    status writes to this namespace. No operator runs: the flex pods are made by hand (kwok nodes, no engine)."""
    from disagg.planner.decide import Decision, RoleDecision, Target
    from disagg.planner.flex import FlexDecision, FlexTarget, FlexWorker
    from disagg.planner.apply import FlexPool
    from disagg.planner.metrics_source import FlexSignals
    from disagg.e2e.operator_fixture import NAMESPACE, PLANNER_ACCOUNT

    core, custom = client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
    admission = client.AdmissionregistrationV1Api(api_client)
    body = manifest(namespace)
    body["metadata"]["name"] = "eventful"
    obj = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    for i, role in enumerate(("decode", "prefill")):
        core.create_namespaced_pod(namespace, {"metadata": {"name": f"eventful-flex-{i}", "labels": {
            LABEL_DEPLOYMENT: "eventful", LABEL_ROLE: ROLE_FLEX, LABEL_SERVING_ROLE: role}},
            "spec": {"schedulerName": "none", "containers": [{"name": "engine", "image": "engine"}]}})
    pods = {p.metadata.name: p for p in core.list_namespaced_pod(namespace).items}
    planner_user = f"system:serviceaccount:{NAMESPACE}:{PLANNER_ACCOUNT}"
    policy = f"deny-planner-status-{namespace[-6:]}"   # (the namespace's name ends in its test's digest)
    admission.create_validating_admission_policy({"metadata": {"name": policy}, "spec": {
        "failurePolicy": "Fail",
        "matchConstraints": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                             "resourceRules": [{"apiGroups": [GROUP], "apiVersions": ["*"], "operations": ["UPDATE"],
                                                "resources": ["disaggdeployments/status"]}]},
        "validations": [{"expression": f"request.userInfo.username != '{planner_user}'",
                         "message": "this test refuses the planner's status writes"}]}})
    admission.create_validating_admission_policy_binding({"metadata": {"name": policy}, "spec": {
        "policyName": policy, "validationActions": ["Deny"]}})
    try:
        planner_custom = client.CustomObjectsApi(planner_api)
        probe = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DisaggDeployment",
                 "metadata": {"name": "eventful", "namespace": namespace}, "status": {"planner": {"reason": "Probe"}}}

        def refused():
            try:
                planner_custom.patch_namespaced_custom_object_status(
                    GROUP, VERSION, namespace, PLURAL, "eventful", probe, field_manager=FIELD_MANAGER, force=True,
                    _content_type="application/apply-patch+yaml")
            except client.ApiException as e:
                return e.status in (403, 422) and "ValidatingAdmissionPolicy" in (e.body or "")
            return False

        wait_for(refused, 30, "the planner's status writes refused")
        steady = RoleDecision(1, 1, reasons.STEADY)
        decision = Decision(steady, steady, reasons.ROLE_SWITCHED, "1 decode->prefill switched", True)
        target = Target(prefill=1, decode=1, ttft_target=1.0, itl_target=0.05)
        fd = FlexDecision(decision, 1, 1, roles=(("eventful-flex-0", "prefill"), ("eventful-flex-1", "prefill")),
                          switches=(("eventful-flex-0", "decode", "prefill"),), reason=reasons.ROLE_SWITCHED,
                          message=decision.message)
        workers = (FlexWorker("eventful-flex-0", "decode"), FlexWorker("eventful-flex-1", "prefill"))
        pool = FlexPool(FlexTarget(target, workers, 1, 6), pods, FlexSignals(), 2)
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "eventful")
        with pytest.raises(client.ApiException) as refusal:
            Executor(planner_api).apply(obj, decision, target, flex=(fd, pool), now=1000.0)
        assert "this test refuses" in refusal.value.body
        assert (core.read_namespaced_pod("eventful-flex-0", namespace).metadata.labels[LABEL_SERVING_ROLE]
                == "prefill")
        events = [e for e in core.list_namespaced_event(namespace, field_selector="involvedObject.name=eventful").items
                  if e.reason == reasons.ROLE_SWITCHED and e.source.component == FIELD_MANAGER]
        assert len(events) == 1 and "eventful-flex-0: decode -> prefill" in events[0].message, events
    finally:
        admission.delete_validating_admission_policy_binding(policy)
        admission.delete_validating_admission_policy(policy)
