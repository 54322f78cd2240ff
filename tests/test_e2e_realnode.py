"""End to end on the local cluster's real node (kubelet + containerd + runc), with the images the
Dockerfile builds (BuildKit, no Docker daemon): what a user runs, nothing configured by hand.

- `helm install` of charts/disagg: the operator runs as a pod from the control-plane image under the
  chart's ServiceAccount;
- a DisaggDeployment of the tiny model (a pvc:// source on a hostPath volume): prefill and decode pods
  from the CPU worker image, the router pod from the control-plane image, all Ready through their real
  probes, all as the operator renders them;
- the official `openai` client through the deployment's Service: chat and completions, streamed and
  not, on the remote_prefill path, with NIXL bytes moved between the two pods;
- LoRA adapters declared in that deployment's spec (a claim of adapter files, as the model's): the router pod
  loads them into both worker pods and reports them in status.adapters, the client's answers with one differ
  from the base model's on the same P/D path; one added to and removed from the live spec is served and then
  refused (404) with no pod restarted;
- the same through a gateway: the deployment runs its router in picker mode, the chart installed the
  InferencePool CRD, and an Envoy reads the operator's InferencePool as a gateway would, asks the router
  pod's endpoint picker for each request and carries the decode pod's stream itself;
- a real Prometheus discovers the pods through the chart's monitors (Kubernetes service discovery
  against this API server, relabelled as the Prometheus Operator would) and every dashboard panel
  has data;
- the P/D deployment grown to two decodes: a decode container crashed (SIGKILL) under load is covered by the
  router's decode retry (counted; the retry prefills locally) and restarted in place;
- the P/D deployment scaled from 2 prefill + 2 decode to 1 + 1 under steady streaming load fails nothing: the
  removed decode's streams in flight run to their length.

The scenarios above share the one P/D deployment: each further deployment costs two or more CPU engine starts
(the aggregated path, disaggregation "never", is served by real engines in tests/test_router_kv.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from kubernetes import client

from disagg.api import contract
from disagg.api import metrics as m
from disagg.api.names import LABEL_DEPLOYMENT, LABEL_ROLE
from disagg.e2e import dashboards, monitoring, realnode
from disagg.e2e.localcluster.node import NODE_NAME
from disagg.e2e.prometheus import LocalPrometheus
from disagg.e2e.providers import CHART
from disagg.e2e.testing import DD, wait_for
from disagg.router import adapters as lora
from disagg.workers.local import metric_sum, scrape

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3000)]

RELEASE, RELEASE_NS = "disagg", "disagg-system"
NS = "serving"
PD = "tiny-pd"
# Panels whose data needs an event this module does not make, each checked where it is made.
_PLANNER = "the planner is off in this release; tests/test_dashboards.py checks it against the real planner"
_OPERATOR = ("a gang placed and a hand edit reverted inside the window; tests/test_e2e_helm.py queries the "
             "Operator row while it makes both")
NOT_HERE = {
    "Desired replicas": _PLANNER, "Decisions by direction": _PLANNER, "Decisions by reason": _PLANNER,
    "Metrics available": _PLANNER, "TTFT: observed and target": _PLANNER, "ITL: observed and target": _PLANNER,
    "Request rate: predicted and observed": _PLANNER, "Replicas: desired and ready": _PLANNER,
    "Gang wait": _OPERATOR, "API writes and reverted hand edits": _OPERATOR,
    "Fallbacks by reason": "no fallback on a healthy pair; tests/test_dashboards.py and the decode kill below make them",
    # issue 12's failure-only router panels: a healthy deployment makes none of these series
    "Migrations by outcome": "no decode stream fails mid-way on a healthy pair; tests/test_dashboards.py cuts one",
    "Pairing refusals by reason": "only when no KV revision has a ready pair (a stuck rollout); "
                                  "tests/test_router_pairing.py counts one",
    "KV index resyncs": "none while the router hears every KV event from the start (it subscribes before any "
                        "traffic); only lost events or a restarted engine make one; tests/test_dashboards.py "
                        "starts its router late (a join)",
}
PROMPT = realnode.PROMPT
# LoRA adapters of the tiny model: LORA declared from the pd deployment's creation, LORA_LIVE added to and removed
# from its live spec (tests below)
LORA, LORA_LIVE = "tiny-lora", "tiny-lora-live"


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from disagg.e2e.localcluster import LocalCluster

    c = LocalCluster(f"real-{os.getpid()}", state_dir=tmp_path_factory.mktemp("real"), real_node=True)
    c.up()
    yield c
    c.down()


@pytest.fixture(scope="module")
def api(real):
    from kubernetes import config

    a = config.new_client_from_config(str(real.kubeconfig))
    yield a
    a.close()


@pytest.fixture(scope="module")
def images(real):
    from disagg.e2e.images import ensure_images

    return ensure_images(real.node.containerd_socket)


@pytest.fixture(scope="module")
def enforced(real):
    """kube-router's firewall (e2e/localcluster/netpol.py) enforcing every NetworkPolicy from before the
    chart's install to the module's end: every deployment below serves through the policy the operator
    writes for it (router to workers, NIXL and torch.distributed between its workers, Prometheus to the
    metrics port), not beside it. tests/test_real_node.py proves what the policy refuses."""
    from disagg.e2e.localcluster.netpol import NetworkPolicyEnforcer

    e = NetworkPolicyEnforcer(real).start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def release(real, api, images, enforced):
    """The chart as a user installs it, operator pod included, under an enforced network policy."""
    realnode.helm(real, "install", RELEASE, str(CHART), "--namespace", RELEASE_NS, "--create-namespace",
                  "--wait", "--timeout", "5m", *realnode.chart_values(images["control-plane"]))
    yield
    realnode.helm(real, "uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait", "--timeout", "5m")


@pytest.fixture(scope="module")
def serving_ns(api, release, real, tiny_model):
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": NS}})
    wait_for(lambda: any(sa.metadata.name == "default" for sa in core.list_namespaced_service_account(NS).items),
             30, "default ServiceAccount")
    source = realnode.install_model(api, NS, tiny_model)
    yield source
    core.delete_namespace(NS)
    wait_for(lambda: not core.list_namespaced_pod(NS).items, 300, f"pods of {NS} gone")
    realnode.remove_model(api, NS)


@pytest.fixture(scope="module")
def node_adapters(api, serving_ns, tiny_model, tmp_path_factory):
    """Two LoRA adapters of the tiny model (workers/tinyadapter.py, different seeds) on the real node, reaching
    the pods as the model does: a hostPath volume bound to the claim ADAPTER_CLAIM. Name -> pvc:// source."""
    from disagg.workers.tinyadapter import make_adapter

    # a folder of its own (mode 0755): the pods' non-root user lists it where it is mounted
    root = tmp_path_factory.mktemp("node-adapters") / "adapters"
    for sub, seed in (("one", 7), ("two", 11)):
        make_adapter(Path(tiny_model), root / sub, seed=seed)
    source = realnode.install_model(api, NS, root, claim=realnode.ADAPTER_CLAIM)
    yield {LORA: f"{source}/one", LORA_LIVE: f"{source}/two"}
    # the claim goes with the namespace (serving_ns); the volume's protection finalizer holds it until then
    realnode.remove_model(api, NS, claim=realnode.ADAPTER_CLAIM)


