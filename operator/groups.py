"""Replicas larger than one pod: each is a group of pods the operator runs itself.

A multi-pod replica (``spec.<role>.podsPerReplica`` > 1) is one vLLM engine (or one data-parallel set of
engines) whose torch.distributed world spans its pods: pod 0, the leader, serves the API, the metrics
and the NIXL side channel; the others run their ranks headless (``render.worker_pod_template``). Such a
world cannot be rejoined, so the group lives and dies as a whole, and that is what this controller does
with it, from the status loop (``handlers.status_loop``), on every change of the deployment's pods:

* **Replicas.** Each group is ``<name>-<role>-<slot>`` with pods ``...-<slot>-<index>`` (``names``), its
  own PodGroup under the role's composite (``gang``), so the scheduler places all its pods or none, in
  one topology domain. A group of the current KV revision, generation and gang is *current*; the role
  wants ``replicas`` current groups and gets new ones in the lowest free slots.
* **Failure.** A pod of a group that failed (``restartPolicy: Never``: an engine that exits fails its
  pod), was deleted, or is missing, breaks the group: the rest of its pods are deleted at once and a
  new group takes a free slot (the old names are busy until the old pods are gone). Counted
  (``disagg_operator_group_restarts_total``) and evented (``GroupRestarted``), with the pod and why.
* **Rollouts and scale-down** remove whole groups, never pods of one. A group of an older revision stays
  until enough current groups are ready to replace it (a role never drops below ``replicas`` ready
  groups for a rollout), and while the new revision has no ready prefill and decode pair at all
  (``revisions.hold``), none goes. Its pods are deleted together; the non-leaders' preStop waits for the
  leader to stop serving, so the leader drains with its ranks still there.

Why not LeaderWorkerSet or a StatefulSet per replica: LWS would be a controller and CRD every cluster must
run at a matching version (and the chart depend on), and restarts a group on any pod's failure only as
its own policy allows; a StatefulSet per replica cannot carry the names (a StatefulSet name is bounded
to 52 characters by its controller-revision-hash label, our group names reach 60) and recreates a lost
pod alone, which a torch.distributed group cannot use. Pods the operator creates are owned by the
DisaggDeployment (garbage-collected with it), and each names its replica's PodGroup, which is how the
workload API's gang reaches the group's pods.

``plan`` is pure (pods in, actions out); ``run`` applies a plan with the API.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from disagg.api.names import LABEL_GANG, LABEL_GROUP, MAX_GROUP_REPLICAS, ROLE_DECODE, ROLE_PREFILL, group_index

from . import gang as gangs
from . import render
from .status import DeploymentView, PodView

# a broken group's remaining pods: their engine has lost a peer and serves nothing, so no drain
BROKEN_GRACE_SECONDS = 1


@dataclass
class Group:
    name: str
    slot: int
    pods: list[PodView]

    @property
    def leader(self) -> PodView | None:
        return next((p for p in self.pods if p.group_pod == 0), None)

    @property
    def going(self) -> bool:
        """Every pod it has left is being deleted (by this controller, or with its owner)."""
        return all(p.terminating for p in self.pods)

    @property
    def ready(self) -> bool:
        leader = self.leader
        return leader is not None and leader.ready and not self.going

    def current(self, revision: str, generation: int, gang: str | None) -> bool:
        return all(p.revision == revision and p.generation == str(generation) and p.gang == (gang or None)
                   for p in self.pods)

    def broken(self, size: int) -> str | None:
        """Why this group cannot be (or become) one engine any more, or None."""
        for p in sorted(self.pods, key=lambda p: p.group_pod or 0):
            if p.phase in ("Failed", "Succeeded"):
                return f"pod {p.name} {p.failure or p.phase.lower()}"
        deleted = [p.name for p in self.pods if p.terminating]
        if deleted:
            return f"pod {', '.join(deleted)} was deleted"
        missing = sorted(set(range(size)) - {p.group_pod for p in self.pods})
        if missing:
            return f"pod {', '.join(f'{self.name}-{i}' for i in missing)} is missing"
        return None


@dataclass
class Plan:
    create: list[int] = field(default_factory=list)                # slots of new groups
    restart: list[tuple[Group, str]] = field(default_factory=list)  # broken groups to delete now, and why
    remove: list[tuple[Group, str]] = field(default_factory=list)   # groups to delete gracefully, and why


def groups_of(pods: list[PodView], role: str) -> list[Group]:
    by_name: dict[str, list[PodView]] = defaultdict(list)
    for p in pods:
        if p.role == role and p.group:
            by_name[p.group].append(p)
    out = []
    for name, members in by_name.items():
        slot = group_index(name)
        if slot is not None:
            out.append(Group(name, slot, members))
    return sorted(out, key=lambda g: g.slot)


def plan(pods: list[PodView], role: str, size: int, replicas: int, revision: str, generation: int,
         gang: str | None, hold: bool, whole: frozenset[str] = frozenset()) -> Plan:
    """What the role's groups need now. ``size``: pods per replica; ``gang``: the gang label current pods
    carry (None without a gang); ``hold``: the new revision has no ready pair yet (``revisions.hold``);
    ``whole``: groups the API server showed whole although the pods seen here say otherwise."""
    out = Plan()
    groups = groups_of(pods, role)
    live = [g for g in groups if not g.going]
    healthy = []
    for g in live:
        why = None if g.name in whole else g.broken(size)
        if why:
            out.restart.append((g, why))
        else:
            healthy.append(g)
    current = [g for g in healthy if g.current(revision, generation, gang)]
    old = [g for g in healthy if not g.current(revision, generation, gang)]
    # the first to go: not ready ones, then the highest slots
    def removal_order(gs: list[Group]) -> list[Group]:
        return sorted(gs, key=lambda g: (g.ready, -g.slot))

    if len(current) > replicas:
        out.remove += [(g, f"scaled down to {replicas}") for g in removal_order(current)[:len(current) - replicas]]
    if old and not hold:
        ready_current = sum(1 for g in current if g.ready)
        keep = max(0, replicas - ready_current)
        out.remove += [(g, "replaced by a ready group of the current revision")
                       for g in removal_order(old)[:max(0, len(old) - keep)]]
    used = {g.slot for g in groups}
    free = (s for s in range(MAX_GROUP_REPLICAS) if s not in used)
    for _ in range(max(0, replicas - len(current))):
        slot = next(free, None)
        if slot is None:
            break
        out.create.append(slot)
    return out


def manifests(dd, uid: str, role: str, slot: int, gang: gangs.Gang, generation: int) -> list[dict[str, Any]]:
    """The replica's PodGroup (with the workload-API gang) and its pods, leader first."""
    name = dd.metadata.name
    group = render.group_name(name, role, slot)
    out = []
    pod_group = gangs.replica_pod_group(gang, role, group)
    if pod_group is not None:
        meta = render._meta(dd, uid, render.replica_pod_group_name(gang, group), role)
        meta["labels"] |= {LABEL_GROUP: group, LABEL_GANG: gang.name}
        out.append({**pod_group, "metadata": meta})
    for index in range(getattr(dd.spec, role).pods_per_replica):
        template = render.worker_pod_template(dd, role, gang, generation, rank=(slot, index))
        meta = render._meta(dd, uid, render.group_pod_name(name, role, slot, index), role)
        meta["labels"] = {**template["metadata"]["labels"], **meta["labels"]}
        if template["metadata"].get("annotations"):
            meta["annotations"] = dict(template["metadata"]["annotations"])
        out.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]})
    return out


