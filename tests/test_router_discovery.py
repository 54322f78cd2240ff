"""The router discovers workers from EndpointSlices on a real API server (the local control plane)."""

from __future__ import annotations

import pytest

from disagg.api.names import ROLE_DECODE, ROLE_PREFILL
from disagg.router.config import RouterConfig
from disagg.router.discovery import SERVICE_NAME_LABEL, EndpointSliceDiscovery
from disagg.router.metrics import RouterMetrics
from disagg.router.service import Router

pytestmark = pytest.mark.cluster


def _slice(name: str, service: str, endpoints: list[tuple[str, bool]]) -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "labels": {SERVICE_NAME_LABEL: service,
                                                  "endpointslice.kubernetes.io/managed-by": "disagg-tests"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"},
                      {"name": "kv-events", "port": 5557, "protocol": "TCP"},
                      {"name": "kv-replay", "port": 5558, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip, ready in endpoints]}


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
