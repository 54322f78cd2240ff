"""`make demo`: the main job on the embedded default.

Brings up the local control plane with its simulated GPU pools, installs the
CRD, applies the deployments in examples/, shows the API refusing bad specs with
messages that name the field, and prints `kubectl get dd` and the GPU fleet.
Placement of prefill/decode pods is shown once the operator is running.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from .localcluster import LocalCluster

REPO = Path(__file__).resolve().parent.parent


def _show(title: str, text: str) -> None:
    print(f"\n=== {title}\n{text.rstrip()}")


def run(cluster_name: str = "default") -> int:
    cluster = LocalCluster(cluster_name)
    print(f"starting the local control plane {cluster_name!r} (reused if already up) ...")
    cluster.up()
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/disaggdeployments.serving.disagg.dev")
    _show("GPU node pools (kubectl get nodes -L nvidia.com/gpu.clique,topology.kubernetes.io/zone)",
          cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.clique,topology.kubernetes.io/zone").stdout)

    examples = sorted((REPO / "examples").glob("*.yaml"))
    for path in examples:
        _show(f"kubectl apply -f examples/{path.name}", cluster.kubectl("apply", "-f", str(path)).stdout)

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

    _show("kubectl get dd", cluster.kubectl("get", "dd", "-o", "wide").stdout)
    print(f"\nThe cluster keeps running; use it with:\n  export KUBECONFIG={cluster.kubeconfig}\n"
          "Stop it with: make cluster-down")
    return 0
