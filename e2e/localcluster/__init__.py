"""The local Kubernetes control plane with simulated GPU node pools."""

from .controlplane import ClusterError, LocalCluster, binaries

__all__ = ["ClusterError", "LocalCluster", "binaries"]
