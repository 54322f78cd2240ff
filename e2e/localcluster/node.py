"""One real node in the local cluster: containerd, kubelet and kube-proxy on this machine.

Beside kwok's simulated pools (scale and placement), this node actually runs pods: containerd
(CRI, runc from Debian, overlayfs snapshots), the kubelet joined with its own node certificate,
and kube-proxy in nftables mode so pods reach Services (the API server among them) and the host
reaches Services and pod IPs. Pods live on a Linux bridge inside this machine; nothing is routed off it.

What persists across clusters is containerd's root (content store and snapshots, i.e. the images)
under ``<cache>/node/containerd``. Everything else (state and run directories, sockets, pod network
namespaces, cgroups, mounts, the bridge, nftables tables, kubelet directories, ip_forward) belongs to
one cluster and is removed or restored by ``down``. The bridge, its addresses and that root are
machine-wide, so one real node runs per machine at a time: an owner record under the cache says whose.
"""

from __future__ import annotations

import fcntl
import functools
import ipaddress
import json
import os
import re
import signal
import ssl
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from . import ociimage
from .controlplane import CLUSTER_NETWORK, HERE, NODE_IP, ClusterError, _alive, _cmdline, cache_root, free_port
from .controlplane import NODE_CIDR as _NODE_CIDR

if TYPE_CHECKING:
    from .controlplane import LocalCluster

