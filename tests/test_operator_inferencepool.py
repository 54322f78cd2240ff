"""spec.router.mode picker against the real API server, with the operator running under its own role: the
InferencePool it renders, under the chart's InferencePool CRD, selects exactly the decode pods that serve;
without the CRD the deployment says so (a condition, an event) and everything else reconciles, and the pool
appears once the CRD is installed; back in proxy mode the pool and the picker's policies are deleted."""

from __future__ import annotations

import json

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from disagg.api import inferencepool as pools
from disagg.api.names import LABEL_DEPLOYMENT
from disagg.e2e.testing import DD, dd_manifest, install_inference_pool_crd, remove_inference_pool_crd, wait_for
from disagg.operator import render

pytestmark = [pytest.mark.timeout(600)]


def _pool(api_client, namespace: str, name: str) -> dict | None:
    try:
        return client.CustomObjectsApi(api_client).get_namespaced_custom_object(
            pools.GROUP, pools.VERSION, namespace, pools.PLURAL, name)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _selected(api_client, namespace: str, pool: dict) -> list[str]:
    """The pods the pool's selector selects (as a gateway reads it: matchLabels, in the pool's namespace)."""
    selector = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())
    return sorted(p.metadata.name for p in client.CoreV1Api(api_client).list_namespaced_pod(
        namespace, label_selector=selector).items if not p.metadata.deletion_timestamp)


def _policies(api_client, namespace: str, name: str) -> set[str]:
    return {p.metadata.name for p in client.NetworkingV1Api(api_client).list_namespaced_network_policy(
        namespace, label_selector=f"{LABEL_DEPLOYMENT}={name}").items}


def _events(api_client, namespace: str, name: str, reason: str) -> list:
    return client.CoreV1Api(api_client).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},reason={reason}").items


def _router_service_ports(api_client, namespace: str, name: str) -> dict[str, int]:
    svc = client.CoreV1Api(api_client).read_namespaced_service(name, namespace)
    return {p.name: p.port for p in svc.spec.ports}


class _Clients:
    """children.Clients' get/apply over a dict, answering ``status`` for the kinds in ``refused``."""

    def __init__(self, refused: dict[str, int]):
        self.refused, self.applied = refused, []

    def _check(self, kind: str) -> None:
        if kind in self.refused:
            raise ApiException(status=self.refused[kind], reason="as told")

    def get(self, api_version, kind, namespace, name):
        self._check(kind)
        return None

    def apply(self, manifest):
        self._check(manifest["kind"])
        self.applied.append(manifest["kind"])


@pytest.mark.parametrize("status,reason", [(404, "InferencePoolCRDMissing"), (403, "InferencePoolForbidden")])
def test_a_pool_the_api_server_cannot_take_fails_nothing_else(status, reason):
    """Every other child is applied; the pool's kind comes back as unavailable, which the status names."""
    from disagg.api.v1alpha1 import DisaggDeployment
    from disagg.operator import children, handlers

    dd = DisaggDeployment.model_validate({**dd_manifest("gw", router={"mode": "picker"}),
                                          "metadata": {"name": "gw", "namespace": "n"}})
    manifests, _ = render.children(dd, "uid")
    fake, unavailable = _Clients({pools.KIND: status}), {}
    written = children.apply(fake, manifests, "uid", unavailable)
    assert written == fake.applied == [m["kind"] for m in manifests if m["kind"] != pools.KIND]
    assert unavailable == {pools.KIND: status}
    state = handlers.pool_state(dd, status)
    assert (state.name, state.reason) == (None, reason) and "InferencePool gw" in state.message
    with pytest.raises(ApiException):   # any other kind's refusal is the reconcile's failure, as before
        children.apply(_Clients({"Service": status}), manifests, "uid", {})