def live_generation(dd, pods: list[PodView], deps: list[tuple[str, DeploymentView]]) -> int:
    """The generation of the running KV revision (``render.revision_generation``), read from the group pods
    of that revision when there are any, else from the role Deployments: scaling or a change that keeps
    the revision never makes the running groups old."""
    revision = render.kv_revision(dd)
    gens = [int(p.generation) for p in pods if p.group and p.revision == revision and (p.generation or "").isdigit()]
    if gens:
        return max(gens)
    live = next(((v.revision, v.revision_generation) for _, v in deps if v.revision == revision), (None, None))
    return render.revision_generation(dd, live)


def deployment_view(dd, role: str, pods: list[PodView], revision: str, generation: int,
                    gang: str | None) -> DeploymentView:
    """A multi-pod role as the status reads a Deployment: replicas are groups, updated ones are current."""
    gs = [g for g in groups_of(pods, role) if not g.going]
    current = [g for g in gs if g.current(revision, generation, gang)]
    view = DeploymentView(desired=getattr(dd.spec, role).replicas, updated=len(current),
                          ready=sum(g.ready for g in gs), observed_generation=0, generation=0)
    view.revision, view.revision_generation = revision, generation
    return view


@dataclass
class Outcome:
    events: list[tuple[str, str, str]] = field(default_factory=list)   # (type, reason, message)
    restarts: dict[str, int] = field(default_factory=dict)             # role -> groups restarted now


