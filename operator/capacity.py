"""Why a gang does not fit: free GPUs per role and per topology domain, in numbers.

Pure: nodes and the pods bound to them in, one sentence out, e.g.
"gang needs 25 nvidia.com/gpu: decode cannot be placed (needs 24 = 3 x 8, 16 free
on the 2 nodes its nodeSelector and tolerations admit); prefill fits (needs 1, 16
free on 2 nodes)". Each role is counted on the nodes *its own* nodeSelector and
tolerations admit: in a mixed fleet prefill and decode often ask for different GPU
products, and no node carries both. Only computed while a gang waits, so its list
calls cost nothing in the steady state.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from disagg.api.v1alpha1 import GPU_RESOURCE

# Taint effects that keep a pod that does not tolerate them off a node (PreferNoSchedule only scores).
_BLOCKING = ("NoSchedule", "NoExecute")


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str


@dataclass(frozen=True)
class NodeFree:
    name: str
    labels: dict[str, str]
    free_gpus: int
    taints: tuple[Taint, ...] = ()  # the blocking ones only


class TolerationLike(Protocol):
    key: str | None
    operator: str
    value: str | None
    effect: str | None


@dataclass(frozen=True)
class RoleNeed:
    """One role's part of the gang's minimum set, and where its pods may go."""

    role: str
    replicas: int
    gpus: int                                   # per replica
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[TolerationLike, ...] = ()

    @property
    def need(self) -> int:
        return self.replicas * self.gpus

    def admits(self, node: NodeFree) -> bool:
        """The scheduler's NodeSelector and TaintToleration filters, as they apply to this role's pods."""
        if any(node.labels.get(k) != v for k, v in self.node_selector.items()):
            return False
        return all(any(_tolerates(t, taint) for t in self.tolerations) for taint in node.taints)


def _tolerates(toleration: TolerationLike, taint: Taint) -> bool:
    # Kubernetes' rule: an empty effect matches every effect; an empty key with Exists matches every taint.
    if toleration.effect and toleration.effect != taint.effect:
        return False
    if toleration.operator == "Exists":
        return not toleration.key or toleration.key == taint.key
    return toleration.key == taint.key and (toleration.value or "") == taint.value


def parse_count(value: str | int | None) -> int:
    if value is None:
        return 0
    text = str(value)
    return int(text[:-1]) // 1000 if text.endswith("m") else int(text)


def used_gpus(pods: Iterable[dict]) -> dict[str, int]:
    """GPUs requested per node by the pods bound to it (finished pods hold none)."""
    used: dict[str, int] = defaultdict(int)
    for pod in pods:
        node = pod.get("spec", {}).get("nodeName")
        if not node or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for c in pod["spec"].get("containers", []):
            res = c.get("resources") or {}
            used[node] += parse_count((res.get("limits") or {}).get(GPU_RESOURCE)
                                      or (res.get("requests") or {}).get(GPU_RESOURCE))
    return used


def free_gpus(nodes: Iterable[dict], used: dict[str, int] | Iterable[dict]) -> list[NodeFree]:
    """Allocatable GPUs minus those `used` (per node, or the bound pods to count) on each schedulable node."""
    if not isinstance(used, dict):
        used = used_gpus(used)
    out = []
    for node in nodes:
        spec = node.get("spec") or {}
        if spec.get("unschedulable"):
            continue
        alloc = parse_count((node.get("status", {}).get("allocatable") or {}).get(GPU_RESOURCE))
        if alloc:
            taints = tuple(Taint(t["key"], t.get("value") or "", t["effect"]) for t in spec.get("taints") or []
                           if t.get("effect") in _BLOCKING)
            out.append(NodeFree(node["metadata"]["name"], node["metadata"].get("labels") or {},
                                alloc - used.get(node["metadata"]["name"], 0), taints))
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


def _packs_roles(roles: list[RoleNeed], nodes: list[NodeFree]) -> bool:
    """Every role's replicas at once, each only on nodes its role admits, sharing the nodes both admit.
    First-fit decreasing with the most constrained replicas first: a heuristic, like _packs."""
    room = {n.name: n.free_gpus for n in nodes}
    admitted = {r.role: [n.name for n in nodes if r.admits(n)] for r in roles}
    replicas = sorted(((r.gpus, r.role) for r in roles for _ in range(r.replicas)),
                      key=lambda x: (-x[0], len(admitted[x[1]])))
    for need, role in replicas:
        spot = max((name for name in admitted[role] if room[name] >= need), key=room.__getitem__, default=None)
        if spot is None:
            return False
        room[spot] -= need
    return True


def _role_part(r: RoleNeed, nodes: list[NodeFree], free_counts: bool = True) -> tuple[bool, str]:
    """(fits alone, "needs N, F free on M nodes ...") for one role on these nodes; without
    `free_counts`, "needs N, M nodes admit it" (for a role that fits, see _roles_sentence)."""
    eligible = [n for n in nodes if r.admits(n)]
    fits = _packs([r.gpus] * r.replicas, [n.free_gpus for n in eligible])
    shape = f"{r.need} = {r.replicas} x {r.gpus}" if r.replicas > 1 else str(r.need)
    nodes_text = f"{len(eligible)} node{'' if len(eligible) == 1 else 's'}"
    if fits and not free_counts:
        return fits, f"needs {shape}, {nodes_text} admit it"
    free = sum(max(n.free_gpus, 0) for n in eligible)
    text = f"needs {shape}, {free} free on {nodes_text}"
    if not fits:
        text += " its nodeSelector and tolerations admit"
        if free >= r.need:
            text += ", split across nodes that cannot hold whole replicas"
    return fits, text


def _roles_sentence(roles: list[RoleNeed], nodes: list[NodeFree]) -> tuple[bool, str]:
    """(all roles fit together, a sentence naming each role with numbers, the unplaceable first)."""
    parts = {r.role: _role_part(r, nodes) for r in roles}
    short = [r.role for r in roles if not parts[r.role][0]]
    if short:
        blocked = "; ".join(f"{role} cannot be placed ({parts[role][1]})" for role in short)
        rest = ", ".join(f"{r.role} fits ({parts[r.role][1]})" for r in roles if r.role not in short)
        return False, blocked + (f"; {rest}" if rest else "")
    each = ", ".join(f"{r.role} ({parts[r.role][1]})" for r in roles)
    if _packs_roles(roles, nodes):
        # no free counts in a gang that fits: they change with every pod bound anywhere, and a waiting
        # gang's status would be rewritten with each (300 gangs waiting at once: thousands of writes)
        return True, ", ".join(f"{r.role} fits ({_role_part(r, nodes, free_counts=False)[1]})" for r in roles)
    names = " and ".join(r.role for r in roles)
    return False, f"{names} each fit alone but not together on the nodes they share: {each}"


def explain(nodes: list[NodeFree], roles: list[RoleNeed], key: str | None) -> tuple[bool, str]:
    """(fits, message) for placing every role's minimum replicas, all in one domain of `key` if given."""
    roles = [r for r in roles if r.replicas > 0]
    need = sum(r.need for r in roles)
    nodes = [n for n in nodes if any(r.admits(n) for r in roles)]
    if not key:
        fits, sentence = _roles_sentence(roles, nodes)
        return fits, f"gang needs {need} {GPU_RESOURCE}: {sentence}"
    domains: dict[str, list[NodeFree]] = defaultdict(list)
    for n in nodes:
        if key in n.labels:
            domains[n.labels[key]].append(n)
    verdicts = {d: _roles_sentence(roles, members) for d, members in domains.items()}
    sizes = ", ".join(str(s) for s in sorted({r.gpus for r in roles}))
    head = f"gang needs {need} {GPU_RESOURCE} in one {key} domain ({sum(r.replicas for r in roles)} replicas of {sizes})"
    if not domains:
        _, sentence = _roles_sentence(roles, [])
        return False, f"{head}; no node of any role carries {key}: {sentence}"

    def total(d: str) -> int:
        return sum(max(n.free_gpus, 0) for n in domains[d])

    placed = sorted(d for d, (fits, _) in verdicts.items() if fits)
    # the domain to explain: one that fits, else the one where the most roles fit alone, then the most free
    best = placed[0] if placed else max(sorted(domains), key=lambda d: (
        sum(_role_part(r, domains[d])[0] for r in roles), total(d)))
    if placed:       # as above: no free counts where it fits
        return True, f"{head}; in {key}={best}: {verdicts[best][1]}"
    largest = max(total(d) for d in domains)
    return False, f"{head}; the largest free domain has {largest}; in {key}={best}: {verdicts[best][1]}"