@pytest.mark.cluster
def test_the_pool_follows_its_crd_and_the_mode(cluster, api_client, namespace, operator, monkeypatch):
    from disagg.operator import handlers

    # the operator runs in this process: its retry period shortened, so the test does not wait out 30 s
    monkeypatch.setattr(handlers, "POOL_RETRY_SECONDS", 3)
    remove_inference_pool_crd(cluster)
    dd = DD(api_client, namespace, dd_manifest("gw", decode={"replicas": 2}, router={"mode": "picker"}))

    # no InferencePool API: a condition and a warning, and every other child reconciled and serving
    cond = dd.wait_condition("InferencePoolApplied", "False", "InferencePoolCRDMissing")
    assert "inferencePool.installCRD=true" in cond["message"], cond
    dd.wait_condition("Degraded", "True", "InferencePoolCRDMissing")
    wait_for(lambda: all(dd.status().get(role, {}).get("ready") == n for role, n in
                         (("prefill", 1), ("decode", 2), ("router", 1))), 90, "every role ready without the pool")
    assert dd.condition("Ready")["status"] == "True"
    assert "inferencePool" not in dd.status()["router"]
    (router,) = dd.apps.list_namespaced_deployment(namespace, label_selector=f"{LABEL_DEPLOYMENT}=gw,"
                                                   "serving.disagg.dev/role=router").items
    assert router.spec.template.spec.containers[0].args[-4:] == ["--mode", "picker", "--grpc-port", "9002"]
    assert _router_service_ports(api_client, namespace, "gw") == {"http": 80, "grpc": 9002}
    assert _policies(api_client, namespace, "gw") == {"gw-workers", "gw-gateway", "gw-router"}
    wait_for(lambda: _events(api_client, namespace, "gw", "InferencePoolCRDMissing"), 90,
             "a warning event saying the CRD is missing")

    # the chart's CRD installed: the operator creates the pool within its retry period
    install_inference_pool_crd(cluster)
    dd.wait_condition("InferencePoolApplied", "True", "Applied", timeout=120)
    dd.wait_phase("Ready")
    assert dd.status()["router"]["inferencePool"] == "gw"
    pool = _pool(api_client, namespace, "gw")
    assert pool["metadata"]["ownerReferences"][0]["uid"] == dd.get()["metadata"]["uid"]
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "gw",
                                                 "port": {"number": 9002}, "failureMode": "FailClose"}
    decode = sorted(p.metadata.name for p in dd.pods("decode"))
    assert len(decode) == 2 and _selected(api_client, namespace, pool) == decode

    # the CRD's own rule: a Service picker needs its port
    bad = {**{k: pool[k] for k in ("apiVersion", "kind", "spec")}, "metadata": {"name": "no-port"}}
    bad["spec"] = {**bad["spec"], "endpointPickerRef": {"name": "gw"}}
    out = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(bad),
                          check=False)
    assert out.returncode != 0 and "port is required" in out.stderr, out.stderr

    # a replica of two pods: the pool selects its leader only (its other pod serves no API)
    wide = DD(api_client, namespace, dd_manifest("wide", router={"mode": "picker", "picker": {
        "failureMode": "FailOpen"}}, decode={"replicas": 1, "podsPerReplica": 2, "tensorParallelSize": 2}))
    wait_for(lambda: len(wide.pods("decode")) == 2, 90, "the decode replica's two pods")
    wide_pool = wait_for(lambda: _pool(api_client, namespace, "wide"), 60, "the pool of 'wide'")
    assert _selected(api_client, namespace, wide_pool) == ["wide-decode-0-0"]
    assert wide_pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"

    # back to proxy mode: the pool and the picker's policies deleted, the status and the Service say so
    dd.patch_spec({"router": {"mode": "proxy"}})
    wait_for(lambda: _pool(api_client, namespace, "gw") is None, 60, "the InferencePool deleted")
    wait_for(lambda: _policies(api_client, namespace, "gw") == {"gw-workers"}, 60, "the picker's policies deleted")
    wait_for(lambda: "InferencePoolApplied" not in {c["type"] for c in dd.status().get("conditions", [])}
             and "inferencePool" not in dd.status()["router"], 60, "the status without the pool")
    wait_for(lambda: _router_service_ports(api_client, namespace, "gw") == {"http": 80}, 60,
             "the Service without its grpc port")
    assert dd.wait_phase("Ready") and _pool(api_client, namespace, "wide") is not None
    got = json.loads(cluster.kubectl("get", "dd", "gw", "-n", namespace, "-o", "json").stdout)
    assert "picker" not in got["spec"]["router"]
    wait_for(lambda: _events(api_client, namespace, "gw", "InferencePoolDeleted"), 90, "an event for the deletion")
    assert render.names("gw")["inference-pool"] == "gw"
