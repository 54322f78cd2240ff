"""Why a gang does not fit: free GPUs per topology domain, in numbers.

Pure: nodes and the pods bound to them in, one sentence out, e.g.
"gang needs 6 nvidia.com/gpu in one nvidia.com/gpu.clique domain; the largest
free domain has 4". Only computed while a gang waits, so its list calls cost
nothing in the steady state.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from disagg.api.v1alpha1 import GPU_RESOURCE


@dataclass(frozen=True)
class NodeFree:
    name: str
    labels: dict[str, str]
    free_gpus: int


def parse_count(value: str | int | None) -> int:
    if value is None:
        return 0
    text = str(value)
    return int(text[:-1]) // 1000 if text.endswith("m") else int(text)


def free_gpus(nodes: list[dict], pods: list[dict]) -> list[NodeFree]:
    """Allocatable GPUs minus those requested by pods bound to each schedulable node."""
    used: dict[str, int] = defaultdict(int)
    for pod in pods:
        node = pod.get("spec", {}).get("nodeName")
        if not node or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for c in pod["spec"].get("containers", []):
            res = c.get("resources") or {}
            used[node] += parse_count((res.get("limits") or {}).get(GPU_RESOURCE)
                                      or (res.get("requests") or {}).get(GPU_RESOURCE))
    out = []
    for node in nodes:
        if node.get("spec", {}).get("unschedulable"):
            continue
        alloc = parse_count((node.get("status", {}).get("allocatable") or {}).get(GPU_RESOURCE))
        if alloc:
            out.append(NodeFree(node["metadata"]["name"], node["metadata"].get("labels") or {},
                                alloc - used[node["metadata"]["name"]]))
    return out


def _packs(requests: list[int], free: list[int]) -> bool:
    """First-fit decreasing: can every replica (GPUs each) be placed on these nodes?"""
    bins = sorted(free, reverse=True)
    for need in sorted(requests, reverse=True):
        for i, room in enumerate(bins):
            if room >= need:
                bins[i] -= need
                break
        else:
            return False
    return True


def explain(nodes: list[NodeFree], requests: list[int], key: str | None,
            selectors: list[dict[str, str]] | None = None) -> tuple[bool, str]:
    """(fits, message) for placing all `requests` (GPUs per replica), all in one domain of `key` if given."""
    selectors = [s for s in (selectors or []) if s]
    eligible = [n for n in nodes if all(n.labels.get(k) == v for s in selectors for k, v in s.items())]
    need = sum(requests)
    if key:
        domains: dict[str, list[NodeFree]] = defaultdict(list)
        for n in eligible:
            if key in n.labels:
                domains[n.labels[key]].append(n)
        best = max((sum(max(n.free_gpus, 0) for n in members) for members in domains.values()), default=0)
        fits = any(_packs(requests, [n.free_gpus for n in members]) for members in domains.values())
        msg = (f"gang needs {need} {GPU_RESOURCE} in one {key} domain "
               f"({len(requests)} replicas of {', '.join(str(r) for r in sorted(set(requests)))}); "
               f"the largest free domain has {best}")
        if best >= need and not fits:
            msg += ", but split across nodes that cannot hold whole replicas"
        return fits, msg
    total = sum(max(n.free_gpus, 0) for n in eligible)
    fits = _packs(requests, [n.free_gpus for n in eligible])
    msg = f"gang needs {need} {GPU_RESOURCE} ({len(requests)} replicas); the cluster has {total} free"
    if total >= need and not fits:
        msg += ", but split across nodes that cannot hold whole replicas"
    return fits, msg