@pytest.fixture(scope="module")
def node_jaeger(real, tmp_path_factory):
    """A real Jaeger on this host whose OTLP receivers listen on the real node's bridge address, where the
    pods reach the host (their NetworkPolicy leaves egress open); its query API on loopback."""
    from disagg.e2e.jaeger import LocalJaeger
    from disagg.e2e.localcluster.controlplane import NODE_IP

    j = LocalJaeger(tmp_path_factory.mktemp("node-jaeger"), otlp_host=NODE_IP).start()
    yield j
    j.stop()


@pytest.fixture(scope="module")
def pd(api, serving_ns, images, node_jaeger, node_adapters):
    """The P/D deployment, traced from its creation (spec.tracing, so no rollout later): sampling ratio 0, so
    the other tests' requests make no spans; a request whose client sends a sampled traceparent is traced
    by the router and both engines (parent-based sampling). LoRA on from its creation, with one adapter
    declared (the adapters' claim mounted from the start, so the adapter tests roll nothing): the other
    tests serve the base model through engines that can also serve adapters, as a user's would."""
    from disagg.workers.tinyadapter import ADAPTER_RANK

    manifest = realnode.deployment(PD, serving_ns, images["worker-cpu"], router_mode="picker")
    manifest["spec"]["tracing"] = {"otlpEndpoint": node_jaeger.otlp_endpoint, "samplingRatio": 0.0}
    manifest["spec"]["model"].update({"maxLoras": 2, "maxLoraRank": ADAPTER_RANK,
                                      "adapters": [{"name": LORA, "source": node_adapters[LORA]}]})
    dd = DD(api, NS, manifest)
    try:
        dd.wait_phase("Ready", timeout=900)
    except AssertionError as e:   # the operator's and the pods' logs are gone once the cluster is down
        raise AssertionError(realnode.pod_logs(api, RELEASE_NS, "") + "\n" + realnode.pod_logs(api, NS, "")) from e
    url = realnode.router_url(api, NS, PD)
    realnode.wait_serving(api, NS, PD)
    yield dd, url
    _delete(api, dd)


def _delete(api, dd: DD) -> None:
    """Delete the DisaggDeployment (if still there) and wait until its pods are gone."""
    from kubernetes.client.exceptions import ApiException

    try:
        client.CustomObjectsApi(api).delete_namespaced_custom_object("serving.disagg.dev", "v1alpha1", NS,
                                                                     "disaggdeployments", dd.name)
    except ApiException as e:
        if e.status != 404:
            raise
    wait_for(lambda: not dd.pods(), 300, f"{dd.name}'s pods gone")


def _route(headers) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith("x-disagg-")}


def _pod_url(pod: client.V1Pod, port: int = 8000) -> str:
    return f"http://{pod.status.pod_ip}:{port}"


def test_operator_runs_from_the_image_under_the_charts_account(api, release, images, real):
    pods = client.CoreV1Api(api).list_namespaced_pod(RELEASE_NS, label_selector="app.kubernetes.io/component="
                                                                                 "operator").items
    assert len(pods) == 1
    pod = pods[0]
    assert pod.spec.node_name == NODE_NAME
    assert pod.spec.containers[0].image == images["control-plane"]
    assert pod.spec.service_account_name == RELEASE  # the chart's ServiceAccount (release name)
    assert all(c.ready for c in pod.status.container_statuses)


def test_pods_run_the_built_images_and_are_ready_through_their_probes(api, pd, images, real):
    dd, _ = pd
    for role, image in (("prefill", images["worker-cpu"]), ("decode", images["worker-cpu"]),
                        ("router", images["control-plane"])):
        pods = dd.pods(role)
        assert len(pods) == 1, (role, [p.metadata.name for p in pods])
        pod = pods[0]
        assert pod.spec.node_name == NODE_NAME
        assert pod.spec.containers[0].image == image
        assert pod.spec.containers[0].readiness_probe, role
        assert all(c.ready for c in pod.status.container_statuses), role


def test_openai_client_chat_and_completions_take_the_remote_prefill_path(api, pd):
    dd, url = pd
    _served_on_the_remote_prefill_path(dd, url)


def _nixl_bytes(decode: client.V1Pod) -> float:
    return realnode.nixl_bytes(_pod_url(decode, contract.WORKER_METRICS_PORT))


