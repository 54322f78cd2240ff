"""Time from `kubectl apply` of a DisaggDeployment to its first answered token, on the local cluster's real
node (the tiny model, CPU worker image; prefill, decode and router pods as the operator renders them).

Three runs in one script:
- baseline: the same prefill, decode and router as local processes (`disagg serve --local`'s pieces, the
  same CPU vLLM and model), from start to the first streamed token: what serving costs without Kubernetes;
- image cached: the images are in the node's store; apply -> pods scheduled, started, Ready through their
  probes, router discovering the workers -> first token;
- image not cached: the images are removed from the node's store first, so the time includes building them
  again from the Dockerfile (`--cold` also prunes BuildKit's cache, so every layer is rebuilt).
Printed: each total, the phases of the real-node runs, and each real-node total as a ratio of the baseline.

    .venv/bin/python bench/realnode_first_token.py [--cold]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from disagg.e2e import realnode
from disagg.e2e.images import ensure_images
from disagg.e2e.images.buildkit import binaries as buildkit_binaries
from disagg.e2e.localcluster import LocalCluster
from disagg.e2e.operator_fixture import operator_kubeconfig, running_operator
from disagg.e2e.testing import wait_for
from disagg.workers.envpath import worker_python
from disagg.workers.local import _chat, free_port, pd_processes
from disagg.workers.tinymodel import ensure

NS = "bench"
PROMPT = "Hello from disagg! Tell me how a prefill hands its KV cache to a decode worker. " * 3


def first_token(url: str, timeout: float = 900) -> float:
    """Seconds until a streamed chat request through `url` (…/v1) yields its first token, retrying while
    nothing answers yet."""
    start = time.monotonic()

    def attempt():
        try:
            _, first, *_ = _chat(url.removesuffix("/v1"), PROMPT)
            return first
        except (OSError, RuntimeError):
            return None
    return wait_for(attempt, timeout, f"a first token from {url}", interval=0.5) - start


def baseline(model: str) -> float:
    port = free_port()
    procs = pd_processes(model, port, worker_python(), Path(tempfile.mkdtemp(prefix="bench-first-token-")))
    try:
        for p in procs:
            p.start()
        return first_token(f"http://127.0.0.1:{port}/v1")
    finally:
        for p in reversed(procs):
            p.stop()


def on_node(cluster: LocalCluster, api, images: dict[str, str], source: str, name: str) -> dict[str, float]:
    from kubernetes import client

    doc = realnode.deployment(name, source, images["worker-cpu"])
    core = client.CoreV1Api(api)
    t0 = time.monotonic()
    cluster.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(doc))

    def pods_ready() -> bool:
        pods = core.list_namespaced_pod(NS, label_selector=f"serving.disagg.dev/deployment={name}").items
        return len(pods) == 3 and all(p.status.phase == "Running" and all(c.ready for c in p.status.container_statuses or [])
                                      for p in pods)
    wait_for(pods_ready, 900, f"{name}'s pods Ready", interval=0.5)
    t_ready = time.monotonic() - t0
    first_token(realnode.router_url(api, NS, name))
    total = time.monotonic() - t0
    cluster.kubectl("delete", "-n", NS, "dd", name, "--wait=true")
    wait_for(lambda: not core.list_namespaced_pod(NS, label_selector=f"serving.disagg.dev/deployment={name}").items,
             300, f"{name}'s pods gone")
    return {"pods Ready (s)": round(t_ready, 1), "first token (s)": round(total, 1)}


def remove_images(cluster: LocalCluster, images: dict[str, str], cold: bool) -> None:
    node = cluster.node
    refs = [line.split()[0] for line in node.ctr("images", "ls").stdout.splitlines()[1:]
            if any(line.startswith(ref.rsplit(":", 1)[0] + ":") for ref in images.values())]
    node.ctr("images", "rm", *refs)
    if cold:
        from disagg.e2e.images.buildkit import buildkitd

        with buildkitd(str(node.containerd_socket), node.containerd_namespace) as buildctl:
            subprocess.run([*buildctl, "prune", "--all"], check=True, capture_output=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cold", action="store_true", help="also prune BuildKit's cache before the uncached run")
    args = p.parse_args()
    buildkit_binaries()
    model = str(ensure(worker_python()))
    print("baseline: prefill, decode and router as local processes ...", flush=True)
    base = baseline(model)
    print(f"  first token after {base:.1f} s", flush=True)

    from kubernetes import client, config

    cluster = LocalCluster(f"bench-{os.getpid()}", state_dir=Path(tempfile.mkdtemp(prefix="bench-cluster-")),
                           real_node=True)
    cluster.up()
    try:
        api = config.new_client_from_config(str(cluster.kubeconfig))
        cluster.kubectl("apply", "--server-side", "-f", str(realnode.CHART.parent.parent / "crds"))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=300s",
                        "crd/disaggdeployments.serving.disagg.dev")
        images = ensure_images(str(cluster.node.containerd_socket))
        os.environ["DISAGG_ROUTER_IMAGE"] = images["control-plane"]
        client.CoreV1Api(api).create_namespace({"metadata": {"name": NS}})
        wait_for(lambda: client.CoreV1Api(api).list_namespaced_service_account(NS).items, 60, "default SA")
        source = realnode.install_model(api, NS, model)
        kubeconfig = operator_kubeconfig(cluster, api, cluster.dir / "operator.kubeconfig")
        rows = []
        with running_operator(kubeconfig):
            cached = on_node(cluster, api, images, source, "cached")
            rows.append(("image cached", 0.0, cached))
            remove_images(cluster, images, args.cold)
            t0 = time.monotonic()
            images = ensure_images(str(cluster.node.containerd_socket))
            build = time.monotonic() - t0
            uncached = on_node(cluster, api, images, source, "uncached")
            rows.append(("image not cached" + (" (BuildKit cache pruned)" if args.cold else
                                               " (rebuilt from BuildKit's cache)"), build, uncached))
    finally:
        cluster.down()
    print(f"\n{'run':<50} {'image build':>12} {'pods Ready':>11} {'first token':>12} {'x baseline':>11}")
    print(f"{'baseline: local processes':<50} {'-':>12} {'-':>11} {base:>11.1f}s {1.0:>10.2f}x")
    for title, build, r in rows:
        total = build + r["first token (s)"]
        print(f"{title:<50} {build:>11.1f}s {r['pods Ready (s)']:>10.1f}s {total:>11.1f}s {total / base:>10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
