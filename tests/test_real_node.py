"""The real node of the local cluster: containerd + kubelet + kube-proxy on this machine run pods for real.

One cluster with a real node for the module: the node joins Ready with its GPUs and NVLink-domain labels,
a pod from a locally packed busybox image becomes Ready through a real probe on the node's bridge,
kubectl logs/exec/port-forward reach it through the kubelet, a pod reaches the API server through the
`kubernetes` Service and the host reaches a pod through a Service, a GPU pod that tolerates the node's
taint lands on it; and `down` leaves nothing of the node behind on the machine.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from kubernetes import client

from disagg.api import contract
from disagg.api.names import LABEL_DEPLOYMENT, LABEL_ROLE, ROLE_DECODE, ROLE_ROUTER
from disagg.api.v1alpha1 import DisaggDeployment

from disagg.e2e.localcluster import ClusterError, LocalCluster, nodepools
from disagg.e2e.localcluster import node as real
from disagg.e2e.localcluster.controlplane import KUBERNETES_SERVICE_IP
from disagg.e2e.localcluster import netpol
from disagg.e2e.localcluster.netpol import NetworkPolicyEnforcer
from disagg.e2e.localcluster.ociimage import Image
from disagg.e2e.testing import dd_manifest, wait_for
from disagg.operator import render

# Debian's static busybox, plus the control plane's kubectl (static Go) as an in-cluster API client.
IMAGE = "disagg.local/toolbox:1"
APPLETS = ("sh", "cat", "echo", "httpd", "mkdir", "ping", "sleep", "nc")
TIMINGS: dict[str, float] = {}


def _static_busybox() -> Path:
    path = shutil.which("busybox")
    assert path, "busybox not found: apt-get install -y busybox-static"
    head = Path(path).read_bytes()[:4096]
    assert b"ld-linux" not in head, f"{path} is dynamically linked: apt-get install -y busybox-static"
    return Path(path)


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory):
    c = LocalCluster(f"real-{os.getpid()}", state_dir=tmp_path_factory.mktemp("real-cluster"), real_node=True)
    forward_before = real.IP_FORWARD.read_text().strip()
    machine_dirs_before = [str(d) for d in real.MACHINE_DIRS if d.exists()]
    started = time.monotonic()
    try:
        c.up()
        TIMINGS["cluster up with real node (s)"] = time.monotonic() - started
        TIMINGS["kubelet start to node Ready (s)"] = c._state()["node_ready_s"]
        kubectl = Path(c._state()["bin"]) / "kubectl"
        c.node.import_image(Image(name=IMAGE, files={"/bin/busybox": _static_busybox(), "/bin/kubectl": kubectl},
                                  links={f"/bin/{a}": "busybox" for a in APPLETS}))
        c.forward_before, c.machine_dirs_before = forward_before, machine_dirs_before
        yield c
    finally:
        c.down()
    print("\nreal node timings:", json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}))


@pytest.fixture(scope="module")
def core(real_cluster):
    from kubernetes import client, config

    api = config.new_client_from_config(str(real_cluster.kubeconfig))
    yield client.CoreV1Api(api)
    api.close()


@pytest.fixture(scope="module")
def ns(core, real_cluster):
    name = "real-node"
    core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: any(sa.metadata.name == "default" for sa in core.list_namespaced_service_account(name).items),
             30, "default ServiceAccount")
    return name


def _ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _if(pod, check):
    return pod if check(pod) else None


def _pod(name: str, command: str, gpus: int = 0, port: int | None = None) -> dict:
    container = {"name": "main", "image": IMAGE, "imagePullPolicy": "Never", "command": ["sh", "-c", command]}
    if port:
        container["ports"] = [{"containerPort": port}]
        container["readinessProbe"] = {"httpGet": {"path": "/index.html", "port": port}, "periodSeconds": 1}
    if gpus:
        container["resources"] = {"limits": {nodepools.GPU: str(gpus)}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"containers": [container], "nodeSelector": real.REAL_NODE_SELECTOR,
                     "tolerations": [real.REAL_NODE_TOLERATION], "terminationGracePeriodSeconds": 1}}


WEB = "mkdir -p /www && echo hello-from-pod > /www/index.html && echo web-started && exec httpd -f -p 8080 -h /www"


@pytest.fixture(scope="module")
def web(core, ns, real_cluster):
    """A web server pod on the real node, Ready through its HTTP readiness probe, behind a Service."""
    started = time.monotonic()
    core.create_namespaced_pod(ns, _pod("web", WEB, port=8080))
    pod = wait_for(lambda: _if(core.read_namespaced_pod("web", ns), _ready), 120, "pod web Ready", interval=0.1)
    TIMINGS["small pod Ready (s)"] = time.monotonic() - started
    core.create_namespaced_service(ns, {"metadata": {"name": "web"}, "spec": {
        "selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}})
    return pod


def test_node_ready_with_gpus_labels_and_taint(core, real_cluster):
    node = core.read_node(real.NODE_NAME)
    assert _ready(node)
    assert node.status.capacity[nodepools.GPU] == node.status.allocatable[nodepools.GPU] == str(real.GPUS)
    labels = node.metadata.labels
    assert labels[real.REAL_NODE_LABEL] == "true"
    expected = nodepools.real_node_labels()
    assert {k: labels.get(k) for k in expected} == expected
    # ...the same NVLink domain as simulated nodes of the pool, so a gang with a required topology fits it
    peers = core.list_node(label_selector=f"{nodepools.CLIQUE_LABEL}={labels[nodepools.CLIQUE_LABEL]},type=kwok")
    assert peers.items
    assert [t.to_dict() for t in node.spec.taints or [] if t.key == real.REAL_NODE_LABEL] == [
        {**real.REAL_NODE_TAINT, "time_added": None}]
    assert {a.type: a.address for a in node.status.addresses}["InternalIP"] == real.NODE_IP
    assert node.status.node_info.kubelet_version.startswith("v1.37")
    assert node.status.node_info.container_runtime_version.startswith("containerd://2.")


def test_pod_runs_ready_on_the_bridge(web):
    assert web.spec.node_name == real.NODE_NAME
    assert ipaddress.ip_address(web.status.pod_ip) in real.NODE_CIDR
    assert web.status.container_statuses[0].ready
    with urllib.request.urlopen(f"http://{web.status.pod_ip}:8080/index.html", timeout=10) as r:  # from the host
        assert r.read().decode().strip() == "hello-from-pod"


def test_kubectl_logs_exec_and_port_forward(real_cluster, ns, web):
    logs = wait_for(lambda: real_cluster.kubectl("-n", ns, "logs", "web", check=False).stdout, 30, "logs")
    assert "web-started" in logs
    out = real_cluster.kubectl("-n", ns, "exec", "web", "--", "cat", "/www/index.html")
    assert out.stdout.strip() == "hello-from-pod"
    bins = Path(real_cluster._state()["bin"])
    pf = subprocess.Popen([str(bins / "kubectl"), f"--kubeconfig={real_cluster.kubeconfig}", "-n", ns,
                           "port-forward", "pod/web", ":8080"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    try:
        line = pf.stdout.readline()
        match = re.search(r"127\.0\.0\.1:(\d+) -> 8080", line)
        assert match, line
        with urllib.request.urlopen(f"http://127.0.0.1:{match.group(1)}/index.html", timeout=10) as r:
            assert r.read().decode().strip() == "hello-from-pod"
    finally:
        pf.terminate()
        pf.wait(10)


def test_host_reaches_pod_through_service(core, ns, web):
    ip = core.read_namespaced_service("web", ns).spec.cluster_ip
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(real.CLUSTER_NETWORK)

    def fetch() -> str:
        try:
            with urllib.request.urlopen(f"http://{ip}/index.html", timeout=2) as r:
                return r.read().decode().strip()
        except OSError:
            return ""

    assert wait_for(fetch, 60, f"Service web at {ip} from the host") == "hello-from-pod"


def test_pod_reaches_api_server_through_kubernetes_service(real_cluster, ns, web):
    # kubectl's in-cluster configuration, as the operator and routers use theirs: the `kubernetes` Service's
    # address from the environment, the ServiceAccount's token, and the cluster CA verifying the API server.
    out = real_cluster.kubectl("-n", ns, "exec", "web", "--", "kubectl", "get", "--raw", "/version", check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["gitVersion"] == "v1.37.2"
    denied = real_cluster.kubectl("-n", ns, "exec", "web", "--", "kubectl", "get", "pods", check=False)
    assert f'"system:serviceaccount:{ns}:default" cannot list resource "pods"' in denied.stderr  # authenticated
    env = real_cluster.kubectl("-n", ns, "exec", "web", "--", "sh", "-c", "echo $KUBERNETES_SERVICE_HOST").stdout
    assert env.strip() == KUBERNETES_SERVICE_IP


def test_pods_resolve_cluster_names(real_cluster, ns, web, core):
    """The cluster's DNS (CoreDNS on the bridge): Service names resolve to their ClusterIPs from a pod, by
    fully qualified (busybox's nslookup walks no search path; the e2e suite's operator pod, kopf, resolves
    `kubernetes.default.svc` through it); names outside the cluster do not exist."""
    web_ip = core.read_namespaced_service("web", ns).spec.cluster_ip
    for name, want in (("kubernetes.default.svc.cluster.local", KUBERNETES_SERVICE_IP),
                       (f"web.{ns}.svc.cluster.local", web_ip)):
        out = real_cluster.kubectl("-n", ns, "exec", "web", "--", "busybox", "nslookup", name, check=False)
        assert out.returncode == 0 and want in out.stdout.split("Name:", 1)[-1], (name, out.stdout, out.stderr)
    outside = real_cluster.kubectl("-n", ns, "exec", "web", "--", "busybox", "nslookup", "pypi.org", check=False)
    assert "Name:" not in outside.stdout and "can't find pypi.org: NXDOMAIN" in outside.stdout + outside.stderr, outside


def _dropped_leaving() -> int:
    ruleset = subprocess.run(["nft", "list", "table", "inet", real.NFT_TABLE], capture_output=True, text=True,
                             check=True).stdout
    return int(re.search(r"counter packets (\d+) bytes \d+ drop comment \"" + real.LEAVING, ruleset).group(1))


def test_pod_traffic_never_leaves_the_machine(real_cluster, ns, web):
    """A pod's packet for an address outside the cluster is dropped by the host, not routed out."""
    before = _dropped_leaving()
    # TEST-NET-1: nobody's address. (Debian's busybox wget crashes with -T, hence ping.)
    out = real_cluster.kubectl("-n", ns, "exec", "web", "--", "ping", "-c", "1", "-W", "1", "192.0.2.77",
                               check=False)
    assert out.returncode != 0
    assert _dropped_leaving() > before