def _served_on_the_remote_prefill_path(dd: DD, url: str) -> list[dict]:
    """Chat and completions, streamed and not, through ``url``: every one on the remote_prefill path, with
    NIXL bytes counted on the decode pod (e2e/realnode.py, shared with the kind provider's suite)."""
    decode = dd.pods("decode")[0]
    return realnode.served_on_the_remote_prefill_path(url, _pod_url(decode, contract.WORKER_METRICS_PORT))


# ---------------------------------------------------------------- LoRA adapters (spec.model.adapters)
def _models(url: str) -> list[str]:
    """The models a router or a worker lists on /v1/models (``url``: …/v1)."""
    with urllib.request.urlopen(f"{url}/models", timeout=30) as r:
        return [c["id"] for c in json.loads(r.read())["data"]]


def _adapter_status(dd: DD, name: str) -> dict | None:
    return next((a for a in dd.status().get("adapters") or [] if a["name"] == name), None)


def _ready_on_both(dd: DD, name: str) -> bool:
    """status.adapters counts ``name`` loaded and ready on the one prefill and the one decode worker."""
    a = _adapter_status(dd, name)
    return bool(a and a.get("ready") and (a.get("prefill"), a.get("decode")) == (1, 1) and not a.get("message"))


def _observed(dd: DD) -> bool:
    """The operator has reconciled the spec as it is now (a rollout it would start is under way by then)."""
    obj = dd.get()
    return (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]


def _worker_urls(dd: DD) -> list[str]:
    return [_pod_url(p) + "/v1" for role in ("prefill", "decode") for p in dd.pods(role)]


def _complete(url: str, model: str, prompt: str) -> tuple[str, dict[str, str]]:
    """A completion of 8 tokens at temperature 0 with the official client (EOS ignored): its text and route."""
    import openai

    oa = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    raw = oa.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True})
    return raw.parse().choices[0].text, _route(raw.headers)


def _served_with_adapter(dd: DD, url: str, adapter: str, prompt: str) -> str:
    """``adapter``'s completion of ``prompt`` through the deployment's Service: on the remote_prefill path between
    the deployment's two worker pods with NIXL bytes moved, and different from the base model's. Its text."""
    prefill, decode = dd.pods("prefill")[0], dd.pods("decode")[0]
    before = _nixl_bytes(decode)
    text, route = _complete(url, adapter, prompt)
    assert route.get("x-disagg-path") == m.PATH_REMOTE_PREFILL and route.get("x-disagg-adapter") == adapter, route
    assert (route["x-disagg-prefill"], route["x-disagg-decode"]) == (_pod_url(prefill), _pod_url(decode)), route
    wait_for(lambda: _nixl_bytes(decode) > before, 60, "NIXL bytes counted on the decode pod")
    base, route = _complete(url, realnode.SERVED_MODEL, prompt)
    assert route.get("x-disagg-path") == m.PATH_REMOTE_PREFILL and "x-disagg-adapter" not in route, route
    assert text != base, (text, base)
    return text


def test_an_adapter_declared_in_the_spec_is_loaded_into_both_pods_and_served_pd(api, pd):
    """spec.model.adapters from the deployment's creation: the router pod loads the adapter into the prefill
    and the decode pod (from the adapters' claim the operator mounted), status.adapters counts it ready on each
    role, /v1/models lists it, and the official client at temperature 0 gets other tokens with it than without
    it, on the remote_prefill path with NIXL bytes moved; the decode pod asked directly (one engine running the
    prefill and the decode with the adapter) gives the same tokens as the pair, and its engine reports the
    adapter in vllm:lora_requests_info, the router's lora_affinity input."""
    dd, url = pd
    wait_for(lambda: _ready_on_both(dd, LORA), 300, f"status.adapters: {LORA} ready on the prefill and the decode")
    assert _models(url) == [realnode.SERVED_MODEL, LORA]
    for worker in _worker_urls(dd):                 # loaded into each engine, as the engine itself lists it
        assert LORA in _models(worker), worker
    prompt = PROMPT + "adapter"
    text = _served_with_adapter(dd, url, LORA, prompt)
    decode = _pod_url(dd.pods("decode")[0])
    alone, _ = _complete(decode + "/v1", LORA, prompt)
    assert text == alone
    # the engine reports its adapters' requests where the router reads its lora_affinity queue from
    with urllib.request.urlopen(f"{decode}/metrics", timeout=30) as r:
        reported = lora.lora_requests(r.read().decode())
    assert reported is not None and reported[0] | reported[1] <= {LORA}, reported


def test_an_adapter_added_live_serves_with_no_restart_and_removed_gets_a_404(api, pd, node_adapters):
    """An adapter added to the live spec is loaded into the running pods (the same pod uids, no container
    restarted, no rollout), status.adapters shows it ready per role and the client is served with it on the P/D
    path; removed from the spec, it is unloaded from both engines, dropped from status.adapters and /v1/models,
    and a request naming it gets an OpenAI-style 404, never the base model's answer."""
    import openai

    dd, url = pd

    def pods() -> dict[str, int]:      # pod uid -> restarts of its containers, router included
        return {p.metadata.uid: sum(c.restart_count for c in p.status.container_statuses or []) for p in dd.pods()}

    before = pods()
    oa = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    prompt = PROMPT + "live adapter"
    declared = [{"name": LORA, "source": node_adapters[LORA]}]
    dd.patch_spec({"model": {"adapters": [*declared, {"name": LORA_LIVE, "source": node_adapters[LORA_LIVE]}]}})
    wait_for(lambda: _ready_on_both(dd, LORA_LIVE), 120, f"status.adapters: {LORA_LIVE} ready on both roles")
    assert _observed(dd) and pods() == before
    assert _models(url) == [realnode.SERVED_MODEL, LORA, LORA_LIVE]
    live = _served_with_adapter(dd, url, LORA_LIVE, prompt)
    assert live != _complete(url, LORA, prompt)[0]          # its own weights, not the other adapter's

    dd.patch_spec({"model": {"adapters": declared}})
    wait_for(lambda: _adapter_status(dd, LORA_LIVE) is None and LORA_LIVE not in _models(url)
             and all(LORA_LIVE not in _models(w) for w in _worker_urls(dd)), 120,
             f"{LORA_LIVE} unloaded from both pods and gone from status.adapters and the router's /v1/models")
    with pytest.raises(openai.NotFoundError) as e:
        oa.completions.create(model=LORA_LIVE, prompt=prompt, max_tokens=8, temperature=0)
    assert e.value.status_code == 404 and f"`{LORA_LIVE}`" in str(e.value), e.value
    assert (e.value.body or {}).get("param") == "model", e.value.body
    wait_for(lambda: _observed(dd), 60, "the operator observing the spec")
    assert pods() == before
    assert _ready_on_both(dd, LORA)                       # the other adapter untouched


