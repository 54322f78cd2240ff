"""A DisaggDeployment that really serves, on the local cluster's real node: shared by the end-to-end
suite (tests/test_e2e_realnode.py), `make demo` and the time-to-first-token benchmark.

What runs is what a user runs: the chart installed by `helm install` with the operator pod from the
control-plane image under the chart's ServiceAccount; a DisaggDeployment whose prefill and decode pods
run the CPU worker image and whose router pod runs the control-plane image, as the operator renders
them. The tiny model (generated locally, no hub) reaches the pods as a `pvc://` source: a hostPath
PersistentVolume on the real node, bound to a claim in the deployment's namespace.

Test-specific choices, each a setting a user of a GPU-less cluster would make too: the real node's
taint is tolerated and its label selected (kwok's simulated nodes cannot run anything); the CPU
worker image's settings (float32, eager, a small KV cache) come from the spec's engine env and args.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from .localcluster.node import NODE_NAME, REAL_NODE_SELECTOR, REAL_NODE_TOLERATION
from .providers import CHART
from .testing import wait_for

MODEL_CLAIM = "tiny-model"
# LoRA adapters of the tiny model (workers/tinyadapter.py) reach the pods the same way, on a claim of their own:
# the model's directory is the shared cache, and a claim the workers mount from the start lets an adapter
# added later on it roll no pod (operator/render.py _model_volumes).
ADAPTER_CLAIM = "tiny-adapters"
SERVED_MODEL = "tiny"
# The tiny model's settings for the CPU build: a context the tokenizer's prompts fit, and a KV cache
# small enough for two vLLM instances and everything else on a 2-core, 24 GiB machine.
ENGINE_ARGS = ["--max-model-len", "1024", "--max-num-seqs", "64"]
ENGINE_ENV = {"DISAGG_KV_CACHE_BYTES": str(64 * 2**20)}


def placement() -> dict[str, Any]:
    """nodeSelector + tolerations that put a pod on the real node (and only there)."""
    return {"nodeSelector": dict(REAL_NODE_SELECTOR), "tolerations": [dict(REAL_NODE_TOLERATION)]}


def chart_values(control_plane_image: str) -> list[str]:
    """`helm install` values: the operator pod from the locally built image, never pulled, on the real
    node; the planner off (no Prometheus endpoint in this cluster's chart values); the InferencePool CRD
    installed (a deployment in picker mode gets its pool, which the suite's Envoy reads as a gateway would)."""
    repository, _, tag = control_plane_image.rpartition(":")
    p = placement()
    label_key, label_value = next(iter(p["nodeSelector"].items()))
    tol = p["tolerations"][0]
    return ["--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", "image.pullPolicy=Never",
            "--set-string", f"operator.nodeSelector.{label_key.replace('.', chr(92) + '.')}={label_value}",
            "--set", f"operator.tolerations[0].key={tol['key']}",
            "--set", f"operator.tolerations[0].operator={tol['operator']}",
            "--set-string", f"operator.tolerations[0].value={tol['value']}",
            "--set", f"operator.tolerations[0].effect={tol['effect']}",
            "--set", "planner.enabled=false", "--set", "inferencePool.installCRD=true"]


def helm(cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The cluster's helm (built with its binaries) against its kubeconfig; a failure raises with helm's output."""
    out = subprocess.run([str(Path(cluster._state()["bin"]) / "helm"), f"--kubeconfig={cluster.kubeconfig}", *args],
                         capture_output=True, text=True)
    if check and out.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


def install_model(api: client.ApiClient, namespace: str, host_dir: Path | str, node_name: str = NODE_NAME,
                  claim: str = MODEL_CLAIM) -> str:
    """A read-only hostPath PersistentVolume of `host_dir` on the real node, bound to the claim
    `claim` in `namespace`; returns the `pvc://` source."""
    core = client.CoreV1Api(api)
    pv_name = f"{claim}-{namespace}"
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv_name},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                   "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                   "hostPath": {"path": str(host_dir), "type": "Directory"},
                   "claimRef": {"namespace": namespace, "name": claim},
                   "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                       {"key": "kubernetes.io/hostname", "operator": "In", "values": [node_name]}]}]}}}}
    try:
        core.create_persistent_volume(pv)
    except ApiException as e:
        if e.status != 409:
            raise
    core.create_namespaced_persistent_volume_claim(namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv_name,
                 "resources": {"requests": {"storage": "1Gi"}}}})
    wait_for(lambda: core.read_namespaced_persistent_volume_claim(claim, namespace).status.phase == "Bound",
             60, f"claim {claim} bound")
    return f"pvc://{claim}"


def remove_model(api: client.ApiClient, namespace: str, claim: str = MODEL_CLAIM) -> None:
    try:
        client.CoreV1Api(api).delete_persistent_volume(f"{claim}-{namespace}")
    except ApiException as e:
        if e.status != 404:
            raise


def deployment(name: str, source: str, worker_image: str, prefill: int = 1, decode: int = 1,
               disaggregation: str = "always", prefill_layout: dict[str, Any] | None = None,
               router_mode: str = "proxy", worker_placement: dict[str, Any] | None = None,
               router_placement: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tiny model as a DisaggDeployment whose every pod lands on the real node. spec.kvTransfer is left at
    its defaults: what a user applies unchanged to a CPU cluster must serve. ``prefill_layout``: the prefill
    replica's podsPerReplica and parallelism (replicas larger than one pod), instead of one pod at TP 1.
    ``router_mode``: spec.router.mode (picker: also the endpoint picker of an InferencePool).
    ``worker_placement``/``router_placement``: nodeSelector and tolerations in place of the real node's (the
    kind provider's nodes)."""
    p = placement() if worker_placement is None else worker_placement
    rp = p if router_placement is None else router_placement
    role = {"tensorParallelSize": 1, **p}
    spec: dict[str, Any] = {
        "model": {"name": SERVED_MODEL, "source": source},
        "engine": {"image": worker_image, "imagePullPolicy": "Never", "args": list(ENGINE_ARGS),
                   "env": [{"name": k, "value": v} for k, v in ENGINE_ENV.items()]},
        "prefill": {"replicas": prefill, "minReplicas": 0 if prefill == 0 else 1,
                    **({**p, **prefill_layout} if prefill_layout else role)},
        "decode": {"replicas": decode, **role},
        "router": {"replicas": 1, "disaggregation": disaggregation, "mode": router_mode, **rp},
        "scheduling": {"gang": {"minPrefill": min(prefill, 1), "minDecode": 1}},
    }
    return {"apiVersion": "serving.disagg.dev/v1alpha1", "kind": "DisaggDeployment",
            "metadata": {"name": name}, "spec": spec}


def router_url(api: client.ApiClient, namespace: str, name: str) -> str:
    """The OpenAI base URL of the deployment's Service (kube-proxy routes the ClusterIP from this host)."""
    svc = client.CoreV1Api(api).read_namespaced_service(name, namespace)
    return f"http://{svc.spec.cluster_ip}:{svc.spec.ports[0].port}/v1"


def ready_pods(api: client.ApiClient, namespace: str, selector: str) -> list[client.V1Pod]:
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector).items
    return [p for p in pods if not p.metadata.deletion_timestamp and p.status.phase == "Running"
            and all(c.ready for c in p.status.container_statuses or [])]


def pod_logs(api: client.ApiClient, namespace: str, selector: str, lines: int = 60) -> str:
    """The last lines of every matching pod's container (and of its previous run, after a restart): what a
    failed end-to-end test attaches, since the pods and their logs are gone once the cluster is down."""
    core = client.CoreV1Api(api)
    out = []
    for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
        restarted = any(c.restart_count for c in pod.status.container_statuses or [])
        for previous in (True, False) if restarted else (False,):
            try:
                text = core.read_namespaced_pod_log(pod.metadata.name, namespace, tail_lines=lines,
                                                    previous=previous)
            except ApiException as e:
                text = f"(no log: {e.status} {e.reason})"
            out.append(f"--- {pod.metadata.name}{' (previous run)' if previous else ''} ---\n{text}")
    return "\n".join(out)


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples named `name` on `url`'s /metrics whose labels include `labels`."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def router_metrics_urls(api: client.ApiClient, namespace: str, name: str) -> list[str]:
    """The base URL of each ready router process's own metrics port (the chart's monitor scrapes the same:
    in a cluster the serving port serves the API and the probes only)."""
    import re

    from disagg.api import contract
    from disagg.api.names import LABEL_DEPLOYMENT, LABEL_ROLE, ROLE_ROUTER

    pods = ready_pods(api, namespace, f"{LABEL_DEPLOYMENT}={name},{LABEL_ROLE}={ROLE_ROUTER}")
    return [f"http://{p.status.pod_ip}:{port.container_port}" for p in pods for c in p.spec.containers
            for port in c.ports or [] if re.fullmatch(contract.ROUTER_METRICS_PORT_NAMES, port.name or "")]


def wait_serving(api: client.ApiClient, namespace: str, name: str, prefill: int = 1, decode: int = 1,
                 timeout: float = 600) -> float:
    """Until the deployment's router Service answers /v1/models and every router process counts `prefill`
    and `decode` workers healthy; returns the seconds waited. Pods Ready is not enough: the router learns
    its workers from the EndpointSlices and then probes them, and until it has a healthy prefill worker it
    prefills on the decode worker (the local_prefill path)."""
    url = router_url(api, namespace, name)
    start = time.monotonic()
    wait_for(lambda: serving(url, router_metrics_urls(api, namespace, name), prefill, decode), timeout,
             f"the router at {url} serving with {prefill} prefill and {decode} decode workers", interval=1)
    return time.monotonic() - start


def serving(url: str, metrics_urls: list[str], prefill: int = 1, decode: int = 1) -> bool:
    """The router at `url` (…/v1) answers /v1/models and each of its processes' metrics (`metrics_urls`)
    counts `prefill` and `decode` workers healthy."""
    import urllib.request

    from disagg.api import metrics as m

    try:
        with urllib.request.urlopen(f"{url}/models", timeout=5) as r:
            if r.status != 200:
                return False
        return bool(metrics_urls) and all(metric(base, m.ROUTER_WORKERS, role=role, state="healthy") >= want
                                          for base in metrics_urls
                                          for role, want in (("prefill", prefill), ("decode", decode)))
    except OSError:
        return False


# Prompts long enough to fill a KV block or two of the tiny model, so the decode has KV to pull.
PROMPT = "You are a careful assistant for a parser project. Answer in one short line. " * 3


def nixl_bytes(metrics_url: str) -> float:
    """Bytes NIXL has moved into the worker whose metrics are at ``metrics_url`` (vLLM's own counter)."""
    from disagg.api import metrics as m
    from disagg.workers.local import metric_sum, scrape

    return metric_sum(scrape(metrics_url), m.VLLM_NIXL_BYTES_TRANSFERRED + "_sum")


def served_on_the_remote_prefill_path(url: str, decode_metrics_url: str) -> list[dict]:
    """Chat and completions, streamed and not, through the router at ``url`` (…/v1) with the official
    client: every one on the remote_prefill path, and NIXL bytes counted on the decode worker whose
    metrics port is ``decode_metrics_url``. Returns each answer's x-disagg-* headers."""
    import openai

    from disagg.api import metrics as m

    def route(headers) -> dict[str, str]:
        return {k.lower(): v for k, v in headers.items() if k.lower().startswith("x-disagg-")}
    before = nixl_bytes(decode_metrics_url)
    oa = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    paths, routes = [], []
    raw = oa.chat.completions.with_raw_response.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": PROMPT + "chat"}], max_tokens=8, temperature=0)
    paths.append(raw.headers.get("x-disagg-path"))
    routes.append(route(raw.headers))
    assert raw.parse().choices[0].message.content is not None
    raw = oa.completions.with_raw_response.create(model=SERVED_MODEL, prompt=PROMPT + "completion", max_tokens=8,
                                                  temperature=0)
    paths.append(raw.headers.get("x-disagg-path"))
    routes.append(route(raw.headers))
    assert raw.parse().choices[0].text is not None
    with oa.chat.completions.with_streaming_response.create(
            model=SERVED_MODEL, messages=[{"role": "user", "content": PROMPT + "stream"}], max_tokens=8,
            temperature=0, stream=True) as r:
        paths.append(r.headers.get("x-disagg-path"))
        routes.append(route(r.headers))
        chunks = [c for c in r.parse() if c.choices]
    assert chunks
    with oa.completions.with_streaming_response.create(model=SERVED_MODEL, prompt=PROMPT + "stream2", max_tokens=8,
                                                       temperature=0, stream=True) as r:
        paths.append(r.headers.get("x-disagg-path"))
        routes.append(route(r.headers))
        assert [c for c in r.parse() if c.choices]
    assert paths == [m.PATH_REMOTE_PREFILL] * 4, paths
    moved = wait_for(lambda: (v := nixl_bytes(decode_metrics_url)) > before and v, 60, "NIXL bytes counted on the decode pod")
    assert moved > before
    return routes


def chat(url: str, question: str) -> str:
    """One streamed chat request through the router at `url` (…/v1): the answer and the route it took."""
    from disagg.workers.local import _chat

    route, first, end, chunks, text, start = _chat(url.removesuffix("/v1"), question)
    path = route.get("x-disagg-path")
    via = (f"prefill {route.get('x-disagg-prefill')} -> decode {route.get('x-disagg-decode')}"
           if route.get("x-disagg-prefill") else f"decode {route.get('x-disagg-decode')}")
    fallback = f" (fallback: {route['x-disagg-fallback']})" if route.get("x-disagg-fallback") else ""
    return (f"question: {question!r}\nanswer:   {''.join(text)!r}\n"
            f"route:    {path}{fallback}: {via}\n"
            f"TTFT {1000 * (first - start):.0f} ms, {chunks} chunks in {end - start:.1f} s")


__all__ = ["ADAPTER_CLAIM", "chat", "CHART", "helm", "MODEL_CLAIM", "SERVED_MODEL", "chart_values", "deployment", "install_model",
           "metric", "nixl_bytes", "placement", "pod_logs", "PROMPT", "ready_pods", "remove_model", "router_metrics_urls",
           "router_url", "served_on_the_remote_prefill_path", "serving", "wait_serving"]