def test_gpu_pod_lands_on_the_real_node(core, ns):
    core.create_namespaced_pod(ns, _pod("gpu", "echo gpu-pod && exec sleep 3600", gpus=2))
    pod = wait_for(lambda: _if(core.read_namespaced_pod("gpu", ns), lambda p: p.status.phase == "Running"), 120,
                   "GPU pod Running")
    assert pod.spec.node_name == real.NODE_NAME


def test_a_second_real_node_is_refused(real_cluster, tmp_path):
    other = LocalCluster("other", state_dir=tmp_path / "other", real_node=True)
    with pytest.raises(ClusterError, match=f"held by the cluster in {real_cluster.dir}"):
        other.up()
    assert real_cluster.running()
    assert subprocess.run(["ip", "link", "show", real.BRIDGE], capture_output=True).returncode == 0


# ------------------------------------------------------------ the operator's NetworkPolicy, enforced
# A worker stand-in serving what a worker serves on the two ports that matter: vLLM's API port (the model's
# API and, in vLLM, its /metrics) and the worker's metrics-only port. The policy selects pods by the labels
# the operator puts on its pods, so pods carrying those labels are what it admits or refuses; which process
# answers behind a port does not enter into it.
NP = "np"
WORKER_PORTS = (render.HTTP_PORT, contract.WORKER_METRICS_PORT)
SERVE_PORTS = ("mkdir -p /www && echo ok > /www/metrics && "
               + " && ".join(f"httpd -p {p} -h /www" for p in WORKER_PORTS) + " && exec sleep 3600")


