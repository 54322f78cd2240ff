"""A NetworkPolicy enforcer on the real node: kube-router's firewall, and nothing else of it.

The real node's CNI (the bridge plugin) does not implement NetworkPolicy, so a policy there is accepted
and ignored. This runs what a cluster's CNI would: kube-router with only its firewall on (no routing, no
service proxy: the bridge and kube-proxy keep doing those), which programs iptables and ipsets for the
pods of this node from the NetworkPolicies, pods and namespaces it watches. Its binary comes from
build-netpol.sh (versions.env says why kube-router). Started for the tests that prove a policy with
traffic and stopped after them, its rules and sets removed (``--cleanup-config``), so the rest of the
suite runs on a node without one, as before.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from .controlplane import HERE, SERVICE_CIDR, LocalCluster, free_port
from .node import NODE_NAME, remove_iptables_chains

COMPONENT = "kube-router"


def netpol_binaries() -> Path:
    """The enforcer's bin directory (built and cached by build-netpol.sh on first use)."""
    out = subprocess.run(["bash", str(HERE / "build-netpol.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


# The ipsets kube-router's firewall names (a policy's pod selectors and namespaces, its own local IPs).
IPSET_PREFIXES = ("KUBE-SRC-", "KUBE-DST-", "KUBE-ROUTER-", "kube-router-")
# Its iptables chains: the base ones and one per policy and per pod.
IPTABLES_PREFIXES = ("KUBE-ROUTER-", "KUBE-NWPLCY-", "KUBE-POD-FW-")


def own_ipsets() -> list[str]:
    out = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True, check=False).stdout
    return [n for n in out.split() if n.startswith(IPSET_PREFIXES)]


def own_chains() -> list[str]:
    """Its iptables-nft chains left on the machine, as ``family table chain``."""
    import json

    out = []
    for family in ("ip", "ip6"):
        listing = subprocess.run(["nft", "-j", "list", "chains", family], capture_output=True, text=True, check=False)
        if listing.returncode == 0:
            out += [f"{family} {c['chain']['table']} {c['chain']['name']}" for c in json.loads(listing.stdout)["nftables"]
                    if "chain" in c and c["chain"]["name"].startswith(IPTABLES_PREFIXES)]
    return out


def destroy_own_ipsets(timeout: float = 60) -> None:
    """Destroy the enforcer's ipsets once nothing holds them. The kernel lets go of a set some time after
    the last iptables rule naming it is deleted (nf_tables frees rules after a grace period), and until
    then `ipset destroy` answers "in use by a kernel component": so retry until they are gone, and say
    which remain if they outlive the deadline."""
    deadline = time.monotonic() + timeout
    errors: dict[str, str] = {}
    while names := own_ipsets():
        for name in names:
            r = subprocess.run(["ipset", "destroy", name], capture_output=True, text=True, check=False)
            if r.returncode:
                errors[name] = r.stderr.strip()
        if time.monotonic() > deadline:
            raise RuntimeError(f"kube-router's ipsets outlived its rules: {errors or names}")
        if own_ipsets():
            time.sleep(0.5)


class NetworkPolicyEnforcer:
    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.bin = netpol_binaries() / "kube-router"
        self.health_port = free_port()

    def start(self, timeout: float = 120) -> NetworkPolicyEnforcer:
        """Start it and return once its controllers have synced (its health endpoint says so)."""
        state = self.cluster._state()
        # the admin kubeconfig: a CNI's daemon runs with a ClusterRole to read pods, namespaces and
        # policies; what it is allowed is not what these tests are about
        self.cluster._spawn(state, COMPONENT, [
            str(self.bin), "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
            f"--kubeconfig={self.cluster.kubeconfig}", f"--hostname-override={NODE_NAME}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", f"--health-port={self.health_port}", "--metrics-port=0",
            "--v=1"])
        self.cluster._wait("kube-router's firewall to sync", self._healthy, timeout, COMPONENT)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def stop(self) -> None:
        """Stop it and remove every rule and set it made (pods are then unfiltered again)."""
        self.cluster.stop_component(COMPONENT)
        subprocess.run([str(self.bin), "--cleanup-config"], capture_output=True, text=True, check=False)
        # --cleanup-config (v2.1.0) leaves its base chains, the jumps to them and the policies' ipsets
        # (seen after a run: KUBE-ROUTER-INPUT/FORWARD/OUTPUT, KUBE-NWPLCY-DEFAULT): removed here, chains
        # first, as a set stays in use while a rule names it
        remove_iptables_chains(IPTABLES_PREFIXES)
        destroy_own_ipsets()

    def tail(self, lines: int = 40) -> str:
        return self.cluster.tail(COMPONENT, lines)
