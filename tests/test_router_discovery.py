"""The router discovers workers from EndpointSlices on a real API server (the local control plane): the
ready endpoints of its deployment's Services, and the KV revisions of its deployment's worker pods alone,
listed as metadata. An API server that does not answer delays discovery, never stops it."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from disagg.api import contract
from disagg.api.names import LABEL_DEPLOYMENT, LABEL_ROLE, ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER
from disagg.e2e.testing import pod, wait_for
from disagg.router.config import RouterConfig
from disagg.router.discovery import SERVICE_NAME_LABEL, EndpointSliceDiscovery
from disagg.router.metrics import RouterMetrics
from disagg.router.service import Router


def _slice(name: str, service: str, endpoints: list[tuple[str, bool]]) -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "labels": {SERVICE_NAME_LABEL: service,
                                                  "endpointslice.kubernetes.io/managed-by": "disagg-tests"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"},
                      {"name": "kv-events", "port": 5557, "protocol": "TCP"},
                      {"name": "kv-replay", "port": 5558, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip, ready in endpoints]}


@pytest.mark.cluster
def test_ready_endpoints_become_workers_and_leave_with_their_slice(api_client, namespace):
    from kubernetes import client

    api = client.DiscoveryV1Api(api_client)
    api.create_namespaced_endpoint_slice(namespace, _slice("d-1", "x-decode",
                                                           [("192.0.2.2", True), ("192.0.2.3", False)]))
    api.create_namespaced_endpoint_slice(namespace, _slice("d-2", "x-decode", [("192.0.2.4", True)]))
    api.create_namespaced_endpoint_slice(namespace, _slice("p-1", "x-prefill", [("192.0.2.5", True)]))
    disc = EndpointSliceDiscovery(api_client, namespace, {ROLE_PREFILL: "x-prefill", ROLE_DECODE: "x-decode"})

    decode = disc.list(ROLE_DECODE)
    assert [(e.url, e.kv_events, e.kv_replay) for e in decode] == [
        ("http://192.0.2.2:8000", "tcp://192.0.2.2:5557", "tcp://192.0.2.2:5558"),
        ("http://192.0.2.4:8000", "tcp://192.0.2.4:5557", "tcp://192.0.2.4:5558")]
    # The addresses are in TEST-NET-1 (192.0.2.0/24, documentation only; the API server refuses
    # loopback ones): the router is not started, so nothing is ever sent to them.
    router = Router(RouterConfig(model="m", tokenizer="unused", block_size=16), tokenizer=None, metrics=RouterMetrics())
    router.update_workers(ROLE_DECODE, decode)
    router.update_workers(ROLE_PREFILL, disc.list(ROLE_PREFILL))
    assert sorted(router.pool.workers[ROLE_DECODE]) == ["http://192.0.2.2:8000", "http://192.0.2.4:8000"]
    assert list(router.pool.workers[ROLE_PREFILL]) == ["http://192.0.2.5:8000"]
    router.index[ROLE_DECODE].add_keys("http://192.0.2.4:8000", [1, 2, 3])

    api.delete_namespaced_endpoint_slice("d-2", namespace)
    router.update_workers(ROLE_DECODE, disc.list(ROLE_DECODE))
    assert list(router.pool.workers[ROLE_DECODE]) == ["http://192.0.2.2:8000"]
    assert router.index[ROLE_DECODE].blocks() == 0          # a departed worker's blocks leave the index


def _worker_pod(name: str, deployment: str, role: str, revision: str | None = "rev-1") -> dict:
    labels = {LABEL_DEPLOYMENT: deployment, LABEL_ROLE: role}
    if revision:
        labels |= {contract.KV_REVISION_LABEL: revision, contract.KV_REVISION_GENERATION_LABEL: "3"}
    # never scheduled (no node has the label): nothing runs, the API server has the object
    return pod(name, labels=labels, node_selector={"disagg.test/nowhere": "true"})


@pytest.mark.cluster
def test_only_the_deployments_worker_pods_are_listed_and_as_metadata(api_client, namespace):
    """Another deployment's workers in the same namespace (and this deployment's router pod) are not the
    router's business: their revisions are not read, and no pod's spec (environment included) is fetched."""
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    for name, dd, role in (("a-prefill-0", "a", ROLE_PREFILL), ("a-decode-0", "a", ROLE_DECODE),
                           ("b-prefill-0", "b", ROLE_PREFILL), ("b-decode-0", "b", ROLE_DECODE)):
        core.create_namespaced_pod(namespace, _worker_pod(name, dd, role))
    core.create_namespaced_pod(namespace, _worker_pod("a-router-0", "a", ROLE_ROUTER, revision="rev-1"))
    disc = EndpointSliceDiscovery(api_client, namespace, {ROLE_PREFILL: "a-prefill", ROLE_DECODE: "a-decode"})

    assert disc.revisions() == {"a-prefill-0": ("rev-1", 3), "a-decode-0": ("rev-1", 3)}
    listed = disc.worker_pods()
    assert listed["kind"] == "PartialObjectMetadataList", listed.get("kind")
    assert sorted(i["metadata"]["name"] for i in listed["items"]) == ["a-decode-0", "a-prefill-0"]
    assert all(set(i) <= {"kind", "apiVersion", "metadata"} for i in listed["items"]), listed["items"][0]


class HungApiServer:
    """A TCP server that accepts connections and never answers, as an API server that hangs; counts them."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


