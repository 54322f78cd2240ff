"""Every Kubernetes call the operator makes has a timeout (disagg/api/kube.py): against an API server that
accepts connections and never answers (a real listening socket nobody reads from), the fleet's first list,
which every kopf thread waits on, fails within the timeout and frees its lock, instead of hanging every
thread for good."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import yaml

from disagg.api import kube
from disagg.operator.children import Clients
from disagg.operator.fleet import Fleet


@pytest.fixture
def silent_server():
    """Accepts TCP connections (the kernel's backlog) and never sends a byte."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_silent_api_server_fails_the_fleet_list_instead_of_holding_its_lock(silent_server, tmp_path, monkeypatch):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": silent_server}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setattr(kube, "KUBE_REQUEST_TIMEOUT", (1.0, 1.0))   # the operator's clients, a short bound
    fleet = Fleet(Clients.create())
    outcome: list = []

    def first_list() -> None:
        try:
            fleet.free_gpus()
            outcome.append("answered")
        except Exception as e:  # noqa: BLE001  (whatever the client raises for a timeout)
            outcome.append(e)
    started = time.monotonic()
    t = threading.Thread(target=first_list, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the first fleet list still hangs after 60 s"
    assert outcome and isinstance(outcome[0], Exception), outcome
    assert "timed out" in repr(outcome[0]).lower() or "timeout" in repr(outcome[0]).lower(), outcome[0]
    assert time.monotonic() - started < 30
    assert fleet._listing.acquire(blocking=False), "the lock every status refresh waits on is free again"
    fleet._listing.release()
