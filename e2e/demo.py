"""`make demo`: the main job on the embedded default.

Brings up the local control plane with its simulated GPU pools, installs the
CRD, shows the API refusing bad specs with messages that name the field, runs
the operator (in this process, under its least-privilege ServiceAccount),
applies the deployments in examples/, waits for them to be Ready, and prints
`kubectl get dd` and where every prefill/decode pod landed (NVLink domain, rack).
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from .localcluster import LocalCluster, nodepools
from .operator_fixture import operator_kubeconfig, running_operator
from .testing import wait_for

REPO = Path(__file__).resolve().parent.parent


def _show(title: str, text: str) -> None:
    print(f"\n=== {title}\n{text.rstrip()}")


def run(cluster_name: str = "default") -> int:
    cluster = LocalCluster(cluster_name)
    print(f"starting the local control plane {cluster_name!r} (reused if already up) ...")
    cluster.up()
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=300s",
                    "crd/disaggdeployments.serving.disagg.dev")
    _show("GPU node pools (kubectl get nodes -L nvidia.com/gpu.clique,topology.kubernetes.io/zone)",
          cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.clique,topology.kubernetes.io/zone").stdout)

    examples = sorted((REPO / "examples").glob("*.yaml"))
    base = yaml.safe_load(examples[0].read_text())
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

    from kubernetes import client, config

    api = config.new_client_from_config(str(cluster.kubeconfig))
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
        wait_for(lambda: set(phases().values()) == {"Ready"}, 120, "the examples to be Ready")
    _show("placement of prefill/decode pods (node, NVLink domain, rack)", _placement(api))
    _show("kubectl get dd", cluster.kubectl("get", "dd", "-o", "wide").stdout)
    print(f"\nThe cluster keeps running (the operator stopped with the demo); use it with:\n  export KUBECONFIG={cluster.kubeconfig}\n"
          "Stop it with: make cluster-down")
    return 0


def _placement(api) -> str:
    from kubernetes import client

    core = client.CoreV1Api(api)
    nodes = {n.metadata.name: n.metadata.labels for n in core.list_node().items}
    rows = [("DEPLOYMENT", "ROLE", "POD", "NODE", "NVLINK DOMAIN", "RACK")]
    for pod in sorted(core.list_namespaced_pod("default", label_selector="serving.disagg.dev/deployment").items,
                      key=lambda p: (p.metadata.labels["serving.disagg.dev/deployment"],
                                     p.metadata.labels.get("serving.disagg.dev/role", ""), p.metadata.name)):
        labels = nodes.get(pod.spec.node_name or "", {})
        rows.append((pod.metadata.labels["serving.disagg.dev/deployment"],
                     pod.metadata.labels.get("serving.disagg.dev/role", ""), pod.metadata.name,
                     pod.spec.node_name or "<pending>", labels.get(nodepools.CLIQUE_LABEL, "-"),
                     labels.get(nodepools.RACK_LABEL, "-")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)