def run(clients, dd, uid: str, pods: list[PodView], gang: gangs.Gang, generation: int, hold: bool) -> Outcome:
    """Bring every multi-pod role's groups one step towards its plan."""
    out = Outcome()
    revision = render.kv_revision(dd)
    namespace = dd.metadata.namespace
    for role in (ROLE_PREFILL, ROLE_DECODE):
        if not render.multi_pod(dd, role):
            for group in groups_of(pods, role):   # the role went back to one-pod replicas (a Deployment)
                if not group.going:
                    _delete_group(clients, namespace, group, None)
                    out.events.append(("Normal", "GroupDeleted", f"{role} replica {group.name}: the role's "
                                                                 "replicas are one pod each now"))
            continue
        spec = getattr(dd.spec, role)
        args = (pods, role, spec.pods_per_replica, spec.replicas, revision, generation,
                gang.name if gang.objects else None, hold)
        todo = plan(*args)
        # the pods seen here lag the API server's (pods this controller just created, not all seen yet):
        # a group is only restarted when the API server says it is broken, and counted as whole otherwise
        whole = frozenset(g.name for g, _ in todo.restart
                          if not _confirmed_broken(clients, namespace, g, spec.pods_per_replica))
        if whole:
            todo = plan(*args, whole=whole)
        for group, why in todo.restart:
            _delete_group(clients, namespace, group, BROKEN_GRACE_SECONDS)
            out.restarts[role] = out.restarts.get(role, 0) + 1
            out.events.append(("Warning", "GroupRestarted",
                               f"{role} replica {group.name} restarts as a whole: {why} (a torch.distributed "
                               "group cannot be rejoined); a new group replaces it"))
        for group, why in todo.remove:
            _delete_group(clients, namespace, group, None)
            out.events.append(("Normal", "GroupDeleted", f"{role} replica {group.name}: {why}"))
        for slot in todo.create:
            for m in manifests(dd, uid, role, slot, gang, generation):
                _create(clients, m)
            out.events.append(("Normal", "GroupCreated",
                               f"{role} replica {render.group_name(dd.metadata.name, role, slot)}: "
                               f"{spec.pods_per_replica} pods, {spec.layout().gpus_per_pod} GPUs each"))
    return out


def _confirmed_broken(clients, namespace: str, group: Group, size: int) -> bool:
    """What the API server says now: a group whose pods are all there, none failed or deleted, is whole;
    one whose pods are all being deleted is going (this controller removing it), not broken."""
    resp = clients.core.list_namespaced_pod(namespace, label_selector=f"{LABEL_GROUP}={group.name}",
                                            _preload_content=False)
    items = json.loads(resp.data).get("items") or []
    deleted = [i for i in items if i["metadata"].get("deletionTimestamp")]
    if not items or len(deleted) == len(items):
        return False
    failed = any((i.get("status") or {}).get("phase") in ("Failed", "Succeeded") for i in items)
    return bool(deleted) or failed or len(items) < size


def _delete_group(clients, namespace: str, group: Group, grace: int | None) -> None:
    """Every pod of the group together (the non-leaders' preStop holds them for the leader's drain), and
    its PodGroup."""
    for pg in clients.list(gangs.WORKLOAD_API, "PodGroup", namespace, f"{LABEL_GROUP}={group.name}") or []:
        try:
            clients.delete(gangs.WORKLOAD_API, "PodGroup", namespace, pg["metadata"]["name"])
        except ApiException as e:
            if e.status != 404:
                raise
    for p in group.pods:
        if p.terminating and grace is None:
            continue
        try:
            clients.core.delete_namespaced_pod(p.name, namespace, grace_period_seconds=grace,
                                               _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise


def _create(clients, manifest: dict[str, Any]) -> None:
    meta = manifest["metadata"]
    try:
        if manifest["kind"] == "Pod":
            clients.core.create_namespaced_pod(meta["namespace"], manifest, _preload_content=False)
        else:
            clients.apply(manifest)
    except ApiException as e:
        if e.status != 409:   # created by a previous pass whose index update has not arrived yet
            raise