# the client's TTFT against the router's time to its first token (kube-proxy's hop and the client
# library's parsing lie outside the router's spans), and the router's spans up to the first token against
# the router's own TTFT (event-loop hops between them, on a loaded 2-core machine)
CLIENT_TOLERANCE_S, SPANS_TOLERANCE_S = 0.5, 0.25


def test_one_request_is_one_trace_in_jaeger_across_router_prefill_and_decode_pods(pd, node_jaeger):
    """One streamed request with the official client through the deployment's Service, sending a sampled
    W3C traceparent (the deployment samples at ratio 0): Jaeger, queried through its API by the trace id the
    router returned in x-disagg-trace-id, holds one trace with the router's spans under the client's span
    and vLLM's llm_request span of the prefill pod under the router's prefill span and of the decode pod
    under its decode span. The router's admission, tokenize, routing, prefill and first-token spans add up
    to its time to first token, which is the client's TTFT less the way in and out."""
    import secrets

    import openai

    from disagg.e2e.jaeger import spans_by_name
    from disagg.router import tracing as t

    dd, url = pd
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    oa = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    t0 = time.monotonic()
    with oa.completions.with_streaming_response.create(
            model=realnode.SERVED_MODEL, prompt=PROMPT + "traced", max_tokens=8, temperature=0, stream=True,
            extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"}) as r:
        chunks = iter(r.parse())
        first = next(chunks)
        ttft = time.monotonic() - t0
        rest = list(chunks)
        route = _route(r.headers)
    assert first.choices and rest
    assert route["x-disagg-path"] == m.PATH_REMOTE_PREFILL and route[t.TRACE_ID_HEADER] == trace_id

    def whole():
        tr = node_jaeger.trace(trace_id)
        by = spans_by_name(tr) if tr else {}
        return tr if len(by.get("llm_request", [])) >= 2 and t.REQUEST in by and t.FIRST_TOKEN in by else None
    # the router's and vLLM's exporters send in batches (every 5 s); vLLM's span at the request's end
    trace = wait_for(whole, 120, f"trace {trace_id} with the router's and both engines' spans")
    by = spans_by_name(trace)
    root = by[t.REQUEST][0]
    # the trace as the README's walk-through reads it (pytest -s shows it)
    print(f"\nclient TTFT {ttft * 1000:.1f} ms; trace {trace_id}:")
    for s in sorted((s for spans in by.values() for s in spans), key=lambda s: s["startTime"]):
        print(f"  {s['service']:14} {s['operationName']:12} +{(s['startTime'] - root['startTime']) / 1000:8.1f} ms "
              f"{s['duration'] / 1000:8.1f} ms")
    assert root["service"] == "disagg-router" and root["parent"] == client_span
    for name in (t.ADMISSION, t.TOKENIZE, t.ROUTING, t.PREFILL, t.DECODE):
        assert [s["parent"] for s in by[name]] == [root["spanID"]], name
    (first_token,) = by[t.FIRST_TOKEN]
    assert first_token["parent"] == by[t.DECODE][0]["spanID"]
    llm = {s["service"]: s for s in by["llm_request"]}
    assert set(llm) == {"vllm-prefill", "vllm-decode"}, list(llm)
    assert llm["vllm-prefill"]["parent"] == by[t.PREFILL][0]["spanID"]
    assert llm["vllm-decode"]["parent"] == by[t.DECODE][0]["spanID"]
    # Jaeger's times are microseconds
    router_ttft = (first_token["startTime"] + first_token["duration"] - root["startTime"]) / 1e6
    assert 0 < router_ttft <= ttft and ttft - router_ttft < CLIENT_TOLERANCE_S, (router_ttft, ttft)
    parts = sum(by[n][0]["duration"] for n in (t.ADMISSION, t.TOKENIZE, t.ROUTING, t.PREFILL)) / 1e6 + \
        first_token["duration"] / 1e6
    assert parts <= router_ttft + 0.001 and router_ttft - parts < SPANS_TOLERANCE_S, (parts, router_ttft)
    # the prefill pod's own queue and prefill time lie inside the router's prefill span
    tags = {tag["key"]: tag["value"] for tag in llm["vllm-prefill"]["tags"]}
    engine = tags["gen_ai.latency.time_in_queue"] + tags["gen_ai.latency.time_in_model_prefill"]
    assert 0 < engine <= by[t.PREFILL][0]["duration"] / 1e6, (engine, by[t.PREFILL][0]["duration"])


def test_through_envoy_and_the_picker_the_decode_pod_streams_to_the_client(api, pd, tmp_path):
    """The deployment in picker mode behind a gateway: Envoy (on this host, as e2e/gateway.py configures it)
    reads the InferencePool the operator wrote as a gateway would (its picker Service, its decode pods at
    its target port, its failure mode), asks the router pod's picker for each request, and carries the
    decode pod's answer itself; the picker ran the prefill on the prefill pod, and NIXL moved the KV."""
    from disagg.e2e.gateway import Envoy, pool_endpoints
    from disagg.workers.local import free_port

    dd, _ = pd
    pool = wait_for(lambda: pool_endpoints(api, NS, PD), 60, "the deployment's InferencePool")
    decode = dd.pods("decode")[0]
    assert pool.endpoints == [f"{decode.status.pod_ip}:{contract.HTTP_PORT}"]
    with Envoy(tmp_path / "envoy", port=free_port(), admin_port=free_port(), picker=pool.picker,
               pool=pool.endpoints, failure_mode=pool.failure_mode) as envoy:
        routes = _served_on_the_remote_prefill_path(dd, f"{envoy.url}/v1")
        # Envoy opened the decode pod itself, once per request: the streams never passed the router
        assert envoy.stats("cluster.picked.upstream_rq_completed")["cluster.picked.upstream_rq_completed"] == 4
    assert {r["x-disagg-decode"] for r in routes} == {_pod_url(decode)}


def test_the_deployment_serves_under_its_enforced_network_policy(api, pd, enforced):
    """The operator's policy is in force (kube-router made a chain for it and one per worker pod it
    guards) while the P/D path above served, NIXL included; a request through the router still does."""
    from disagg.e2e.localcluster import netpol

    dd, url = pd
    policies = client.NetworkingV1Api(api).list_namespaced_network_policy(NS).items
    # picker mode adds the gateway's way in: to the decode port, and to the router's picker port
    assert sorted(p.metadata.name for p in policies if p.metadata.name.startswith(PD)) == [
        f"{PD}-gateway", f"{PD}-router", f"{PD}-workers"]
    chains = wait_for(lambda: (c := netpol.own_chains()) and any("KUBE-POD-FW-" in x for x in c) and c, 60,
                      "kube-router's chains for the policy and the pods it guards")
    assert any("KUBE-NWPLCY-" in c and not c.endswith("KUBE-NWPLCY-DEFAULT") for c in chains), chains
    assert sum("KUBE-POD-FW-" in c for c in chains) >= 2, chains   # prefill and decode, at least
    assert _unary(url, PROMPT + " under policy", 4), enforced.tail()


def test_probe_endpoints_answer_on_the_pod_ips(pd):
    dd, _ = pd
    for role in ("prefill", "decode", "router"):
        pod = dd.pods(role)[0]
        with urllib.request.urlopen(_pod_url(pod) + "/health", timeout=10) as r:
            assert r.status == 200, role


def test_prometheus_discovers_the_pods_and_every_panel_has_data(api, pd, real, tmp_path):
    dd, url = pd
    # the chart's monitors and rules at a few seconds, not their production 15-30 s: the panels then fill
    # after a few scrapes instead of a minute's (what is checked is the same objects and queries)
    fast = [f"monitoring.{v}=3s" for v in ("podMonitors.interval", "serviceMonitor.interval", "prometheusRule.interval")]
    objects = monitoring.chart_objects(Path(real._state()["bin"]) / "helm", CHART, RELEASE, RELEASE_NS, "--set", "planner.enabled=false",
                                       *[a for v in fast for a in ("--set", v)])
    prom = LocalPrometheus(tmp_path / "prometheus", [], scrape_interval="2s",
                           scrape_configs=monitoring.scrape_configs(objects, real.kubeconfig),
                           rule_groups=monitoring.rule_groups(objects), kubernetes_sd=True).start()
    stop = threading.Event()
    errors: list[BaseException] = []
    sender: threading.Thread | None = None
    try:
        start = time.time()

        def targets_up() -> bool:
            active = prom.api("targets")["data"]["activeTargets"]
            pods = {t["labels"].get("pod") for t in active if t["health"] == "up"}
            return {p.metadata.name for p in dd.pods()} <= pods
        wait_for(targets_up, 120, "every pod of the deployment scraped through the chart's monitors", interval=1)
        # traffic for as long as the panels are checked: a ratio of rates needs its counters to move across
        # scrapes, as on a serving cluster
        def traffic() -> None:
            import openai

            oa = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
            i = 0
            try:
                while not stop.is_set():
                    answer = oa.completions.create(model=realnode.SERVED_MODEL, prompt=f"{PROMPT} question {i}",
                                                   max_tokens=8, stream=bool(i % 2))
                    if i % 2:
                        assert [c for c in answer if c.choices]
                    i += 1
                    stop.wait(1)
            except BaseException as e:   # noqa: BLE001  (reported by the test, not lost in a thread)
                errors.append(e)
        sender = threading.Thread(target=traffic, daemon=True)
        sender.start()
        variables = {"namespace": NS, "deployment": PD, "ttft_target": "1", "itl_target": "0.05",
                     "__rate_interval": "1m"}

        def failures() -> list[str]:
            out, checked = [], 0
            for path in dashboards.DASHBOARDS:
                n, bad = dashboards.empty_panels(path, prom.api, variables, start, time.time(), skip=set(NOT_HERE))
                checked += n
                out += bad
            assert checked >= 20
            return out
        # rates need two scrapes after the traffic and recording rules an evaluation: until every panel
        # has data, or the timeout names the panels that never got any
        last: list[str] = []

        def settled() -> bool:
            last[:] = failures()
            return not last
        try:
            wait_for(settled, 240, "every dashboard panel to have data", interval=5)
        except AssertionError:
            pass
        assert not last, "\n".join(last)
    finally:
        stop.set()
        if sender:
            sender.join(timeout=330)   # its last request ends before the deployment goes away
        prom.stop()
    assert sender and not sender.is_alive() and not errors, errors


# ---------------------------------------------------------------- a rollout under load (on the P/D deployment,
# last of its tests: it leaves the deployment on new engine arguments)

def _short_stream(url: str, i: int) -> dict[str, str]:
    """One short streamed completion; its route headers (raises on any error)."""
    import openai

    oa = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    with oa.completions.with_streaming_response.create(model=realnode.SERVED_MODEL, prompt=f"{PROMPT} {i}",
                                                       max_tokens=8, temperature=0, stream=True,
                                                       extra_body={"ignore_eos": True}) as r:
        tokens = sum(1 for c in r.parse() if c.choices and c.choices[0].text is not None)
        assert tokens >= 1
        return {k: v for k, v in r.headers.items() if k.lower().startswith("x-disagg-")}


def test_engine_args_changed_under_load_never_pair_mixed_revisions(api, pd):
    dd, url = pd
    core = client.CoreV1Api(api)
    ips: dict[str, str] = {}      # pod IP -> KV revision, every worker pod seen during the test
    stop = threading.Event()

    def observe() -> None:
        while not stop.is_set():
            for p in core.list_namespaced_pod(NS, label_selector=f"{LABEL_DEPLOYMENT}={PD}").items:
                rev = (p.metadata.labels or {}).get(contract.KV_REVISION_LABEL)
                if rev and p.status.pod_ip:
                    ips[p.status.pod_ip] = rev
            stop.wait(0.5)

    def load(results: list, errors: list) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                results.append(_short_stream(url, i))
            except Exception as e:       # noqa: BLE001  every failure is reported below
                errors.append(repr(e))
            # a few requests a second per client, not back to back: the new revision's two engines start on
            # the same two cores, and a saturating load only made that start slower (147 s in CI)
            stop.wait(0.25)

    watcher = threading.Thread(target=observe, daemon=True)
    watcher.start()
    wait_for(lambda: len(ips) >= 2, 60, "the worker pods' revisions")
    old = set(ips.values())
    assert len(old) == 1
    results: list[dict[str, str]] = []
    errors: list[str] = []
    with cf.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(load, results, errors) for _ in range(2)]
        wait_for(lambda: len(results) >= 4 or errors, 120, "load flowing before the change")
        args = [*realnode.ENGINE_ARGS, "--kv-cache-dtype", "auto"]   # a new KV revision, same behaviour
        dd.patch_spec({"engine": {"args": args}})

        def rolled() -> bool:
            pods = [p for p in dd.pods() if p.metadata.labels.get(LABEL_ROLE) in ("prefill", "decode")]
            revs = {p.metadata.labels.get(contract.KV_REVISION_LABEL) for p in pods}
            new = revs - old
            return (len(pods) == 2 and len(new) == 1 and not revs & old
                    and any(r.get("x-disagg-revision") in new for r in results[-4:]))
        wait_for(rolled, 600, "the rollout to the new revision, serving")
        stop.set()
        for f in futures:
            f.result()
    assert not errors, errors[:5]
    new = set(ips.values()) - old
    served = {r.get("x-disagg-revision") for r in results}
    assert old <= served and new <= served, (old, new, served)
    for r in results:
        decode = ips[r["x-disagg-decode"].split("//")[1].split(":")[0]]
        assert decode == r["x-disagg-revision"], r
        if r.get("x-disagg-path") == "remote_prefill":   # the decode used the prefill's KV
            assert ips[r["x-disagg-prefill"].split("//")[1].split(":")[0]] == decode, r
    # most requests took the remote prefill path: the pairing held, it did not just fall back
    assert sum(r.get("x-disagg-path") == "remote_prefill" for r in results) >= len(results) // 2, results


