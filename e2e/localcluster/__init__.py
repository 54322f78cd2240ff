"""The local Kubernetes control plane with simulated GPU node pools and one real node."""

from .controlplane import ClusterError, LocalCluster, binaries
from .node import REAL_NODE_LABEL, REAL_NODE_SELECTOR, REAL_NODE_TAINT, REAL_NODE_TOLERATION, RealNode

__all__ = ["ClusterError", "LocalCluster", "binaries", "RealNode", "REAL_NODE_LABEL", "REAL_NODE_SELECTOR",
           "REAL_NODE_TAINT", "REAL_NODE_TOLERATION"]