def test_a_hung_api_server_delays_discovery_and_never_stops_it(caplog):
    """Every API call has a timeout (here 1 s to read, the router's own is KUBE_REQUEST_TIMEOUT): a poll
    against an API server that never answers gives up, the router keeps its workers, and the next poll
    asks again. Without timeouts the first call waits forever, and with it the router's discovery."""
    from kubernetes import client

    hung = HungApiServer()
    config = client.Configuration()
    config.host = hung.url
    api = client.ApiClient(config)
    disc = EndpointSliceDiscovery(api, "default", {ROLE_PREFILL: "a-prefill", ROLE_DECODE: "a-decode"},
                                  interval_s=0.1, timeout_s=(1.0, 1.0))
    updates = []
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    caplog.set_level("WARNING", logger="disagg.router.discovery")
    async def start() -> asyncio.Task:
        return asyncio.create_task(disc.run(lambda role, eps: updates.append(role)))
    task = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)

    async def stop() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    try:
        # two polls given up (urllib3 retries each timed-out call a few times first): discovery goes on
        wait_for(lambda: sum("listing the workers of a failed" in r.getMessage() for r in caplog.records) >= 2,
                 60, "two polls to give up on the hung API server")
        assert updates == []            # no answer, no change to the workers
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=30)
        hung.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=60)
        api.close()


def test_the_deployment_is_the_one_its_services_are_named_after_or_given():
    from kubernetes import client

    from disagg.router.discovery import deployment_of

    assert deployment_of({ROLE_PREFILL: "my-llm-prefill", ROLE_DECODE: "my-llm-decode"}) == "my-llm"
    assert deployment_of({ROLE_PREFILL: "p", ROLE_DECODE: "d"}) is None
    api = client.ApiClient(client.Configuration())
    try:
        with pytest.raises(ValueError, match="--deployment"):
            EndpointSliceDiscovery(api, "default", {ROLE_PREFILL: "p", ROLE_DECODE: "d"})
        disc = EndpointSliceDiscovery(api, "default", {ROLE_PREFILL: "p", ROLE_DECODE: "d"}, deployment="llm")
        assert disc.pod_selector.startswith(f"{LABEL_DEPLOYMENT}=llm,")
    finally:
        api.close()