def _labelled(name: str, labels: dict[str, str], command: str = "exec sleep 3600") -> dict:
    pod = _pod(name, command)
    pod["metadata"]["labels"] = {"app": name, **labels}
    return pod


def _reaches(cluster: LocalCluster, namespace: str, pod: str, ip: str, port: int) -> bool:
    """Whether `pod` gets an HTTP answer from ip:port (nc in the pod: Debian's static busybox wget crashes;
    a dropped SYN gives up after 3 s)."""
    request = f"printf 'GET /metrics HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {ip} {port}"
    out = cluster.kubectl("-n", namespace, "exec", pod, "--", "sh", "-c", request, check=False)
    lines = out.stdout.splitlines()
    return bool(lines) and lines[0].startswith("HTTP/1.") and " 200 " in lines[0] and lines[-1].strip() == "ok"


@pytest.fixture
def enforcer(real_cluster):
    """Started for one test and stopped after it, its rules and sets removed (test_down_leaves_nothing_behind
    then finds none)."""
    e = NetworkPolicyEnforcer(real_cluster).start()
    try:
        yield e
    finally:
        e.stop()
    assert not netpol.own_chains() and not netpol.own_ipsets(), "the enforcer's rules outlived it"


def test_the_operators_network_policy_holds_against_real_traffic(real_cluster, core, ns, enforcer):
    """The policy the operator renders for a deployment, enforced on the real node by a real enforcer
    (kube-router's firewall): another deployment's pod cannot reach a worker's API or metrics; a pod
    labelled as Prometheus (in another namespace) reaches the metrics port and not the API; the
    deployment's own router reaches its workers' API and not their metrics. Before the policy, the same
    probes all pass, so what refuses them is the policy."""
    monitoring = "np-monitoring"
    core.create_namespace({"metadata": {"name": monitoring}})
    wait_for(lambda: any(sa.metadata.name == "default" for sa in core.list_namespaced_service_account(monitoring).items),
             30, "default ServiceAccount")
    pods = {"worker": (ns, _labelled("np-worker", {LABEL_DEPLOYMENT: NP, LABEL_ROLE: ROLE_DECODE}, SERVE_PORTS)),
            "router": (ns, _labelled("np-router", {LABEL_DEPLOYMENT: NP, LABEL_ROLE: ROLE_ROUTER})),
            "intruder": (ns, _labelled("other-router", {LABEL_DEPLOYMENT: "other", LABEL_ROLE: ROLE_ROUTER})),
            "prometheus": (monitoring, _labelled("prometheus", {"app.kubernetes.io/name": "prometheus"}))}
    for namespace, manifest in pods.values():
        core.create_namespaced_pod(namespace, manifest)
    for namespace, manifest in pods.values():
        wait_for(lambda: core.read_namespaced_pod(manifest["metadata"]["name"], namespace).status.phase == "Running",
                 120, f"pod {manifest['metadata']['name']} Running")
    ip = core.read_namespaced_pod("np-worker", ns).status.pod_ip

    def reach(who: str, port: int) -> bool:
        return _reaches(real_cluster, pods[who][0], pods[who][1]["metadata"]["name"], ip, port)

    # the router reaches the API (and the KV event ports, not served here), not the metrics port it never uses
    expected = {("router", render.HTTP_PORT): True, ("router", contract.WORKER_METRICS_PORT): False,
                ("intruder", render.HTTP_PORT): False, ("intruder", contract.WORKER_METRICS_PORT): False,
                ("prometheus", render.HTTP_PORT): False, ("prometheus", contract.WORKER_METRICS_PORT): True}
    # no policy yet: every probe answers (the worker serves both ports, the enforcer filters nothing), so
    # each refusal below is the policy's
    wait_for(lambda: all(reach(who, port) for who, port in expected), 60, "every probe answered without a policy")

    manifest = DisaggDeployment.model_validate({**dd_manifest(NP), "metadata": {"name": NP, "namespace": ns}})
    policy = render.network_policy(manifest, "uid")
    policy["metadata"].pop("ownerReferences")   # no DisaggDeployment owns it here: the garbage collector would
    client.NetworkingV1Api(core.api_client).create_namespaced_network_policy(ns, policy)
    try:
        seen: dict = {}

        def enforced() -> bool:
            seen.update({k: reach(*k) for k in expected})
            return seen == expected
        try:
            wait_for(enforced, 90, "the policy enforced as rendered")
        except AssertionError as e:
            raise AssertionError(f"{e}; (who, port) -> reached: {seen}; kube-router's log:\n{enforcer.tail()}") from None
        # and it stays so (the enforcer's periodic resync keeps it, it is not a transient)
        assert {k: reach(*k) for k in expected} == expected
    finally:
        client.NetworkingV1Api(core.api_client).delete_namespaced_network_policy(policy["metadata"]["name"], ns)
        for namespace, manifest in pods.values():
            core.delete_namespaced_pod(manifest["metadata"]["name"], namespace, grace_period_seconds=0)
        core.delete_namespace(monitoring)