NODE_NAME = "real-node"
# Pods meant for the real node select it by this label and tolerate this taint; every other pod
# (the kwok-only tests' among them) never lands on it by accident.
REAL_NODE_LABEL = "disagg.dev/real-node"
REAL_NODE_TAINT = {"key": REAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"}
REAL_NODE_SELECTOR = {REAL_NODE_LABEL: "true"}
REAL_NODE_TOLERATION = {"key": REAL_NODE_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
GPUS = 8  # advertised as nvidia.com/gpu, like one node of the default pool file's GPU pool

# The node's slice of the cluster's address plan (controlplane.py): its bridge and pods. Everything
# the cluster addresses (CLUSTER_NETWORK: pods, Services, simulated nodes) is routed to the bridge, so a
# packet for an address nobody holds dies there instead of following the default route out.
BRIDGE = "disagg0"
NODE_CIDR = ipaddress.ip_network(_NODE_CIDR)
NFT_TABLE = "disagg-node"  # inet family: stops forwarding between the bridge and any other interface
LEAVING = "pod traffic leaving the machine"  # the comment of the rule (and counter) that drops it
CNI_BIN_DIR = Path("/usr/lib/cni")
CNI_NETWORK = "disagg-node"
CGROUP_ROOT = "disagg-node"  # the kubelet's --cgroup-root: every pod's cgroup is under it
CGROUP_FS = Path("/sys/fs/cgroup")
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")

# Directories the kubelet and the CNI library create at fixed machine paths whatever their configuration
# (the device plugin socket, container log links, CNI results cache): removed on down when they were not
# there before the node started, with only the node's own files taken out of them.
MACHINE_DIRS = (Path("/var/lib/kubelet/device-plugins"), Path("/var/lib/kubelet"), Path("/var/log/containers"),
                Path("/var/lib/cni/results"), Path("/var/lib/cni"))

CONTAINERD_NAMESPACE = "k8s.io"  # the namespace the CRI (and so the kubelet) sees images in
PAUSE_IMAGE = "disagg.local/pause:1"
COMPONENTS = ("containerd", "coredns", "kubelet", "kube-proxy")
CLUSTER_DOMAIN = "cluster.local"


def node_binaries() -> Path:
    """The real node's cached binaries (containerd, shim, ctr, kubelet, kube-proxy, pause)."""
    out = subprocess.run(["bash", str(HERE / "build-node.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def _mounts_under(prefix: Path) -> list[str]:
    """Mount points at or under ``prefix``, deepest first (so each can be unmounted in turn)."""
    root = str(prefix.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == root or point.startswith(root + "/"):
            points.append(point)
    return sorted(set(points), key=lambda p: (-p.count("/"), p))


def _cgroup_dirs() -> list[Path]:
    """Our cgroup root in every mounted hierarchy (v1 controllers, named ones and the unified one)."""
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, point, fstype, *_ = line.split()
        if fstype in ("cgroup", "cgroup2") and point.startswith(str(CGROUP_FS)):
            out.append(Path(point) / CGROUP_ROOT)
    return out


class RealNode:
    """The real node of the cluster whose state directory is ``state_dir`` (``<cluster>/node``)."""

    def __init__(self, state_dir: Path):
        self.dir = Path(state_dir)
        self.root = cache_root() / "node" / "containerd"
        self.containerd_socket = self.dir / "run" / "containerd.sock"
        self.containerd_namespace = CONTAINERD_NAMESPACE
        self.kubelet_dir = self.dir / "kubelet"
        self.cni_conf_dir = self.dir / "cni" / "net.d"
        self._owner_file = cache_root() / "node" / "owner.json"
        self._lock_file = cache_root() / "node" / ".lock"

    # ------------------------------------------------------------ one node per machine
    @contextmanager
    def _machine_lock(self):
        self._lock_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_file, "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _owner(self) -> dict[str, Any] | None:
        try:
            return json.loads(self._owner_file.read_text())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _owner_alive(owner: dict[str, Any]) -> bool:
        """The owning cluster still runs one of its node processes or, before it started any, the process
        that claimed the node (and is starting them right now) still lives."""
        try:
            state = json.loads((Path(owner["state_dir"]).parent / "state.json").read_text())
        except (OSError, ValueError, KeyError):
            state = {}
        started = {c: pid for c, pid in state.get("pids", {}).items() if c in COMPONENTS}
        if started:
            return any(_alive(pid) and c in _cmdline(pid) for c, pid in started.items())
        pid = owner.get("pid", 0)
        return bool(pid) and _alive(pid) and _cmdline(pid) == owner.get("cmdline")

    def claim(self) -> None:
        """Take the machine's real node for this cluster, clearing what a dead owner left behind;
        fails with a clear message while another live cluster holds it."""
        if os.geteuid() != 0:
            raise ClusterError("a real node needs root (bridge, network namespaces, cgroups, mounts); "
                               "start the cluster with --no-real-node (LocalCluster(real_node=False))")
        with self._machine_lock():
            owner = self._owner()
            if owner and owner.get("state_dir") != str(self.dir):
                if self._owner_alive(owner):
                    raise ClusterError(
                        f"the real node of this machine is held by the cluster in {Path(owner['state_dir']).parent}"
                        f"; stop it with `disagg cluster down` (or start this one with --no-real-node)")
                RealNode(Path(owner["state_dir"])).teardown(owner)
                owner = None
            if owner is None:
                owner = {"state_dir": str(self.dir), "ip_forward": IP_FORWARD.read_text().strip(),
                         "nft_tables": _nft_tables(),
                         "absent_dirs": [str(d) for d in MACHINE_DIRS if not d.exists()],
                         "pid": os.getpid(), "cmdline": _cmdline(os.getpid())}
                self._owner_file.write_text(json.dumps(owner, indent=2))

    def release(self) -> None:
        with self._machine_lock():
            owner = self._owner()
            if owner and owner.get("state_dir") == str(self.dir):
                self.teardown(owner)
                self._owner_file.unlink()

    # ------------------------------------------------------------ network
    def network_up(self) -> None:
        """The bridge with the node's address (the API server binds to it, so it comes first), the
        route of the whole cluster network to it, and the table that keeps pod traffic on it."""
        if _run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
            _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "replace", f"{NODE_IP}/{NODE_CIDR.prefixlen}", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        _run("ip", "route", "replace", CLUSTER_NETWORK, "dev", BRIDGE, "src", NODE_IP)
        rules = (f"table inet {NFT_TABLE} {{\n"
                 "  chain forward {\n    type filter hook forward priority 0; policy accept;\n"
                 f'    iifname "{BRIDGE}" oifname != "{BRIDGE}" counter drop comment "{LEAVING}"\n'
                 f'    oifname "{BRIDGE}" iifname != "{BRIDGE}" counter drop\n  }}\n}}\n')
        subprocess.run(["nft", "-f", "-"], input=rules, check=True, capture_output=True, text=True)
        # Pod -> Service -> pod on the same bridge is routed through the host (and the CNI bridge
        # plugin turns forwarding on anyway); claim() saved the previous value, teardown restores it.
        IP_FORWARD.write_text("1\n")

    # ------------------------------------------------------------ configuration files
    def _containerd_config(self) -> Path:
        path = self.dir / "containerd.toml"
        cri_runtime = "plugins.'io.containerd.cri.v1.runtime'"
        path.write_text(f"""\
version = 3  # containerd 2.x migrates it; written as 4 it ignored [grpc] address (2.4.2)
root = '{self.root}'
state = '{self.dir / "containerd"}'
imports = []  # nothing from the machine's /etc/containerd
# Plugins that would create machine-wide paths (/opt/containerd, /var/run/nri) and that no pod here needs.
disabled_plugins = ['io.containerd.internal.v1.opt', 'io.containerd.nri.v1.nri']

[grpc]
  address = '{self.containerd_socket}'

[ttrpc]
  address = '{self.containerd_socket}.ttrpc'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{PAUSE_IMAGE}'

[{cri_runtime}]
  # root here lacks CAP_SYS_RESOURCE: without this every sandbox fails with
  # "can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  # pod network namespaces under the state directory, so down finds and removes them all
  netns_mounts_under_state_dir = true
  [{cri_runtime}.containerd]
    default_runtime_name = 'runc'
    [{cri_runtime}.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [{cri_runtime}.containerd.runtimes.runc.options]
        BinaryName = '{_which("runc")}'
        SystemdCgroup = false
  [{cri_runtime}.cni]
    use_internal_loopback = true  # no loopback plugin, so no per-pod entries in the CNI cache for it
    bin_dirs = ['{CNI_BIN_DIR}']
    conf_dir = '{self.cni_conf_dir}'
    max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'
""")
        return path

    def _cni_config(self) -> None:
        self.cni_conf_dir.mkdir(parents=True, exist_ok=True)
        hosts = list(NODE_CIDR.hosts())
        conf = {"cniVersion": "1.0.0", "name": CNI_NETWORK, "plugins": [{
            "type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
            "ipam": {"type": "host-local", "dataDir": str(self.dir / "cni" / "ipam"),
                     "ranges": [[{"subnet": str(NODE_CIDR), "gateway": NODE_IP,
                                  "rangeStart": str(hosts[9]), "rangeEnd": str(hosts[-1])}]],
                     "routes": [{"dst": "0.0.0.0/0"}]},
        }]}
        (self.cni_conf_dir / "10-disagg-node.conflist").write_text(json.dumps(conf, indent=2))

    def _kubelet_config(self, cluster: LocalCluster, ports: dict[str, int]) -> Path:
        pki = cluster.pki
        serving_cert, serving_key = pki.issue("kubelet-serving", NODE_NAME, server=True,
                                              dns_names=[NODE_NAME, "localhost"], ips=[NODE_IP, "127.0.0.1"])
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            # This host is cgroup v1 (hybrid): the kubelet refuses it unless told not to.
            "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{CGROUP_ROOT}",
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "address": NODE_IP, "port": ports["kubelet"], "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": ports["kubelet_healthz"],
            "tlsCertFile": str(serving_cert), "tlsPrivateKeyFile": str(serving_key),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(pki.ca_cert)}},
            "authorization": {"mode": "Webhook"},
            "registerWithTaints": [REAL_NODE_TAINT],
            "clusterDomain": CLUSTER_DOMAIN, "clusterDNS": [NODE_IP],
            "podLogsDir": str(self.dir / "pod-logs"),
            # Our images are large and built locally (no registry to pull them back from): never collect them.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            # A busy shared disk must not evict the pods under test; memory still protects the machine.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "0%", "nodefs.inodesFree": "0%",
                             "imagefs.available": "0%", "imagefs.inodesFree": "0%"},
            "shutdownGracePeriod": "0s", "shutdownGracePeriodCriticalPods": "0s",
            "serializeImagePulls": False,
            "nodeStatusUpdateFrequency": "4s",
            "syncFrequency": "10s",
        }
        path = self.dir / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def _kube_proxy_config(self, kubeconfig: Path, ports: dict[str, int]) -> Path:
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "mode": "nftables", "hostnameOverride": NODE_NAME, "bindAddress": NODE_IP,
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "clusterCIDR": str(NODE_CIDR), "detectLocalMode": "ClusterCIDR",
            # Service traffic is source-NATed to the bridge address, so a pod reaching a pod on the same
            # bridge through a Service gets its replies back through the host even where bridged
            # traffic bypasses netfilter (br_netfilter absent or off).
            "masqueradeAll": True,
            "nodePortAddresses": [f"{NODE_IP}/32"],  # NodePorts only on the bridge, never on a real interface
            "healthzBindAddress": f"127.0.0.1:{ports['proxy_healthz']}",
            "metricsBindAddress": f"127.0.0.1:{ports['proxy_metrics']}",
            # 0 leaves the machine's conntrack sysctls as they are.
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        }
        path = self.dir / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def _corefile(self, cluster: LocalCluster, ready_port: int) -> Path:
        """The cluster's DNS: Service and pod names of cluster.local from the API server, on the bridge
        address the kubelet gives pods as their nameserver. No upstream: a name outside the cluster does not
        exist (NXDOMAIN, so resolvers walk their search path on), and no query leaves the machine."""
        path = self.dir / "Corefile"
        path.write_text(f"""{CLUSTER_DOMAIN}:53 {{
    bind {NODE_IP}
    errors
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} {{
        kubeconfig {cluster.kubeconfig}
        pods insecure
    }}
    cache 5
}}
.:53 {{
    bind {NODE_IP}
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
""")
        return path

    # ------------------------------------------------------------ start
    def start(self, cluster: LocalCluster, state: dict[str, Any], timeout: float,
              pool_labels: dict[str, str]) -> None:
        """containerd, the sandbox image, kubelet (joined, labelled, GPUs advertised), kube-proxy; returns once
        the node is Ready and kube-proxy has programmed the Services."""
        bins = self.bins
        state["node_bin"] = str(bins)
        ports = state["ports"]
        ports.update(kubelet=free_port(), kubelet_healthz=free_port(), proxy_healthz=free_port(),
                     proxy_metrics=free_port(), dns_ready=free_port())
        cluster._save(state)
        for d in (self.dir / "run", self.root, self.kubelet_dir, self.dir / "pod-logs"):
            d.mkdir(parents=True, exist_ok=True)
        self._cni_config()
        self._make_cgroup_root()

        cluster._spawn(state, "containerd", [str(bins / "containerd"), f"--config={self._containerd_config()}"],
                       env={"PATH": f"{bins}:{os.environ.get('PATH', '/usr/bin:/bin')}"})
        cluster._wait("containerd", lambda: self.ctr("version", check=False).returncode == 0, timeout,
                      "containerd")
        self.import_image(ociimage.Image(name=PAUSE_IMAGE, files={"/pause": bins / "pause"}, entrypoint=["/pause"]))

        # DNS before the kubelet: every pod's resolv.conf names it (kopf, for one, logs in to
        # https://kubernetes.default.svc by name)
        cluster._spawn(state, "coredns", [str(bins / "coredns"), "-conf", str(self._corefile(cluster,
                                                                                             ports["dns_ready"]))])
        cluster._wait("CoreDNS ready", lambda: _http_ok(f"http://127.0.0.1:{ports['dns_ready']}/ready"), timeout,
                      "coredns")

        node_cert, node_key = cluster.pki.issue("node", f"system:node:{NODE_NAME}", "system:nodes")
        kubelet_kc = cluster.pki.kubeconfig(self.dir / "kubelet.kubeconfig", cluster.server, "node", node_cert,
                                            node_key)
        kubelet_started = time.monotonic()
        cluster._spawn(state, "kubelet", [
            str(bins / "kubelet"), f"--config={self._kubelet_config(cluster, ports)}",
            f"--kubeconfig={kubelet_kc}", f"--root-dir={self.kubelet_dir}", f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}", "--v=1",
        ], env={"PATH": f"{bins}:{os.environ.get('PATH', '/usr/bin:/bin')}"})

        from kubernetes import client, config
        from kubernetes.client.exceptions import ApiException

        core = client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))

        def registered() -> bool:
            try:
                core.read_node(NODE_NAME)
                return True
            except ApiException as e:
                if e.status != 404:
                    raise
                return False

        cluster._wait(f"node {NODE_NAME} to register", registered, timeout, "kubelet")
        core.patch_node(NODE_NAME, {"metadata": {"labels": {REAL_NODE_LABEL: "true", **pool_labels}}})
        # Extended resources are advertised by patching the node's status (kubelet keeps what it does not manage).
        core.patch_node_status(NODE_NAME, [{"op": "add", "path": "/status/capacity/nvidia.com~1gpu",
                                            "value": str(GPUS)}])

        proxy_cert, proxy_key = cluster.pki.issue("kube-proxy", "system:kube-proxy")
        proxy_kc = cluster.pki.kubeconfig(self.dir / "kube-proxy.kubeconfig", cluster.server, "kube-proxy",
                                          proxy_cert, proxy_key)
        cluster._spawn(state, "kube-proxy", [str(bins / "kube-proxy"),
                                             f"--config={self._kube_proxy_config(proxy_kc, ports)}", "--v=1"])

        def ready() -> bool:
            node = core.read_node(NODE_NAME)
            is_ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
            return is_ready and node.status.allocatable.get("nvidia.com/gpu") == str(GPUS)

        cluster._wait(f"node {NODE_NAME} Ready with {GPUS} GPUs", ready, timeout, "kubelet")
        state["node_ready_s"] = round(time.monotonic() - kubelet_started, 1)
        cluster._save(state)
        cluster._wait("kube-proxy to program the Services",
                      lambda: _http_ok(f"http://127.0.0.1:{ports['proxy_healthz']}/healthz"), timeout, "kube-proxy")

    @functools.cached_property
    def bins(self) -> Path:
        return node_binaries()

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """containerd's own client against this node's containerd, in the CRI's namespace."""
        return _run(str(self.bins / "ctr"), f"--address={self.containerd_socket}",
                    f"--namespace={self.containerd_namespace}", *args, check=check)

    def crash_container(self, container_id: str) -> None:
        """SIGKILL every process of a container (``containerd://<id>`` as pod status gives it), as an
        out-of-memory kill or a crash would: no SIGTERM, so no drain. Deleting the pod instead sends
        SIGTERM first, and a worker then finishes its requests, which is not the failure under test."""
        self.ctr("tasks", "kill", "--all", "--signal=SIGKILL", container_id.removeprefix("containerd://"))

    def import_image(self, image: ociimage.Image) -> None:
        """Pack ``image`` and load it into the node's image store (unpacked, ready for the CRI)."""
        archive = ociimage.pack(image, self.dir / "images" / (image.name.replace("/", "_") + ".tar"))
        self.ctr("images", "import", "--platform=linux/amd64", str(archive))

    def _make_cgroup_root(self) -> None:
        for d in _cgroup_dirs():
            d.mkdir(exist_ok=True)
            for f in ("cpuset.cpus", "cpuset.mems"):  # a v1 cpuset child starts empty: no task could join it
                if (d / f).exists() and not (d / f).read_text().strip() and (d.parent / f).read_text().strip():
                    (d / f).write_text((d.parent / f).read_text())

    # ------------------------------------------------------------ stop
    def stop(self, cluster: LocalCluster, state: dict[str, Any]) -> None:
        """Stop the kubelet and kube-proxy, remove every pod's containers, stop containerd; and a
        NetworkPolicy enforcer a test left running (netpol.py), with its rules."""
        pids = state.get("pids", {})
        if pids.get("kube-router"):
            from .netpol import NetworkPolicyEnforcer

            NetworkPolicyEnforcer(cluster).stop()
            pids = cluster._state().get("pids", {})
            state["pids"] = pids
        for component in ("kubelet", "kube-proxy", "coredns"):
            if pids.get(component):
                cluster._stop(component, pids.pop(component), component)
        bins = Path(state["node_bin"]) if state.get("node_bin") else None
        if pids.get("containerd") and bins:
            self.bins = bins
            self._remove_containers()
        if pids.get("containerd"):
            cluster._stop("containerd", pids.pop("containerd"), "containerd")
        cluster._save(state)

    def _remove_containers(self) -> None:
        """Every task killed and every container deleted, so containerd's persistent root keeps images only."""
        tasks = self.ctr("tasks", "ls", "-q", check=False).stdout.split()
        for task in tasks:
            self.ctr("tasks", "kill", "--all", "--signal=SIGKILL", task, check=False)
        for task in tasks:
            self.ctr("tasks", "delete", "--force", task, check=False)
        for line in self.ctr("sandboxes", "ls", check=False).stdout.splitlines()[1:]:  # no --quiet here
            self.ctr("sandboxes", "rm", "--force", line.split()[0], check=False)
        for container in self.ctr("containers", "ls", "-q", check=False).stdout.split():
            self.ctr("containers", "delete", container, check=False)

    def teardown(self, owner: dict[str, Any]) -> None:
        """Remove what the node left on the machine: its processes, mounts, cgroups, tables, bridge and state
        files, and restore ip_forward. Idempotent; also clears what a crashed cluster left."""
        self._kill_leftovers()
        for point in _mounts_under(self.dir):
            if _run("umount", point, check=False).returncode != 0:
                _run("umount", "--lazy", point, check=False)
        for d in _cgroup_dirs():
            _remove_cgroup(d)
        for family in ("ip", "ip6"):
            _run("nft", "delete", "table", family, "kube-proxy", check=False)
        _remove_kubelet_iptables_chains(owner.get("nft_tables", []))  # a NetworkPolicy enforcer's chains too
        from .netpol import destroy_own_ipsets

        destroy_own_ipsets()  # its sets, once those chains let go of them
        _run("nft", "delete", "table", "inet", NFT_TABLE, check=False)
        _run("ip", "link", "delete", BRIDGE, check=False)
        for result in Path("/var/lib/cni/results").glob(f"{CNI_NETWORK}-*"):
            result.unlink(missing_ok=True)  # libcni's cache of this network's attachments
        for link in Path("/var/log/containers").glob("*.log"):
            if link.is_symlink() and str(self.dir) in os.readlink(link):
                link.unlink()
        for d in map(Path, owner.get("absent_dirs", [])):  # deepest first, as MACHINE_DIRS lists them
            if d == Path("/var/lib/kubelet/device-plugins"):
                for f in ("kubelet.sock", "kubelet_internal_checkpoint"):
                    (d / f).unlink(missing_ok=True)
            try:
                d.rmdir()
            except OSError:
                pass  # gone already, or holding something that is not the node's
        if owner.get("ip_forward") in ("0", "1"):
            IP_FORWARD.write_text(owner["ip_forward"] + "\n")
        if self.dir.exists():
            subprocess.run(["rm", "-rf", "--one-file-system", str(self.dir)], check=False)

    def _is_ours(self, cmdline: str) -> bool:
        return f"{self.dir}/" in cmdline  # containerd, its shims, kubelet, kube-proxy: all name a path of ours

    def _kill_leftovers(self) -> None:
        """Pod processes (found by their cgroups), and the node's own processes and shims (found by the state
        directory in their command lines: after a crash no pid file may be left to name them)."""
        for _ in range(50):
            pids = {int(p) for d in _cgroup_dirs() if d.exists() for f in d.rglob("cgroup.procs")
                    for p in f.read_text().split()}
            pids |= {int(p.name) for p in Path("/proc").iterdir()
                     if p.name.isdigit() and self._is_ours(_cmdline(int(p.name)))}
            pids.discard(os.getpid())
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        raise ClusterError(f"processes of the real node survived SIGKILL: {sorted(pids)}")


