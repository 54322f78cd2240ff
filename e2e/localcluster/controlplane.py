"""A real Kubernetes control plane on loopback: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok, built from their Go modules.

The same code serves the tests (one cluster per test run, in a temporary state
directory), the demo and ``make cluster-up`` (a named cluster under the cache).
State (ports, pids, certificates, kubeconfigs, logs, etcd data) lives in one
directory; ``down`` stops every process it started and removes that directory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .pki import PKI

HERE = Path(__file__).resolve().parent

# Workload/PodGroup (beta), CompositePodGroup (alpha) and topology-aware workload
# scheduling: the scheduler enables its gang plugins when these gates are on.
FEATURE_GATES = "GenericWorkload=true,CompositePodGroup=true,TopologyAwareWorkloadScheduling=true"
RUNTIME_CONFIG = "scheduling.k8s.io/v1beta1=true,scheduling.k8s.io/v1alpha3=true"
# Address plan: all inside the benchmarking range 198.18.0.0/15 (RFC 2544), never a private range this
# machine's real networks may use; with a real node the whole /15 is routed to its bridge, so none of it
# leaves the machine.
#   198.18.0.0/24    the real node's bridge (198.18.0.1: host side, API server, node) and its pods (node.py)
#   198.18.64.0/18   simulated (kwok) nodes (nodepools.py)
#   198.18.128.0/17  simulated pods
#   198.19.0.0/16    Services
CLUSTER_NETWORK = "198.18.0.0/15"
NODE_CIDR = "198.18.0.0/24"
NODE_IP = "198.18.0.1"
SERVICE_CIDR = "198.19.0.0/16"
KUBERNETES_SERVICE_IP = "198.19.0.1"
POD_CIDR = "198.18.128.1/17"  # kwok's --cidr: the first address to hand out, and the prefix
LOOPBACK = "127.0.0.1"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


class ClusterError(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("DISAGG_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "disagg")


def binaries() -> Path:
    """The cached binaries directory, building it first when the cache is empty."""
    out = subprocess.run(["bash", str(HERE / "build.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Endpoint:
    name: str
    ports: dict[str, int]
    pids: dict[str, int]


class LocalCluster:
    def __init__(self, name: str = "default", state_dir: Path | None = None, audit_writes: bool = False,
                 real_node: bool = False, audit_reads_of: str | None = None,
                 audit_groups: tuple[str, ...] = (), node_lease_seconds: int = 40):
        """`audit_writes`: log every write request (create/update/patch/delete) to <state>/audit.log,
        so benchmarks can count what a client writes; `audit_reads_of`: also log the get/list/watch
        requests of this user (their URIs show selectors and page sizes); `audit_groups`: every request of a
        member of these groups (e.g. system:serviceaccounts:<namespace>), with its verb, resource and
        response code, so a test can compare what an account did with what its role grants. `real_node`: also run one real
        node (node.py: containerd, kubelet, kube-proxy) that runs pods for real; one per machine at a time.
        `node_lease_seconds`: the simulated nodes' lease (kwok renews it every quarter of that; the node
        lifecycle controller's grace period follows it). Thousands of nodes at the kubelet's 40 s send
        hundreds of lease writes a second, more than an API server on two cores can take alongside the
        workload; a fleet benchmark lengthens it, as large clusters' control planes get more cores instead."""
        self.name = name
        self.audit_writes = audit_writes
        self.audit_reads_of = audit_reads_of
        self.audit_groups = tuple(audit_groups)
        self.real_node = real_node
        self.node_lease_seconds = node_lease_seconds
        self.dir = Path(state_dir) if state_dir else cache_root() / "clusters" / name
        self.pki = PKI(self.dir / "pki")
        self.logs = self.dir / "logs"
        self.kubeconfig = self.dir / "kubeconfig"
        self._state_file = self.dir / "state.json"

    # ------------------------------------------------------------ state
    def _state(self) -> dict[str, Any]:
        try:
            return json.loads(self._state_file.read_text())
        except (OSError, ValueError):
            return {"ports": {}, "pids": {}}

    def _save(self, state: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._state_file.write_text(json.dumps(state, indent=2))

    @property
    def address(self) -> str:
        """Where the API server listens: loopback, or the real node's bridge address (pods must reach it)."""
        return self._state().get("address", LOOPBACK)

    @property
    def server(self) -> str:
        return f"https://{self.address}:{self._state()['ports']['apiserver']}"

    @property
    def node(self):
        """The real node (containerd socket and namespace, image import), or None when the cluster has none."""
        from .node import RealNode

        state = self._state()
        if not state.get("real_node"):
            return None
        node = RealNode(self.dir / "node")
        if state.get("node_bin"):
            node.bins = Path(state["node_bin"])
        return node

    def _components(self, state: dict[str, Any]) -> tuple[str, ...]:
        from .node import COMPONENTS as NODE_COMPONENTS

        return COMPONENTS + (NODE_COMPONENTS if state.get("real_node") else ())

    def running(self) -> bool:
        state = self._state()
        pids = state.get("pids", {})
        return (set(pids) == set(self._components(state)) and all(_alive(p) for p in pids.values())
                and self._readyz(state["ports"]["apiserver"]))

    # ------------------------------------------------------------ health
    def _tls(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        ctx.load_cert_chain(self.dir / "pki" / "admin.crt", self.dir / "pki" / "admin.key")
        return ctx

    def _readyz(self, port: int) -> bool:
        try:
            with urllib.request.urlopen(f"https://{self.address}:{port}/readyz", context=self._tls(),
                                        timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError, ssl.SSLError):
            return False

    @staticmethod
    def _http_ok(url: str) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _wait(self, what: str, check, timeout: float, component: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            if component:
                pid = self._state()["pids"].get(component)
                if pid and not _alive(pid):
                    raise ClusterError(f"{component} exited while waiting for {what}; last log lines:\n"
                                       + self.tail(component))
            time.sleep(0.2)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}"
                           + (f"; last log lines:\n{self.tail(component)}" if component else ""))

    def tail(self, component: str, lines: int = 30) -> str:
        try:
            return "\n".join((self.logs / f"{component}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------ processes
    def _spawn(self, state: dict[str, Any], component: str, argv: list[str],
               env: dict[str, str] | None = None) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{component}.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=self.dir,
                                    env={**os.environ, **env} if env else None)
        state["pids"][component] = proc.pid
        self._save(state)

    def _stop(self, component: str, pid: int, bin_hint: str) -> None:
        if not _alive(pid) or bin_hint not in _cmdline(pid):
            return  # gone, or the pid now belongs to someone else
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if not _alive(pid):
                    return
                time.sleep(0.1)
        raise ClusterError(f"{component} (pid {pid}) did not stop")

    def stop_component(self, component: str) -> None:
        state = self._state()
        pid = state["pids"].pop(component, None)
        if pid:
            self._stop(component, pid, component)
        self._save(state)

    def start_component(self, component: str, timeout: float = 90) -> None:
        """(Re)start one component of a cluster that is up, for fault-injection tests."""
        state = self._state()
        bins = Path(state["bin"])
        getattr(self, f"_start_{component.replace('-', '_')}")(state, bins, timeout)

    # ------------------------------------------------------------ up / down
    def up(self, timeout: float = 180, nodes_file: Path | None = None) -> None:
        """Start the cluster, or do nothing if it already runs (starting twice is harmless)."""
        if self.running():
            return
        if self._state().get("pids") or self._state().get("real_node"):
            self.down()  # a partial or crashed cluster: start clean
        bins = binaries()
        state = {"bin": str(bins), "pids": {}, "real_node": self.real_node, "address": LOOPBACK, "ports": {
            "etcd": free_port(), "etcd_peer": free_port(), "apiserver": free_port(),
            "controller_manager": free_port(), "scheduler": free_port()}}
        self._save(state)
        try:
            if self.real_node:
                from .node import RealNode

                node = RealNode(self.dir / "node")
                node.claim()
                node.network_up()  # the API server binds to the bridge's address
                state["address"] = NODE_IP
                self._save(state)
            self.pki.ensure(dns_names=["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                       "kubernetes.default.svc.cluster.local"],
                            ips=[LOOPBACK, NODE_IP, KUBERNETES_SERVICE_IP])
            for user, cn, org in (("admin", "disagg-admin", "system:masters"),
                                  ("controller-manager", "system:kube-controller-manager", None),
                                  ("scheduler", "system:kube-scheduler", None),
                                  ("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters")):
                cert, key = self.pki.issue(user, cn, org)
                if user != "apiserver-kubelet-client":
                    path = self.kubeconfig if user == "admin" else self.dir / f"{user}.kubeconfig"
                    self.pki.kubeconfig(path, self.server, user, cert, key)
            for component in COMPONENTS:
                getattr(self, f"_start_{component.replace('-', '_')}")(state, bins, timeout)
            from .nodepools import apply_node_pools, real_node_labels, wait_ready

            apply_node_pools(self, nodes_file)
            wait_ready(self, timeout)
            if self.real_node:
                node.start(self, state, timeout, real_node_labels(nodes_file))
        except BaseException:
            self.down(keep_logs=True)
            raise

    def _start_etcd(self, state: dict[str, Any], bins: Path, timeout: float) -> None:
        p = state["ports"]
        client, peer = f"http://127.0.0.1:{p['etcd']}", f"http://127.0.0.1:{p['etcd_peer']}"
        self._spawn(state, "etcd", [
            str(bins / "etcd"), "--name=local", f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=local={peer}", "--unsafe-no-fsync=true", "--log-level=warn",
            "--quota-backend-bytes=4294967296",
        ])
        self._wait("etcd", lambda: self._http_ok(f"{client}/health"), timeout, "etcd")

    def _start_kube_apiserver(self, state: dict[str, Any], bins: Path, timeout: float) -> None:
        p, pki = state["ports"], self.pki.dir
        self._spawn(state, "kube-apiserver", [
            str(bins / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{p['etcd']}",
            f"--bind-address={state['address']}", f"--advertise-address={state['address']}",
            f"--secure-port={p['apiserver']}",
            f"--cert-dir={pki}", f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}", f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Without a real node the API server listens on loopback, which cannot be an endpoint address:
            # skip that reconciler. With one, pods reach it through the `kubernetes` Service.
            f"--endpoint-reconciler-type={'lease' if state.get('real_node') else 'none'}",
            # For kubectl logs/exec/port-forward: the kubelet's serving address, and the API server's
            # client certificate the kubelet authenticates.
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--authorization-mode=Node,RBAC", "--allow-privileged=true",
            f"--feature-gates={FEATURE_GATES}", f"--runtime-config={RUNTIME_CONFIG}",
            "--enable-priority-and-fairness=false", "--v=1",
            *self._audit_flags(),
        ])
        self._wait("kube-apiserver /readyz", lambda: self._readyz(p["apiserver"]), timeout, "kube-apiserver")

    @property
    def audit_log(self) -> Path:
        return self.dir / "audit.log"

    def _audit_flags(self) -> list[str]:
        if not self.audit_writes and not self.audit_reads_of and not self.audit_groups:
            return []
        policy = self.dir / "audit-policy.yaml"
        reads = (f"  - level: Metadata\n    users: [{json.dumps(self.audit_reads_of)}]\n    verbs: [get, list, watch]\n"
                 if self.audit_reads_of else "")
        writes = "  - level: Metadata\n    verbs: [create, update, patch, delete, deletecollection]\n" \
            if self.audit_writes else ""
        groups = (f"  - level: Metadata\n    userGroups: {json.dumps(list(self.audit_groups))}\n"
                  if self.audit_groups else "")
        # node heartbeats are most of a simulated fleet's writes and no test audits them
        heartbeats = ("  - level: None\n    namespaces: [kube-node-lease]\n"
                      "    resources: [{group: coordination.k8s.io, resources: [leases]}]\n")
        policy.write_text("apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n"
                          + heartbeats + groups + reads + writes + "  - level: None\n")
        return [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
                "--audit-log-maxsize=0"]

    def _start_kube_controller_manager(self, state: dict[str, Any], bins: Path, timeout: float) -> None:
        p, pki = state["ports"], self.pki.dir
        kc = self.dir / "controller-manager.kubeconfig"
        self._spawn(state, "kube-controller-manager", [
            str(bins / "kube-controller-manager"), f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={p['controller_manager']}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}", f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allocate-node-cidrs=false",
            f"--feature-gates={FEATURE_GATES}", "--v=1",
            *([f"--node-monitor-grace-period={self.node_lease_seconds}s"] if self.node_lease_seconds > 40 else []),
        ])
        self._wait("kube-controller-manager /healthz",
                   lambda: self._http_ok(f"https://127.0.0.1:{p['controller_manager']}/healthz"),
                   timeout, "kube-controller-manager")

    def _start_kube_scheduler(self, state: dict[str, Any], bins: Path, timeout: float) -> None:
        p = state["ports"]
        kc = self.dir / "scheduler.kubeconfig"
        self._spawn(state, "kube-scheduler", [
            str(bins / "kube-scheduler"), f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={p['scheduler']}", "--leader-elect=false",
            f"--feature-gates={FEATURE_GATES}", "--v=2",
        ])
        self._wait("kube-scheduler /healthz", lambda: self._http_ok(f"https://127.0.0.1:{p['scheduler']}/healthz"),
                   timeout, "kube-scheduler")

    def _start_kwok(self, state: dict[str, Any], bins: Path, timeout: float) -> None:
        from .nodepools import write_kwok_config

        config = write_kwok_config(self.dir / "kwok.yaml", self.node_lease_seconds)
        self._spawn(state, "kwok", [
            str(bins / "kwok"), f"--kubeconfig={self.kubeconfig}", f"--config={config}",
            "--manage-all-nodes=false", "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--cidr={POD_CIDR}",
        ])
        time.sleep(0.5)
        if not _alive(state["pids"]["kwok"]):
            raise ClusterError("kwok exited at start; last log lines:\n" + self.tail("kwok"))

    def down(self, keep_logs: bool = False) -> None:
        """Stop every process this cluster started and remove its state; leaves no process or port behind
        (and, with a real node, no container, mount, cgroup, bridge or nftables table either)."""
        state = self._state()
        bins = state.get("bin", "")
        node = None
        if state.get("real_node"):
            from .node import RealNode

            node = RealNode(self.dir / "node")
            node.stop(self, state)
        for component in reversed(COMPONENTS):
            pid = state.get("pids", {}).get(component)
            if pid:
                self._stop(component, pid, bins or component)
        address = state.get("address", LOOPBACK)
        busy = [f"{k}={v}" for k, v in state.get("ports", {}).items()
                if _port_open(v) or (address != LOOPBACK and _port_open(v, address))]
        if node:
            node.release()  # after every process: the bridge holds the API server's address
        if busy:
            raise ClusterError(f"ports still in use after stopping the cluster: {', '.join(busy)}")
        if keep_logs:
            state["pids"] = {}
            self._save(state)
            return
        if self.dir.exists():
            subprocess.run(["rm", "-rf", str(self.dir)], check=True)

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        bins = Path(self._state()["bin"])
        return subprocess.run([str(bins / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                              check=check, capture_output=True, text=True, input=input)