def _stream(url: str, prompt: str, max_tokens: int) -> tuple[str, str, str | None, int]:
    """One streamed completion of exactly `max_tokens` tokens (EOS ignored): (decode worker that served it,
    text, finish reason, completion tokens from the usage chunk); raises on any error event. Text alone
    proves little: the tiny model's random weights may pick tokens that detokenize to nothing."""
    import openai

    oa = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    text, finish, tokens = "", None, 0
    with oa.completions.with_streaming_response.create(model=realnode.SERVED_MODEL, prompt=prompt,
                                                       max_tokens=max_tokens, temperature=0, stream=True,
                                                       stream_options={"include_usage": True},
                                                       extra_body={"ignore_eos": True}) as r:
        for c in r.parse():
            if c.choices:
                text += c.choices[0].text
                finish = c.choices[0].finish_reason or finish
            if c.usage:
                tokens = c.usage.completion_tokens
        return r.headers.get("x-disagg-decode", ""), text, finish, tokens


def _unary(url: str, prompt: str, max_tokens: int) -> str:
    import openai

    oa = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    raw = oa.completions.with_raw_response.create(model=realnode.SERVED_MODEL, prompt=prompt, max_tokens=max_tokens,
                                                  temperature=0, extra_body={"ignore_eos": True})
    raw.parse()
    return raw.headers.get("x-disagg-decode", "")