def _leftovers(cluster: LocalCluster) -> dict[str, object]:
    state_dir = str(cluster.dir)
    procs = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if state_dir in cmd:
                procs.append(f"{p.name}: {cmd[:120]}")
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if line.split()[4].startswith(state_dir)]
    bridge = subprocess.run(["ip", "link", "show", real.BRIDGE], capture_output=True).returncode == 0
    cgroups = [str(d) for d in real._cgroup_dirs() if d.exists()]
    ruleset = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
    ipsets = netpol.own_ipsets()   # the NetworkPolicy enforcer's
    cni_cache = [p.name for p in Path("/var/lib/cni/results").glob("*")]
    return {"processes": procs, "mounts": mounts, "bridge": bridge, "cgroups": cgroups, "CNI cache": cni_cache,
            "nftables": [line.strip() for line in ruleset.splitlines()
                         if real.NFT_TABLE in line or "kube-proxy" in line or "KUBE-" in line],
            "ipsets": ipsets,
            "state dir": Path(state_dir).exists()}


def test_down_leaves_nothing_behind(real_cluster, core, ns, web):
    # Pods are running when the cluster goes down, so there is something to clean up.
    assert _leftovers(real_cluster)["mounts"]
    started = time.monotonic()
    real_cluster.down()
    TIMINGS["down (s)"] = time.monotonic() - started
    assert _leftovers(real_cluster) == {"processes": [], "mounts": [], "bridge": False, "cgroups": [], "CNI cache": [],
                                        "nftables": [], "ipsets": [], "state dir": False}
    assert real.IP_FORWARD.read_text().strip() == real_cluster.forward_before
    assert [str(d) for d in real.MACHINE_DIRS if d.exists()] == real_cluster.machine_dirs_before


