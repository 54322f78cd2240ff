"""Fixtures: one real local control plane per test run, one namespace per test."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """The local control plane (etcd, kube-apiserver, scheduler, controller-manager, kwok GPU pools),
    started once for the test run and torn down after it."""
    from disagg.e2e.localcluster import LocalCluster
    from disagg.e2e.operator_fixture import AUDITED_NAMESPACE

    c = LocalCluster(f"test-{os.getpid()}", state_dir=tmp_path_factory.mktemp("cluster"),
                     audit_groups=(f"system:serviceaccounts:{AUDITED_NAMESPACE}",))
    c.up()
    yield c
    c.down()


@pytest.fixture(scope="session")
def api_client(cluster):
    from kubernetes import config

    client = config.new_client_from_config(str(cluster.kubeconfig))
    yield client
    client.close()


@pytest.fixture(scope="session")
def crd_installed(cluster):
    """The DisaggDeployment CRD, applied from crds/ and Established."""
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=300s",
                    "crd/disaggdeployments.serving.disagg.dev")
    return True


@pytest.fixture(scope="session")
def other_gang_crds(cluster):
    """CRDs of the coscheduling and Volcano PodGroups (their schedulers do not run here, so pods
    of those backends stay unbound)."""
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "e2e" / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=300s",
                    "crd/podgroups.scheduling.x-k8s.io", "crd/podgroups.scheduling.volcano.sh")
    return True


@pytest.fixture
def namespace(request, api_client):
    """A fresh namespace for one test, deleted afterwards."""
    from kubernetes import client

    from disagg.e2e.testing import wait_for

    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:6]
    name = f"t-{request.node.name.lower().replace('_', '-')[:40].strip('-')}-{digest}"
    name = "".join(ch if ch.isalnum() or ch == "-" else "-" for ch in name)
    core = client.CoreV1Api(api_client)
    core.create_namespace({"metadata": {"name": name}})
    # Pods need the namespace's default ServiceAccount, made by the controller-manager.
    wait_for(lambda: any(sa.metadata.name == "default"
                         for sa in core.list_namespaced_service_account(name).items),
             30, f"default ServiceAccount in {name}")
    yield name
    core.delete_namespace(name)
    # Wait until its pods are gone, so they no longer hold GPUs the next test counts on.
    wait_for(lambda: not core.list_namespaced_pod(name).items, 120, f"pods of namespace {name} to be deleted")


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster, api_client, crd_installed, tmp_path_factory):
    """Credentials of the operator's own ServiceAccount, bound to operator/rbac.yaml and nothing else."""
    from disagg.e2e.operator_fixture import operator_kubeconfig as make

    return make(cluster, api_client, tmp_path_factory.mktemp("operator") / "kubeconfig")


@pytest.fixture(scope="module")
def operator(operator_kubeconfig):
    """The operator running in this process under least privilege, for one test module."""
    from disagg.e2e.operator_fixture import running_operator

    with running_operator(operator_kubeconfig) as runner:
        yield runner