@pytest.mark.cluster
def test_flex_workers_are_found_in_the_role_their_pod_label_says(api_client, namespace):
    """spec.flex: the flex Service's endpoints are flex workers, each in its pod's serving-role label (one
    without the label yet serves nothing); a relabelled pod is the same worker in its new role."""
    from kubernetes import client

    from disagg.api.names import LABEL_SERVING_ROLE, ROLE_FLEX

    core, api = client.CoreV1Api(api_client), client.DiscoveryV1Api(api_client)
    for name, serving in (("f-flex-0", ROLE_PREFILL), ("f-flex-1", None)):
        p = _worker_pod(name, "f", ROLE_FLEX)
        if serving:
            p["metadata"]["labels"][LABEL_SERVING_ROLE] = serving
        core.create_namespaced_pod(namespace, p)
    s = _slice("fx-1", "f-flex", [("192.0.2.7", True), ("192.0.2.8", True)])
    for ep, pod_name in zip(s["endpoints"], ("f-flex-0", "f-flex-1")):
        ep["targetRef"] = {"kind": "Pod", "name": pod_name, "namespace": namespace}
    api.create_namespaced_endpoint_slice(namespace, s)
    disc = EndpointSliceDiscovery(api_client, namespace, {ROLE_PREFILL: "f-prefill", ROLE_DECODE: "f-decode",
                                                          ROLE_FLEX: "f-flex"})
    found = disc.poll()
    assert [(e.url, e.role, e.revision) for e in found[ROLE_FLEX]] == [("http://192.0.2.7:8000", ROLE_PREFILL, "rev-1")]
    router = Router(RouterConfig(model="m", tokenizer="unused", block_size=16), tokenizer=None, metrics=RouterMetrics())
    for role, endpoints in found.items():
        router.update_workers(role, endpoints)
    assert list(router.pool.workers[ROLE_PREFILL]) == ["http://192.0.2.7:8000"]
    assert router.pool.workers[ROLE_PREFILL]["http://192.0.2.7:8000"].flex

    core.patch_namespaced_pod("f-flex-1", namespace, {"metadata": {"labels": {LABEL_SERVING_ROLE: ROLE_DECODE}}})
    assert sorted((e.url, e.role) for e in disc.poll()[ROLE_FLEX]) == [
        ("http://192.0.2.7:8000", ROLE_PREFILL), ("http://192.0.2.8:8000", ROLE_DECODE)]


def test_the_adapters_come_from_the_deployment_and_their_status_goes_back_to_it(api_client, crd_installed,
                                                                                 namespace):
    """The router's discovery, on a real API server: each poll hands the fleet its DisaggDeployment's
    spec.model.adapters (added and removed with no restart), and writes status.adapters when the fleet's
    view changes, under the routers' own field manager (the operator's status fields are not touched)."""
    from kubernetes import client

    from disagg.e2e.testing import dd_manifest
    from disagg.router.discovery import ROUTER_FIELD_MANAGER

    custom = client.CustomObjectsApi(api_client)
    group, version, plural = "serving.disagg.dev", "v1alpha1", "disaggdeployments"
    manifest = dd_manifest("lora", model={"maxLoras": 2, "adapters": [{"name": "sql", "source": "hf://org/sql"}]})
    custom.create_namespaced_custom_object(group, version, namespace, plural, manifest)
    disc = EndpointSliceDiscovery(api_client, namespace, {ROLE_PREFILL: "lora-prefill", ROLE_DECODE: "lora-decode"},
                                  interval_s=0.2)
    seen: list[dict] = []
    status = [{"name": "sql", "prefill": 1, "decode": 2, "ready": True, "message": ""}]
    disc.on_adapters = seen.append
    disc.adapter_status = lambda: status

    def dd() -> dict:
        return custom.get_namespaced_custom_object(group, version, namespace, plural, "lora")

    async def main() -> None:
        task = asyncio.create_task(disc.run(lambda role, endpoints: None))
        try:
            await asyncio.to_thread(wait_for, lambda: (dd().get("status") or {}).get("adapters") == status, 30,
                                    "status.adapters written")
            assert seen[-1] == {"sql": "hf://org/sql"}
            custom.patch_namespaced_custom_object(group, version, namespace, plural, "lora",
                                                  {"spec": {"model": {"adapters": []}}})
            await asyncio.to_thread(wait_for, lambda: seen[-1] == {}, 30, "the adapter's removal seen")
        finally:
            task.cancel()

    asyncio.run(main())
    managers = {f["manager"]: f for f in dd()["metadata"]["managedFields"] if f.get("subresource") == "status"}
    assert "f:adapters" in str(managers[ROUTER_FIELD_MANAGER]["fieldsV1"])
