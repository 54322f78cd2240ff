"""`make demo`: the main job on the embedded default.

Brings up the local control plane with its simulated GPU pools, installs the
CRD, shows the API refusing bad specs with messages that name the field, runs
the operator (in this process, under its least-privilege ServiceAccount),
applies the deployments in examples/ (NVL72-style racks from e2e/clusters/nvl72.yaml added for the
wide expert-parallel one), waits for them to be Ready, and prints `kubectl get dd` and where every
prefill/decode pod landed (NVLink domain, rack): every pod of a multi-pod replica in one domain.

Then it serves for real: the project's images are built from the Dockerfile into the real node's image
store (BuildKit; reused when nothing changed), and a DisaggDeployment of the tiny model (generated here)
runs its prefill, decode and router pods on the real node; a chat request through its Service is
answered and printed with the route it took (prefill pod -> decode pod, NIXL bytes moved).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import yaml

from disagg.api.names import LABEL_GROUP
from disagg.operator.render import ROUTER_IMAGE_ENV

from .localcluster import LocalCluster, nodepools
from .operator_fixture import operator_kubeconfig, running_operator
from .testing import wait_for

REPO = Path(__file__).resolve().parent.parent


def _show(title: str, text: str) -> None:
    print(f"\n=== {title}\n{text.rstrip()}")


DEMO_NS = "demo"
TINY = "tiny"


def run(cluster_name: str = "default") -> int:
    cluster = LocalCluster(cluster_name, real_node=True)
    print(f"starting the local control plane {cluster_name!r} with its real node (reused if already up) ...")
    cluster.up()
    if cluster.node is None:
        print(f"cluster {cluster_name!r} runs without a real node; `disagg cluster down --name {cluster_name}` "
              "and run the demo again", file=sys.stderr)
        return 1
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=300s",
                    "crd/disaggdeployments.serving.disagg.dev")
    _show("GPU node pools (kubectl get nodes -L nvidia.com/gpu.clique,topology.kubernetes.io/zone)",
          cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.clique,topology.kubernetes.io/zone").stdout)

    from kubernetes import client, config

    api = config.new_client_from_config(str(cluster.kubeconfig))
    # the NVL72-style racks the wide expert-parallel example needs, beside the default pools
    nodepools.add_gpu_pools(client.CoreV1Api(api), nodepools.CLUSTERS / "nvl72.yaml", first_address=8192)
    examples = sorted((REPO / "examples").glob("*.yaml"))
    base = yaml.safe_load((REPO / "examples" / "small.yaml").read_text())
    refusals = [
        ("tensorParallelSize 4 on a replica of 2 GPUs",
         {"tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": 2}}}, "prefill"),
        ("minReplicas above replicas", {"replicas": 1, "minReplicas": 3}, "decode"),
    ]
    for title, edit, role in refusals:
        doc = copy.deepcopy(base)
        doc["metadata"]["name"] = "refused"
        doc["spec"][role].update(edit)
        out = cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc), check=False)
        _show(f"refused at admission: {title}", out.stderr)

    kubeconfig = operator_kubeconfig(cluster, api, cluster.dir / "operator.kubeconfig")
    print("\nstarting the operator (in this process, as ServiceAccount disagg-system/disagg-operator) ...")
    with running_operator(kubeconfig):
        for path in examples:
            _show(f"kubectl apply -f examples/{path.name}", cluster.kubectl("apply", "-f", str(path)).stdout)
        names = [yaml.safe_load(p.read_text())["metadata"]["name"] for p in examples]
        custom = client.CustomObjectsApi(api)

        def phases():
            return {n: (custom.get_namespaced_custom_object("serving.disagg.dev", "v1alpha1", "default",
                                                            "disaggdeployments", n).get("status") or {}).get("phase")
                    for n in names}
        wait_for(lambda: set(phases().values()) == {"Ready"}, 180, "the examples to be Ready")
        answer = _serve_for_real(cluster, api)
    _show("placement of prefill/decode pods (node, NVLink domain, rack)", _placement(api, "default")
          + "\n\n" + _placement(api, DEMO_NS))
    _show("kubectl get dd -A", cluster.kubectl("get", "dd", "-A", "-o", "wide").stdout)
    _show("a chat request through the tiny deployment's Service, served by its pods on the real node "
          "(the tiny model's weights are random: its words are noise, the tokens and the route are real)", answer)
    print(f"\nThe cluster keeps running (the operator stopped with the demo); use it with:\n  export KUBECONFIG={cluster.kubeconfig}\n"
          "Stop it with `make cluster-down` (before `make test`: one real node runs per machine)")
    return 0


def _serve_for_real(cluster: LocalCluster, api) -> str:
    """The tiny model served on the real node; returns what to print about the answer."""
    from kubernetes import client

    from disagg.workers.envpath import worker_python
    from disagg.workers.tinymodel import ensure

    from . import realnode
    from .images import ensure_images

    print("\nbuilding the images from the Dockerfile into the real node (BuildKit; reused when unchanged) ...")
    images = ensure_images(str(cluster.node.containerd_socket))
    os.environ[ROUTER_IMAGE_ENV] = images["control-plane"]  # as the chart tells the operator pod
    model = ensure(worker_python())
    core = client.CoreV1Api(api)
    if not any(n.metadata.name == DEMO_NS for n in core.list_namespace().items):
        core.create_namespace({"metadata": {"name": DEMO_NS}})
    wait_for(lambda: any(sa.metadata.name == "default" for sa in core.list_namespaced_service_account(DEMO_NS).items),
             60, "the demo namespace's default ServiceAccount")
    try:
        core.read_namespaced_persistent_volume_claim(realnode.MODEL_CLAIM, DEMO_NS)
        source = f"pvc://{realnode.MODEL_CLAIM}"
    except client.exceptions.ApiException:
        source = realnode.install_model(api, DEMO_NS, model)
    doc = realnode.deployment(TINY, source, images["worker-cpu"])
    _show(f"kubectl apply -n {DEMO_NS} (the tiny model on the real node)",
          cluster.kubectl("apply", "-n", DEMO_NS, "-f", "-", input=yaml.safe_dump(doc)).stdout)
    print("waiting for its prefill, decode and router pods to be Ready (CPU vLLM starts in a minute or two) ...")
    custom = client.CustomObjectsApi(api)
    wait_for(lambda: (custom.get_namespaced_custom_object("serving.disagg.dev", "v1alpha1", DEMO_NS, "disaggdeployments",
                                                          TINY).get("status") or {}).get("phase") == "Ready",
             900, f"{TINY} to be Ready", interval=2)
    url = realnode.router_url(api, DEMO_NS, TINY)
    realnode.wait_serving(api, DEMO_NS, TINY)
    return realnode.chat(url, "Hello from disagg! Tell me how a prefill hands its KV cache to a decode worker. " * 3)


def _placement(api, namespace: str) -> str:
    from kubernetes import client

    core = client.CoreV1Api(api)
    nodes = {n.metadata.name: n.metadata.labels for n in core.list_node().items}
    rows = [("DEPLOYMENT", "ROLE", "REPLICA", "POD", "NODE", "NVLINK DOMAIN", "RACK")]
    for pod in sorted(core.list_namespaced_pod(namespace, label_selector="serving.disagg.dev/deployment").items,
                      key=lambda p: (p.metadata.labels["serving.disagg.dev/deployment"],
                                     p.metadata.labels.get("serving.disagg.dev/role", ""), p.metadata.name)):
        labels = nodes.get(pod.spec.node_name or "", {})
        rows.append((pod.metadata.labels["serving.disagg.dev/deployment"],
                     pod.metadata.labels.get("serving.disagg.dev/role", ""),
                     pod.metadata.labels.get(LABEL_GROUP, "-"), pod.metadata.name,
                     pod.spec.node_name or "<pending>", labels.get(nodepools.CLIQUE_LABEL, "-"),
                     labels.get(nodepools.RACK_LABEL, "-")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)