def _router_metric(dd: DD, name: str, **labels: str) -> float:
    """From the router pod's own metrics port, as Prometheus scrapes it (the serving port has no /metrics)."""
    return realnode.metric(_pod_url(dd.pods("router")[0], contract.ROUTER_METRICS_PORT), name, **labels)


def _decode_restarts(api, name: str) -> int:
    pod = client.CoreV1Api(api).read_namespaced_pod(name, NS)
    return sum(c.restart_count for c in pod.status.container_statuses or [])


def test_crashed_decode_is_covered_by_a_counted_retry_and_restarted(api, pd, real):
    """The P/D deployment at two decodes (the scale-down test below needs them too): a decode container
    SIGKILLed with requests decoding on it; each is retried on the other decode, which prefills it itself.
    The victim is a decode with requests in flight: the KV-aware router may keep them all on the decode that
    holds the prompts' shared prefix, and the one added here may get none."""
    dd, url = pd
    dd.patch_spec({"decode": {"replicas": 2}})
    decode_pods = f"{LABEL_DEPLOYMENT}={PD},{LABEL_ROLE}=decode"
    wait_for(lambda: len(realnode.ready_pods(api, NS, decode_pods)) == 2, 900, "two ready decode pods")
    realnode.wait_serving(api, NS, PD, prefill=1, decode=2, timeout=900)
    decodes = realnode.ready_pods(api, NS, decode_pods)
    retries = _router_metric(dd, m.ROUTER_FALLBACKS, reason=m.FALLBACK_DECODE_RETRY)
    with cf.ThreadPoolExecutor(8) as pool:
        # each request decodes 256 tokens (no early EOS), seconds of CPU: still running when the crash comes
        futures = [pool.submit(_unary, url, f"{PROMPT} kill {i}", 256) for i in range(8)]
        victim = wait_for(lambda: next((p for p in decodes if _router_metric(
            dd, m.ROUTER_ACTIVE_REQUESTS, role="decode", worker=_pod_url(p)) > 0), None), 120,
            "requests in flight on a decode")
        restarts = _decode_restarts(api, victim.metadata.name)
        assert not any(f.done() for f in futures), "a request finished before the crash: nothing to retry"
        real.node.crash_container(victim.status.container_statuses[0].container_id)
        try:
            served = [f.result() for f in futures]   # raises if any request failed
        except Exception as e:
            raise AssertionError(realnode.pod_logs(api, NS, f"{LABEL_DEPLOYMENT}={PD}")) from e
    assert len(served) == 8
    assert _router_metric(dd, m.ROUTER_FALLBACKS, reason=m.FALLBACK_DECODE_RETRY) > retries
    # the kubelet restarts the crashed container in place; the router takes the worker back once it is healthy
    wait_for(lambda: _decode_restarts(api, victim.metadata.name) > restarts
             and len(realnode.ready_pods(api, NS, decode_pods)) == 2,
             600, "the crashed decode container restarted and Ready")
    realnode.wait_serving(api, NS, PD, prefill=1, decode=2)


