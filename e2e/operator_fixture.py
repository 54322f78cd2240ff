"""Run the operator in-process against the local cluster under its own
least-privilege identity (operator/rbac.yaml), as the tests and the demo do; the planner's
identity (its own ServiceAccount and role) likewise."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import yaml
from kubernetes import client

from .localcluster import LocalCluster

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
