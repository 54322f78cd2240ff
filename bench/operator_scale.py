"""Operator at fleet scale, against a baseline measured in the same run.

On a generated pool of GPU nodes (default 1,000 nodes x 8 GPUs, kwok), create N
DisaggDeployments (2 prefill + 2 decode + 1 router each, the whole set as one gang)
and time until every one is Ready. Baseline: the same pods created directly as
plain Deployments (no gang, no operator), timed until all are ready.
Also reports the operator's peak RSS and the write requests it makes to the API
server (counted from the API server's audit log) during an idle window afterwards.

    .venv/bin/python bench/operator_scale.py [--nodes 1000] [--deployments 100] [--idle 60]

Goal: ratio <= 1.3, 0 idle writes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from kubernetes import client, config

from disagg.e2e.localcluster import LocalCluster
from disagg.e2e.localcluster.controlplane import free_port
from disagg.e2e.operator_fixture import ACCOUNT, NAMESPACE, operator_kubeconfig
from disagg.e2e.testing import dd_manifest, wait_for

REPO = Path(__file__).resolve().parent.parent


def pools(nodes: int) -> dict:
    per_rack = 5 * 4  # 5 NVLink domains of 4 nodes
    racks = max(1, nodes // (2 * per_rack))
    return {"pools": [
        {"name": "h100", "zones": 2, "racksPerZone": racks, "nvlinkDomainsPerRack": 5, "nodesPerDomain": 4,
         "gpus": 8, "gpuProduct": "NVIDIA-H100-80GB-HBM3", "cpu": "192", "memory": "2Ti"},
        {"name": "cpu", "nodesPerDomain": 20, "gpus": 0, "cpu": "64", "memory": "256Gi"}]}


def plain_deployments(i: int) -> list[dict]:
    out = []
    for role, replicas, gpus in (("prefill", 2, 1), ("decode", 2, 1), ("router", 1, 0)):
        labels = {"bench": f"d{i}", "role": role}
        container = {"name": "main", "image": "disagg/worker:0.1.0"}
        if gpus:
            container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
        out.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"d{i}-{role}"},
                    "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                             "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}}}})
    return out


def ready_pods(core: client.CoreV1Api, namespace: str) -> int:
    return sum(1 for p in core.list_namespaced_pod(namespace).items
               if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or []))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--deployments", type=int, default=100)
    ap.add_argument("--idle", type=int, default=60)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="disagg-bench-"))
    (work / "pools.yaml").write_text(yaml.safe_dump(pools(args.nodes)))
    cluster = LocalCluster("bench", state_dir=work / "state", audit_writes=True)
    t = time.monotonic()
    cluster.up(nodes_file=work / "pools.yaml", timeout=900)
    print(f"cluster with {args.nodes} GPU nodes up in {time.monotonic() - t:.0f}s", flush=True)
    operator = None
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        api = config.new_client_from_config(str(cluster.kubeconfig))
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        custom = client.CustomObjectsApi(api)
        want = args.deployments * 5

        # ---- baseline: the same pods as plain Deployments
        core.create_namespace({"metadata": {"name": "baseline"}})
        wait_for(lambda: core.list_namespaced_service_account("baseline").items, 60, "baseline SA")
        t = time.monotonic()
        for i in range(args.deployments):
            for dep in plain_deployments(i):
                apps.create_namespaced_deployment("baseline", dep)
        wait_for(lambda: ready_pods(core, "baseline") >= want, 1800, "baseline pods ready", interval=1)
        t_base = time.monotonic() - t
        print(f"baseline: {want} pods of plain Deployments ready in {t_base:.1f}s", flush=True)
        core.delete_namespace("baseline")
        wait_for(lambda: not core.list_namespaced_pod("baseline").items, 600, "baseline deleted", interval=1)

        # ---- the operator, as its own process under its own ServiceAccount
        kubeconfig = operator_kubeconfig(cluster, api, work / "operator.kubeconfig")
        log = open(work / "operator.log", "w")
        operator = subprocess.Popen([sys.executable, "-m", "disagg.operator", "--liveness",
                                     f"http://127.0.0.1:{free_port()}/healthz"], env={**os.environ, "KUBECONFIG": str(kubeconfig)},
                                    stdout=log, stderr=subprocess.STDOUT)
        core.create_namespace({"metadata": {"name": "ops"}})
        wait_for(lambda: core.list_namespaced_service_account("ops").items, 60, "ops SA")
        time.sleep(3)
        t = time.monotonic()
        for i in range(args.deployments):
            custom.create_namespaced_custom_object("serving.disagg.dev", "v1alpha1", "ops", "disaggdeployments",
                                                   dd_manifest(f"d{i}", prefill={"replicas": 2},
                                                               decode={"replicas": 2},
                                                               scheduling={"gang": {"minPrefill": 2, "minDecode": 2}}))

        def all_ready() -> bool:
            items = custom.list_namespaced_custom_object("serving.disagg.dev", "v1alpha1", "ops",
                                                         "disaggdeployments")["items"]
            return len(items) == args.deployments and all((o.get("status") or {}).get("phase") == "Ready"
                                                          for o in items)
        wait_for(all_ready, 1800, "every DisaggDeployment Ready", interval=1)
        t_op = time.monotonic() - t
        print(f"operator: {args.deployments} DisaggDeployments ({want} pods, gangs) Ready in {t_op:.1f}s",
              flush=True)

        # ---- idle: no write may come from the operator, once every status has settled (Ready can
        # come a refresh before Progressing turns False, and old gang objects are pruned after that)
        def all_settled() -> bool:
            items = custom.list_namespaced_custom_object("serving.disagg.dev", "v1alpha1", "ops",
                                                         "disaggdeployments")["items"]
            return all(c["status"] == "False" for o in items for c in o["status"].get("conditions", [])
                       if c["type"] in ("Progressing", "Degraded"))
        wait_for(all_settled, 600, "every status settled", interval=1)
        time.sleep(5)
        offset = cluster.audit_log.stat().st_size
        time.sleep(args.idle)
        user = f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}"
        with open(cluster.audit_log) as f:
            f.seek(offset)
            writes = [json.loads(line) for line in f if user in line]
        writes = [w for w in writes if w.get("user", {}).get("username") == user]
        rss_kib = next(int(line.split()[1]) for line in Path(f"/proc/{operator.pid}/status").read_text().splitlines()
                       if line.startswith("VmHWM:"))
        print(json.dumps({
            "nodes": args.nodes, "deployments": args.deployments, "pods": want,
            "baseline_seconds": round(t_base, 1), "operator_seconds": round(t_op, 1),
            "ratio_operator_over_baseline": round(t_op / t_base, 2),
            "operator_peak_rss_mib": round(rss_kib / 1024, 1),
            f"operator_writes_in_{args.idle}s_idle": len(writes),
            "idle_write_examples": [f"{w['verb']} {w['objectRef'].get('resource')}/{w['objectRef'].get('name')}"
                                    for w in writes[:5]],
        }, indent=2))
        return 0
    finally:
        if operator:
            operator.terminate()
            operator.wait(30)
        cluster.down()


if __name__ == "__main__":
    sys.exit(main())
