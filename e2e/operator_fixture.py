"""Run the operator in-process against the local cluster under its own
least-privilege identity (operator/rbac.yaml), as the tests and the demo do."""

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


def operator_kubeconfig(cluster: LocalCluster, api: client.ApiClient, path: Path) -> Path:
    """A kubeconfig carrying a token of the operator's ServiceAccount, bound to operator/rbac.yaml only."""
    cluster.kubectl("apply", "--server-side", "-f", str(RBAC))
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    cluster.kubectl("create", "serviceaccount", ACCOUNT, "-n", NAMESPACE, check=False)
    cluster.kubectl("create", "clusterrolebinding", ACCOUNT, "--clusterrole", "disagg-operator",
                    f"--serviceaccount={NAMESPACE}:{ACCOUNT}", check=False)
    return token_kubeconfig(cluster.kubeconfig, api, NAMESPACE, ACCOUNT, path)


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
def running_operator(kubeconfig: Path) -> Iterator[object]:
    """The operator in this process (kopf's KopfRunner), using `kubeconfig`."""
    from kopf.testing import KopfRunner

    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(kubeconfig)
    if "DISAGG_OPERATOR_METRICS_PORT" not in os.environ:   # a free port, not the default 8000
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["DISAGG_OPERATOR_METRICS_PORT"] = str(sock.getsockname()[1])
    try:
        with KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "disagg.operator.handlers"],
                        timeout=60) as runner:
            yield runner
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old