def test_pd_scale_down_under_steady_load_fails_nothing(api, pd):
    """Prefill 2 -> 1 and decode 2 -> 1 at once, under steady streaming load with streams in flight on every
    decode: the terminating pods get no new requests, their streams run to their length, and no request fails
    (a KV pull from a draining prefill that fails is covered by the decode's local prefill, counted)."""
    dd, url = pd
    dd.patch_spec({"prefill": {"replicas": 2}, "decode": {"replicas": 2}})
    # both new pods ready, then the router serving with both: its healthy count alone can still include a
    # pod of the previous test's rollout that is on its way out (CI saw 2 healthy with one new decode ready)
    decode_pods = f"{LABEL_DEPLOYMENT}={PD},{LABEL_ROLE}=decode"
    wait_for(lambda: len(realnode.ready_pods(api, NS, decode_pods)) == 2
             and len(realnode.ready_pods(api, NS, f"{LABEL_DEPLOYMENT}={PD},{LABEL_ROLE}=prefill")) == 2
             and len(client.CoreV1Api(api).list_namespaced_pod(NS, label_selector=decode_pods).items) == 2,
             900, "two ready prefill and two ready decode pods, no other decode pod (terminating included)")
    realnode.wait_serving(api, NS, PD, prefill=2, decode=2, timeout=900)
    decodes = {_pod_url(p) for p in realnode.ready_pods(api, NS, decode_pods)}
    assert len(decodes) == 2
    stop = threading.Event()
    results: list[tuple[str, float, float, str | None, int]] = []   # decode, start, end, finish, tokens
    errors: list[str] = []

    def load(k: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            began = time.monotonic()
            try:
                decode, _, finish, tokens = _stream(url, f"{PROMPT} steady {k} {i}", 64)
                results.append((decode, began, time.monotonic(), finish, tokens))
            except Exception as e:       # noqa: BLE001  every failure is reported below
                errors.append(repr(e))

    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(load, k) for k in range(6)]
        # streams in flight on both decode workers, so whichever pod the ReplicaSet removes has some
        wait_for(lambda: errors or all(_router_metric(dd, m.ROUTER_ACTIVE_REQUESTS, role="decode", worker=d) >= 2
                                       for d in decodes), 300, "two streams in flight on each decode worker")
        scaled = time.monotonic()
        dd.patch_spec({"prefill": {"replicas": 1}, "decode": {"replicas": 1}})
        wait_for(lambda: errors or (len(dd.pods("prefill")) == 1 and len(dd.pods("decode")) == 1), 600,
                 "the scaled-down pods gone")
        gone = time.monotonic()
        # the load goes on past the pods' removal: new requests find the survivors
        wait_for(lambda: errors or sum(r[1] > gone for r in results) >= 6, 300, "requests after the scale-down")
        stop.set()
        for f in futures:
            f.result()
    if errors:
        raise AssertionError(f"{len(errors)} failed: {errors[:3]}\n"
                             + realnode.pod_logs(api, NS, f"{LABEL_DEPLOYMENT}={PD}"))
    short = [r for r in results if (r[3], r[4]) != ("length", 64)]
    assert not short, short[:5]
    removed = decodes - {_pod_url(p) for p in dd.pods("decode")}
    assert len(removed) == 1
    removed_url = next(iter(removed))
    # the removed decode's streams that were in flight when the scale-down began ran to their length
    drained = [r for r in results if removed_url.split("//")[1] in r[0] and r[1] < scaled < r[2]]
    assert drained, "no stream in flight on the removed decode at the scale-down"


