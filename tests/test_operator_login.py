"""The operator's API connections: kopf's are bounded (operator/handlers.py login: kopf's default pool
opens one TLS connection per concurrent request, without limit), and the kubernetes client's keep one per
thread (operator/children.py)."""

from __future__ import annotations

import asyncio

import kopf
import pytest
import yaml

from disagg.operator import handlers


@pytest.fixture
def kubeconfig(tmp_path, monkeypatch):
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u", "namespace": "ns1"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return path


@pytest.mark.parametrize("namespaces", [[], ["a", "b", "c"]])
def test_login_gives_kopf_a_bounded_pool_above_the_watches(kubeconfig, monkeypatch, namespaces):
    monkeypatch.setattr(handlers, "NAMESPACES", namespaces)

    async def login():
        info = await handlers.login(logger=handlers.log, settings=kopf.OperatorSettings())
        try:
            return (info.server, info.default_namespace, info.aiohttp_session.connector.limit,
                    dict(info.aiohttp_session.headers))
        finally:
            await info.aiohttp_session.close()

    server, namespace, limit, headers = asyncio.run(login())
    assert (server, namespace) == ("https://127.0.0.1:6443", "ns1")
    assert headers.get("Authorization") == "Bearer t0ken"
    watches = handlers.WATCHED_KINDS * max(1, len(namespaces))
    # bounded (kopf's own is 0, unlimited), and the short requests keep connections beside the watches
    assert limit == watches + handlers.API_CONNECTIONS


def test_the_handlers_client_keeps_a_connection_per_thread(kubeconfig):
    """The kubernetes client behind the reconciles and status loops keeps as many connections as there are
    threads calling it (its default, 5 per CPU, threw away a TLS connection per request beyond that)."""
    from disagg.operator.children import Clients

    clients = Clients.create(pool=24)
    assert clients.api.configuration.host == "https://127.0.0.1:6443"
    assert clients.api.rest_client.pool_manager.connection_pool_kw["maxsize"] == 24
    assert clients.api.configuration.api_key == {"BearerToken": "Bearer t0ken"}
