"""Run the operator in-process against the local cluster under its own
least-privilege identity (operator/rbac.yaml), as the tests and the demo do; the planner's
identity (its own ServiceAccount and role) likewise; or as the Helm chart's Deployment runs it
(:func:`chart_operator`: its arguments and environment), as a process of its own."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from kubernetes import client

from .localcluster import LocalCluster

if TYPE_CHECKING:
    from disagg.workers.local import LocalProcess

RBAC = Path(__file__).resolve().parent.parent / "operator" / "rbac.yaml"
NAMESPACE = "disagg-system"
ACCOUNT = "disagg-operator"
# The tests' API server logs every request of the ServiceAccounts in this namespace (tests/conftest.py), so
# tests/test_rbac.py can compare what the chart's accounts do with what their roles grant.
AUDITED_NAMESPACE = "disagg-audited"
PLANNER_ACCOUNT = "disagg-planner"
# operator/rbac.yaml's ClusterRoles each account holds, here bound cluster-wide (all namespaces)
ROLES = {ACCOUNT: ("disagg-operator-cluster", "disagg-operator"), PLANNER_ACCOUNT: ("disagg-planner",)}


def _bound_account(cluster: LocalCluster, account: str) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(RBAC))
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    cluster.kubectl("create", "serviceaccount", account, "-n", NAMESPACE, check=False)
    for role in ROLES[account]:
        cluster.kubectl("create", "clusterrolebinding", role, "--clusterrole", role,
                        f"--serviceaccount={NAMESPACE}:{account}", check=False)


def operator_kubeconfig(cluster: LocalCluster, api: client.ApiClient, path: Path) -> Path:
    """A kubeconfig carrying a token of the operator's ServiceAccount, bound to operator/rbac.yaml's
    operator roles only."""
    _bound_account(cluster, ACCOUNT)
    return token_kubeconfig(cluster.kubeconfig, api, NAMESPACE, ACCOUNT, path)


def planner_kubeconfig(cluster: LocalCluster, api: client.ApiClient, path: Path) -> Path:
    """A kubeconfig carrying a token of the planner's ServiceAccount, bound to operator/rbac.yaml's
    disagg-planner role only."""
    _bound_account(cluster, PLANNER_ACCOUNT)
    return token_kubeconfig(cluster.kubeconfig, api, NAMESPACE, PLANNER_ACCOUNT, path)


def token_kubeconfig(admin_kubeconfig: Path, api: client.ApiClient, namespace: str, account: str, path: Path,
                     expiration_seconds: int = 24 * 3600) -> Path:
    """A kubeconfig for the cluster of `admin_kubeconfig` (its current context's cluster entry) that
    authenticates as ServiceAccount `namespace/account` with a fresh token (TokenRequest), and so holds
    exactly the roles bound to that account: the operator's own, or the Helm chart's."""
    token = client.CoreV1Api(api).create_namespaced_service_account_token(
        account, namespace, {"spec": {"expirationSeconds": expiration_seconds}}).status.token
    admin = yaml.safe_load(Path(admin_kubeconfig).read_text())
    current = next((c["context"] for c in admin.get("contexts", [])
                    if c["name"] == admin.get("current-context")), None)
    cluster_entry = next((c for c in admin["clusters"] if current and c["name"] == current["cluster"]),
                         admin["clusters"][0])
    user = f"{namespace}:{account}"
    config = {"apiVersion": "v1", "kind": "Config", "clusters": [cluster_entry],
              "users": [{"name": user, "user": {"token": token}}],
              "contexts": [{"name": user, "context": {"cluster": cluster_entry["name"], "user": user}}],
              "current-context": user}
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def running_operator(kubeconfig: Path, namespaces: tuple[str, ...] = ()) -> Iterator[object]:
    """The operator in this process (kopf's KopfRunner), using `kubeconfig`; in every namespace, or only
    in `namespaces` (as the chart's operator.watchNamespaces runs it)."""
    from kopf.testing import KopfRunner

    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(kubeconfig)
    if "DISAGG_OPERATOR_METRICS_PORT" not in os.environ:   # a free port, not the default 8000
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["DISAGG_OPERATOR_METRICS_PORT"] = str(sock.getsockname()[1])
    from disagg.operator import handlers

    served = list(handlers.NAMESPACES)
    handlers.NAMESPACES[:] = namespaces   # what `python -m disagg.operator --namespace` sets
    try:
        scope = [f"--namespace={n}" for n in namespaces] or ["--all-namespaces"]
        # the timeout bounds the operator's shutdown (it finishes posting queued events first): generous,
        # a passing run stops in seconds
        with KopfRunner(["run", "--standalone", *scope, "-m", "disagg.operator.handlers"],
                        timeout=180) as runner:
            yield runner
    finally:
        handlers.NAMESPACES[:] = served
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old


@contextlib.contextmanager
def chart_operator(helm: Callable[..., subprocess.CompletedProcess], chart: Path, release: str, namespace: str,
                   kubeconfig: Path, log_dir: Path) -> Iterator[LocalProcess]:
    """The operator as the chart's Deployment runs it: ``python -m`` (the image's entrypoint) with the
    operator container's arguments and environment from ``helm template`` (operator.enabled=true, the
    default), as its own process, authenticated by ``kubeconfig`` instead of the pod's in-cluster
    account. What a pod has that a process on this machine does not: its own network namespace. So
    the metrics port is a free one, passed as the chart's own value (operator.metricsPort), and the
    liveness address the chart fixes (0.0.0.0:8080) becomes a free loopback port; every other argument
    and variable is the chart's. A variable the chart takes from elsewhere (valueFrom) is refused here,
    so that a new one gets a deliberate local value rather than none."""
    from disagg.workers.local import LocalProcess, free_port

    metrics_port, live_port = free_port(), free_port()
    out = helm("template", release, str(chart), "--namespace", namespace, "--set", "operator.enabled=true",
               "--set", f"operator.metricsPort={metrics_port}")
    (container,) = [c for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment"
                    for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "operator"]
    liveness = re.compile(r"^--liveness=http://0\.0\.0\.0:\d+/")
    args = [liveness.sub(f"--liveness=http://127.0.0.1:{live_port}/", a) for a in container["args"]]
    assert sum(bool(liveness.match(a)) for a in container["args"]) == 1, container["args"]
    from_elsewhere = [e["name"] for e in container.get("env", []) if "value" not in e]
    assert not from_elsewhere, f"chart variables without a value to run locally: {from_elsewhere}"
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    assert env["DISAGG_OPERATOR_METRICS_PORT"] == str(metrics_port)
    proc = LocalProcess("chart-operator", [sys.executable, "-m", *args], {**env, "KUBECONFIG": str(kubeconfig)},
                        f"http://127.0.0.1:{live_port}", log_dir)
    proc.metrics_port = metrics_port
    try:
        proc.start().wait_ready(timeout=120, path="/healthz")
        yield proc
    finally:
        # the operator finishes posting queued events before it exits: as generous as running_operator's
        proc.stop(grace=180)