def _nft_tables() -> list[str]:
    """``family name`` of every nftables table on the machine."""
    return [line.removeprefix("table ") for line in _run("nft", "list", "tables").stdout.splitlines()]


def _remove_kubelet_iptables_chains(tables_before: list[str]) -> None:
    """Where an iptables binary exists, the kubelet adds its KUBE-* chains (firewall, canaries) to the
    iptables-nft tables and never removes them. Delete those chains and the jumps to them, and a table that
    did not exist before the node started and is left holding only empty base chains."""
    remove_iptables_chains(("KUBE-",), tables_before)


def remove_iptables_chains(prefixes: tuple[str, ...], tables_before: list[str] | None = None) -> None:
    """Delete the iptables-nft chains whose names start with one of ``prefixes``, and every jump to them;
    with ``tables_before`` (``family name`` of the tables there before), also a table not among them that is
    left holding only empty base chains."""
    target = "|".join(re.escape(p) for p in prefixes)
    for family in ("ip", "ip6"):
        for table in ("filter", "mangle", "nat"):
            listing = _run("nft", "-j", "list", "table", family, table, check=False)
            if listing.returncode != 0:
                continue
            items = json.loads(listing.stdout)["nftables"]
            for rule in (i["rule"] for i in items if "rule" in i):
                if re.search(rf'"(jump|goto)": \{{"target": "({target})', json.dumps(rule.get("expr", []))):
                    _run("nft", "delete", "rule", family, table, rule["chain"], "handle", str(rule["handle"]))
            chains = [i["chain"] for i in items if "chain" in i]
            for chain in (c for c in chains if c["name"].startswith(prefixes)):
                _run("nft", "flush", "chain", family, table, chain["name"])
            for chain in (c for c in chains if c["name"].startswith(prefixes)):
                _run("nft", "delete", "chain", family, table, chain["name"])
            if tables_before is None:
                continue
            rest = json.loads(_run("nft", "-j", "list", "table", family, table).stdout)["nftables"]
            if f"{family} {table}" not in tables_before and not any("rule" in i for i in rest) and all(
                    "hook" in i["chain"] for i in rest if "chain" in i):
                _run("nft", "delete", "table", family, table)


def _remove_cgroup(d: Path) -> None:
    if not d.is_dir():
        return
    for child in [c for c in d.iterdir() if c.is_dir()]:
        _remove_cgroup(child)
    for _ in range(50):  # an exiting task keeps its cgroup busy for a moment
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    raise ClusterError(f"cgroup {d} is still busy")


def _which(tool: str) -> str:
    for d in os.environ.get("PATH", "").split(":") + ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]:
        if d and os.access(Path(d) / tool, os.X_OK):
            return str(Path(d) / tool)
    raise ClusterError(f"{tool} not found; install Debian's packages: apt-get install -y runc "
                       "containernetworking-plugins nftables")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=ssl.create_default_context()) as r:
            return r.status == 200
    except OSError:
        return False
