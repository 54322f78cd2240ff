"""Where the end-to-end suite (tests/test_e2e_helm.py) runs, chosen by ``DISAGG_E2E_PROVIDER``:

- ``local`` (default, CI): this repository's control plane (real kube-apiserver, scheduler and
  controller-manager) with kwok's simulated GPU node pools. The chart is installed with
  ``operator.enabled=false`` and the operator runs from the source tree in the test process, under a
  token of the chart's ServiceAccount (so with exactly the chart's RBAC). kwok makes bound pods
  Running and Ready; no image is ever pulled.
- ``kind`` (a machine with Docker, see e2e/kind/README.md): a kind cluster whose workers are labelled as
  GPU pools and advertise ``nvidia.com/gpu``; the chart runs the operator from the Dockerfile's
  control-plane image, loaded into kind. The nodes have no GPUs, so the examples' workers run a stub
  worker image that answers the worker's probes (e2e/kind/stub-worker); everything else (kubelets, the
  router, the operator pod) is real. One DisaggDeployment of the tiny model runs the real CPU worker
  image (vLLM's CPU build, NIXL) on one node and serves (:meth:`KindProvider.tiny_model_deployment`).

A provider gives the suite a kubeconfig, kubectl and helm, the chart values that fit it, and
``adapt``: an example DisaggDeployment fitted to its nodes and images.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "disagg"
PROVIDER_ENV = "DISAGG_E2E_PROVIDER"
PROVIDERS = ("local", "kind")


class Unsupported(RuntimeError):
    """What a provider cannot do here, and why (a test skips with it)."""


def provider_name() -> str:
    name = os.environ.get(PROVIDER_ENV, "local")
    if name not in PROVIDERS:
        raise ValueError(f"{PROVIDER_ENV}={name!r}: expected one of {', '.join(PROVIDERS)}")
    return name


class Provider:
    name: str
    kubeconfig: Path
    # True: the chart runs without its operator pod and the suite runs the operator in-process.
    operator_in_process: bool
    kubectl_bin: Path
    helm_bin: Path

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.kubectl_bin), f"--kubeconfig={self.kubeconfig}", *args],
                              check=check, capture_output=True, text=True, input=input)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([str(self.helm_bin), f"--kubeconfig={self.kubeconfig}", *args],
                             capture_output=True, text=True)
        if check and out.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return out

    def chart_values(self) -> list[str]:
        """`helm install` arguments for the suite's release."""
        raise NotImplementedError

    def adapt(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """An example DisaggDeployment fitted to this provider's nodes and images (a copy)."""
        return copy.deepcopy(manifest)

    def next_worker_image(self, image: str) -> str:
        """Another worker image the nodes can run, for a rollout."""
        return "disagg/worker:0.1.1"

    def prepare_namespace(self, api, namespace: str) -> None:
        """What a test namespace needs before examples are applied in it (nothing, by default)."""

    def tiny_model_deployment(self, name: str) -> dict[str, Any]:
        """The tiny model on the CPU worker image, placed where that image is (e2e/realnode.py's deployment);
        raises :class:`Unsupported` where no worker pod runs an image."""
        raise Unsupported(f"the {self.name} provider runs no worker image")

    def cleanup_namespace(self, api, namespace: str) -> None:
        """Removes what :meth:`prepare_namespace` made outside the namespace."""

    def api_client(self):
        from kubernetes import config

        return config.new_client_from_config(str(self.kubeconfig))


class LocalProvider(Provider):
    name = "local"
    operator_in_process = True

    def __init__(self, cluster):
        self.cluster = cluster
        self.kubeconfig = cluster.kubeconfig
        bins = Path(cluster._state()["bin"])
        self.kubectl_bin, self.helm_bin = bins / "kubectl", bins / "helm"

    def chart_values(self) -> list[str]:
        # Everything from the chart but the operator pod: the operator runs from the source tree.
        return ["--set", "operator.enabled=false"]


class KindProvider(Provider):
    """A kind cluster made by e2e/kind/e2e.sh; ``KUBECONFIG`` points at it."""

    name = "kind"
    operator_in_process = False
    MODEL_CLAIM = "e2e-tiny-model"
    # the label of the node(s) the control-plane image is loaded onto (e2e/kind/cluster.yaml)
    CPU_POOL = ("topology.disagg.dev/pool", "cpu")

    def __init__(self):
        kubeconfig = os.environ.get("KUBECONFIG")
        if not kubeconfig:
            raise RuntimeError("DISAGG_E2E_PROVIDER=kind needs KUBECONFIG (e2e/kind/e2e.sh up prints it)")
        self.kubeconfig = Path(kubeconfig.split(os.pathsep)[0])
        self.control_plane_image = os.environ.get("DISAGG_E2E_CONTROL_PLANE_IMAGE", "disagg/control-plane:0.1.0")
        self.worker_image = os.environ.get("DISAGG_E2E_WORKER_IMAGE", "disagg/e2e-stub-worker:0.1.0")
        # the same stub under a second tag (e2e.sh loads both), for a rollout
        self.worker_image_next = os.environ.get("DISAGG_E2E_WORKER_IMAGE_NEXT", "disagg/e2e-stub-worker:0.1.0-next")
        # The CPU worker image (vLLM's CPU build), streamed by e2e.sh onto this one node only: every node
        # keeps its own unpacked copy, about 7 GB.
        self.cpu_worker_image = os.environ.get("DISAGG_E2E_CPU_WORKER_IMAGE", "")
        self.cpu_worker_node = os.environ.get("DISAGG_E2E_CPU_WORKER_NODE", "")
        # The nodes reach no model hub: e2e.sh copies the tiny model (workers/tinymodel.py, 2 MB) into every
        # node at DISAGG_E2E_MODEL_NODE_DIR, and each test namespace gets a read-only hostPath volume of it,
        # claimed as MODEL_CLAIM: the examples' routers load its tokenizer, the tiny model's workers the
        # model. DISAGG_E2E_TOKENIZER: a tokenizer the nodes can download instead, for the examples.
        self.model_node_dir = os.environ.get("DISAGG_E2E_MODEL_NODE_DIR", "")
        self.tokenizer = os.environ.get("DISAGG_E2E_TOKENIZER") or (
            f"pvc://{self.MODEL_CLAIM}" if self.model_node_dir else "hf://Qwen/Qwen2.5-0.5B-Instruct")
        found = {tool: shutil.which(tool) for tool in ("kubectl", "helm")}
        if not all(found.values()):
            from .localcluster import binaries

            bins = binaries()
            found = {tool: path or str(bins / tool) for tool, path in found.items()}
        self.kubectl_bin, self.helm_bin = Path(found["kubectl"]), Path(found["helm"])

    def chart_values(self) -> list[str]:
        repository, _, tag = self.control_plane_image.rpartition(":")
        # e2e.sh loads the images, never pull them; the control-plane image only onto the CPU pool's node
        # (each node keeps its own unpacked copy: on every node it would cost gigabytes), where the operator,
        # the planner and the routers run.
        key = self.CPU_POOL[0].replace(".", "\\.")
        return ["--set-string", f"operator.nodeSelector.{key}={self.CPU_POOL[1]}",
                "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
                "--set", "image.pullPolicy=Never"]

    def next_worker_image(self, image: str) -> str:
        return self.worker_image_next

    def prepare_namespace(self, api, namespace: str) -> None:
        if not self.model_node_dir:
            return
        from kubernetes import client

        core = client.CoreV1Api(api)
        pv_name = f"{self.MODEL_CLAIM}-{namespace}"
        # every node holds the same copy, so no node affinity: worker pods mount the claim too
        core.create_persistent_volume({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv_name},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                     "hostPath": {"path": self.model_node_dir, "type": "Directory"},
                     "claimRef": {"namespace": namespace, "name": self.MODEL_CLAIM}}})
        core.create_namespaced_persistent_volume_claim(namespace, {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": self.MODEL_CLAIM},
            "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv_name,
                     "resources": {"requests": {"storage": "1Gi"}}}})

    def cleanup_namespace(self, api, namespace: str) -> None:
        if not self.model_node_dir:
            return
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            client.CoreV1Api(api).delete_persistent_volume(f"{self.MODEL_CLAIM}-{namespace}")
        except ApiException as e:
            if e.status != 404:
                raise

    def tiny_model_deployment(self, name: str) -> dict[str, Any]:
        if not (self.cpu_worker_image and self.cpu_worker_node):
            raise Unsupported("no CPU worker image on the nodes (e2e.sh streams it unless "
                              "DISAGG_E2E_SKIP_CPU_WORKER_IMAGE=1; DISAGG_E2E_CPU_WORKER_IMAGE/_NODE name it)")
        if not self.model_node_dir:
            raise Unsupported("the tiny model is not on the nodes (DISAGG_E2E_MODEL_NODE_DIR)")
        from .realnode import deployment

        return deployment(name, f"pvc://{self.MODEL_CLAIM}", self.cpu_worker_image,
                          worker_placement={"nodeSelector": {"kubernetes.io/hostname": self.cpu_worker_node}},
                          router_placement={"nodeSelector": dict([self.CPU_POOL])})

    @contextlib.contextmanager
    def port_forward(self, namespace: str, pod: str, *ports: int) -> Iterator[dict[int, int]]:
        """``kubectl port-forward`` to ``pod``'s ``ports`` (through the API server and the pod's kubelet: the
        kind nodes' pod network is not routed from this host); yields each port's local one on 127.0.0.1."""
        proc = subprocess.Popen([str(self.kubectl_bin), f"--kubeconfig={self.kubeconfig}", "port-forward",
                                 "--address=127.0.0.1", "-n", namespace, f"pod/{pod}", *(f":{p}" for p in ports)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            local: dict[int, int] = {}
            lines = []
            while len(local) < len(ports):
                line = proc.stdout.readline()
                if not line:
                    raise AssertionError(f"kubectl port-forward to {namespace}/{pod} exited ({proc.wait()}): "
                                         + "".join(lines))
                lines.append(line)
                m = re.match(r"Forwarding from 127\.0\.0\.1:(\d+) -> (\d+)", line)
                if m:
                    local[int(m.group(2))] = int(m.group(1))
            yield local
        finally:
            proc.terminate()
            proc.wait()
            proc.stdout.close()

    def adapt(self, manifest: dict[str, Any]) -> dict[str, Any]:
        doc = copy.deepcopy(manifest)
        spec = doc["spec"]
        spec.setdefault("engine", {})
        spec["engine"]["image"] = self.worker_image
        spec["engine"]["imagePullPolicy"] = "Never"
        spec["model"]["tokenizer"] = self.tokenizer
        spec["model"].pop("secretRef", None)
        spec.setdefault("router", {})["nodeSelector"] = dict([self.CPU_POOL])
        # kind nodes offer the host's CPUs and memory: keep only the (advertised) GPUs.
        for role in ("prefill", "decode"):
            resources = spec.get(role, {}).get("resources") or {}
            for part in ("requests", "limits"):
                kept = {k: v for k, v in (resources.get(part) or {}).items() if k not in ("cpu", "memory")}
                if kept:
                    resources[part] = kept
                else:
                    resources.pop(part, None)
        return doc


def make_provider(local_cluster=None) -> Provider:
    """The provider ``DISAGG_E2E_PROVIDER`` names; ``local_cluster`` (a callable returning a started
    LocalCluster) is only called for the local provider."""
    name = provider_name()
    if name == "kind":
        return KindProvider()
    return LocalProvider(local_cluster())