# ---------------------------------------------------------------- replicas larger than one pod
WIDE = "tiny-wide"


@pytest.fixture(scope="module")
def wide(api, serving_ns, images):
    """A prefill replica of two pods (tensor parallel 2 across them: the leader serves, the other pod runs
    its rank headless) and one decode pod at TP 1. After the other deployments are gone (the tests above
    are done with them): three CPU vLLM processes at a time on this machine. Returns (dd, url, seconds
    from apply to the first token)."""
    _delete(api, DD(api, NS, PD))
    start = time.monotonic()
    dd = DD(api, NS, realnode.deployment(WIDE, serving_ns, images["worker-cpu"], prefill_layout={
        "podsPerReplica": 2, "parallelism": {"tensor": 2}}))
    try:
        dd.wait_phase("Ready", timeout=900)
        realnode.wait_serving(api, NS, WIDE)
    except AssertionError as e:
        raise AssertionError(realnode.pod_logs(api, RELEASE_NS, "") + "\n" + realnode.pod_logs(api, NS, "")) from e
    url = realnode.router_url(api, NS, WIDE)
    _unary(url, PROMPT + " first", 1)
    first_token = time.monotonic() - start
    print(f"\n[replicas larger than one node] kubectl apply -> first token of a two-pod TP2 prefill replica: "
          f"{first_token:.0f} s")
    yield dd, url, first_token
    _delete(api, dd)


def _group(dd: DD) -> list[client.V1Pod]:
    from disagg.api.names import LABEL_GROUP_POD

    return sorted(dd.pods("prefill"), key=lambda p: int(p.metadata.labels[LABEL_GROUP_POD]))


def test_a_two_pod_prefill_replica_serves_with_nixl_from_both_ranks(api, wide):
    import openai

    from disagg.api.names import LABEL_GROUP, LABEL_HEADLESS

    dd, url, _ = wide
    leader, rank = _group(dd)
    assert leader.metadata.labels[LABEL_GROUP] == rank.metadata.labels[LABEL_GROUP] == f"{WIDE}-prefill-0"
    assert rank.metadata.labels[LABEL_HEADLESS] == "true" and rank.spec.hostname == f"{WIDE}-prefill-0-1"
    decode = dd.pods("decode")[0]
    decode_metrics = _pod_url(decode, contract.WORKER_METRICS_PORT)
    before = metric_sum(scrape(decode_metrics), m.VLLM_NIXL_BYTES_TRANSFERRED + "_sum")
    reads = metric_sum(scrape(decode_metrics), m.VLLM_NIXL_BYTES_TRANSFERRED + "_count")
    oa = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    raw = oa.completions.with_raw_response.create(model=realnode.SERVED_MODEL, prompt=PROMPT + "wide",
                                                  max_tokens=8, temperature=0)
    assert raw.headers.get("x-disagg-path") == m.PATH_REMOTE_PREFILL, realnode.pod_logs(
        api, NS, f"{LABEL_DEPLOYMENT}={WIDE}", lines=40)
    assert raw.parse().choices[0].text
    moved = wait_for(lambda: (v := metric_sum(scrape(_pod_url(decode, contract.WORKER_METRICS_PORT)),
                                              m.VLLM_NIXL_BYTES_TRANSFERRED + "_sum")) > before and v, 60,
                     "NIXL bytes counted on the decode pod")
    assert moved > before
    # the decode (TP 1) read the KV of both prefill ranks, each from its own pod's memory: two reads for the
    # request (vLLM splits the tiny model's 2 KV heads one per rank; a one-rank prefill would make one)
    assert wait_for(lambda: metric_sum(scrape(decode_metrics), m.VLLM_NIXL_BYTES_TRANSFERRED + "_count") - reads >= 2,
                    60, "a NIXL read per prefill rank") and metric_sum(
        scrape(decode_metrics), m.VLLM_NIXL_BYTES_TRANSFERRED + "_count") - reads == 2
    # one engine of two ranks, one in each pod: the headless pod's log shows its rank of a world of 2
    log = client.CoreV1Api(api).read_namespaced_pod_log(rank.metadata.name, NS)
    assert "world_size=2" in log or "world size 2" in log, log[-3000:]
    # the router sees the replica once, by its leader
    assert realnode.metric(realnode.router_metrics_urls(api, NS, WIDE)[0], m.ROUTER_WORKERS, role="prefill",
                           state="healthy") == 1


def test_deleting_a_pod_of_the_replica_restarts_it_whole_and_it_serves_again(api, wide, real):
    dd, url, _ = wide
    core = client.CoreV1Api(api)
    leader, rank = _group(dd)
    core.delete_namespaced_pod(rank.metadata.name, NS)
    event = wait_for(lambda: [e for e in core.list_namespaced_event(
        NS, field_selector=f"involvedObject.name={WIDE}").items if e.reason == "GroupRestarted"], 120,
        "a GroupRestarted event")[0]
    assert rank.metadata.name in event.message and "restarts as a whole" in event.message, event.message
    # a new group of both pods, in a free slot, serving through the router again
    wait_for(lambda: (g := _group(dd)) and len(g) == 2 and leader.metadata.name not in {p.metadata.name for p in g},
             300, "a new group")
    dd.wait_phase("Ready", timeout=900)
    realnode.wait_serving(api, NS, WIDE)
    assert _unary(url, PROMPT + " again", 8)
    operator = realnode.ready_pods(api, RELEASE_NS, "app.kubernetes.io/component=operator")[0]
    port = next(p.container_port for c in operator.spec.containers for p in c.ports or [] if p.name == "metrics")
    assert realnode.metric(_pod_url(operator, port), m.OPERATOR_GROUP_RESTARTS, namespace=NS, deployment=WIDE,
                           role="prefill") == 1