def test_next_cluster_clears_what_a_crashed_one_left(tmp_path_factory):
    """A cluster killed outright (its pods still running, their mounts and cgroups in place) does not hold the
    machine's real node: the next cluster with one clears it all and starts."""
    crashed = LocalCluster("crashed", state_dir=tmp_path_factory.mktemp("crashed"), real_node=True)
    crashed.up()
    try:
        core = _core(crashed)
        core.create_namespaced_pod("default", _pod("survivor", "exec sleep 3600"))
        wait_for(lambda: core.read_namespaced_pod("survivor", "default").status.phase == "Running", 120,
                 "pod survivor Running")
        for pid in crashed._state()["pids"].values():
            os.killpg(pid, signal.SIGKILL)
        assert _leftovers(crashed)["mounts"] and _leftovers(crashed)["cgroups"]
        successor = LocalCluster("successor", state_dir=tmp_path_factory.mktemp("successor"), real_node=True)
        successor.up()
        try:
            assert _ready(_core(successor).read_node(real.NODE_NAME))
            left = _leftovers(crashed)
            assert (left["processes"], left["mounts"]) == ([], [])
        finally:
            successor.down()
        assert _leftovers(successor) == {"processes": [], "mounts": [], "bridge": False, "cgroups": [], "CNI cache": [],
                                         "nftables": [], "ipsets": [], "state dir": False}
    finally:
        crashed.down()
    assert not crashed.dir.exists()


def _core(cluster: LocalCluster):
    from kubernetes import client, config

    return client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))
