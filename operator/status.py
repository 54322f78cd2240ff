"""Observed state -> status and the events worth telling a human. Pure.

The status contract: observedGeneration; per role desired/scheduled/ready/
updated; endpoint; phase; conditions Ready, GangScheduled, Progressing,
Degraded with CamelCase reasons and messages that carry numbers and names.
A condition's lastTransitionTime moves only when its status flips; conditions
this module does not own (SLOMet, the planner's) are left as they are.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from disagg.api.names import ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER, ROLES
from disagg.api.v1alpha1 import ConditionType, DisaggDeployment, GangBackend, Phase

OWNED = (ConditionType.READY, ConditionType.GANG_SCHEDULED, ConditionType.PROGRESSING, ConditionType.DEGRADED,
         ConditionType.INFERENCE_POOL_APPLIED)
# Container waiting reasons that mean "will not start without a change".
FAULTS = ("ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "CreateContainerConfigError",
          "CreateContainerError", "InvalidImageName", "RunContainerError")


@dataclass
class PodView:
    name: str
    role: str
    node: str | None
    ready: bool
    phase: str
    waiting_reason: str | None = None
    waiting_message: str | None = None  # the kubelet's, e.g. 'secret "hf-token" not found'
    terminating: bool = False
    template_hash: str | None = None
    created: str = ""
    gang: str | None = None
    revision: str | None = None   # its KV revision (contract.KV_REVISION_LABEL)
    generation: str | None = None  # that revision's generation (contract.KV_REVISION_GENERATION_LABEL)
    group: str | None = None      # its replica's group, on a pod of a multi-pod replica (operator/groups.py)
    group_pod: int | None = None  # its index there (0 = the leader)
    headless: bool = False        # a group's pod other than the leader: no API, not a replica of its own
    failure: str | None = None    # why its container ended, when it did (a group pod is never restarted)
    serving_role: str | None = None   # a flex pod's role now (LABEL_SERVING_ROLE)
    observed_role: str | None = None  # the one the operator last saw on it (ANNOTATION_OBSERVED_SERVING_ROLE)


@dataclass
class DeploymentView:
    desired: int
    updated: int
    ready: int
    current_hash: str | None = None  # pod-template-hash of the newest ReplicaSet, when known
    observed_generation: int = 0
    generation: int = 0
    # the KV revision its pod template carries, and that revision's ordering generation
    revision: str | None = None
    revision_generation: int | None = None


@dataclass
class PoolState:
    """A picker-mode deployment's InferencePool as the operator last applied it: its name once it exists,
    else why it does not (reason, message: its API is not served, or the operator may not write it)."""

    name: str | None = None
    reason: str = ""
    message: str = ""
    retry_at: float = 0.0   # when the status loop tries again to create a missing one (time.monotonic)


@dataclass
class Observed:
    pods: list[PodView] = field(default_factory=list)
    deployments: dict[str, DeploymentView] = field(default_factory=dict)
    gang_message: str | None = None     # why the gang waits (capacity or scheduler message)
    gang_fits: bool | None = None       # capacity verdict, when computed
    blocked: tuple[str, str] | None = None  # (reason, message) that stops the rollout
    applied_generation: int | None = None   # last generation whose children were applied (None: unknown)
    # roles of multi-pod replicas: pods of every rank bound, and groups restarted by this refresh
    group_pods_scheduled: dict[str, int] = field(default_factory=dict)
    group_restarts: dict[str, int] = field(default_factory=dict)
    apply_error: str | None = None          # why applying the current generation failed
    inference_pool: PoolState | None = None  # picker mode: the InferencePool (None: not applied yet)
    flex_switches: int = 0                   # flex workers' role switches seen by this refresh (operator/flex.py)


def _fault_detail(dd: DisaggDeployment, reason: str, message: str | None) -> str:
    """What the kubelet says about a container that cannot be configured: a missing spec.model.secretRef
    shows here (the operator never reads Secrets; the kubelet does, for the pod)."""
    if reason != "CreateContainerConfigError" or not message:
        return ""
    ref = dd.spec.model.secret_ref
    hint = " (spec.model.secretRef)" if ref and f'"{ref.name}"' in message else ""
    return f": {message[:200]}{hint}"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(previous: dict[str, dict], ctype: str, status: bool, reason: str, message: str,
               generation: int, now: str) -> dict[str, Any]:
    value = "True" if status else "False"
    old = previous.get(ctype)
    since = old["lastTransitionTime"] if old and old.get("status") == value else now
    return {"type": ctype, "status": value, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}


def gang_pending_since(obs: Observed, dd: DisaggDeployment) -> str | None:
    """Creation time of the oldest unbound pod of the minimum set, while the gang waits."""
    unbound = [p.created for p in obs.pods if p.role in (ROLE_PREFILL, ROLE_DECODE) and not p.node
               and not p.terminating]
    return min(unbound) if unbound else None


def compute(dd: DisaggDeployment, generation: int, previous: dict[str, Any] | None, obs: Observed,
            endpoint: str, now: str | None = None) -> tuple[dict[str, Any], list[tuple[str, str, str]]]:
    """(status patch, events as (type, reason, message))."""
    now = now or _now()
    previous = previous or {}
    prev_conds = {c["type"]: c for c in previous.get("conditions") or []}
    spec = dd.spec
    roles: dict[str, dict[str, Any]] = {}
    for role in ROLES:
        dep = obs.deployments.get(role)
        pods = [p for p in obs.pods if p.role == role and not p.terminating]
        desired = getattr(spec, role).replicas if role != ROLE_ROUTER else spec.router.replicas
        ready = sum(p.ready for p in pods)
        updated = dep.updated if dep else 0
        roles[role] = {"desired": desired, "scheduled": sum(bool(p.node) for p in pods), "ready": ready,
                       "updated": min(updated, desired) if dep else 0, "summary": f"{ready}/{desired}"}
        if role != ROLE_ROUTER and getattr(spec, role).pods_per_replica > 1:
            before = (previous.get(role) or {}).get("groupRestarts") or 0
            roles[role] |= {"podsPerReplica": getattr(spec, role).pods_per_replica,
                            "podsScheduled": obs.group_pods_scheduled.get(role, 0),
                            "groupRestarts": before + obs.group_restarts.get(role, 0)}

    picker = spec.router.picker_settings()
    pool = obs.inference_pool if picker else None
    if pool and pool.name:
        roles[ROLE_ROUTER]["inferencePool"] = pool.name

    faults = sorted((p.role, p.name, p.waiting_reason, p.waiting_message) for p in obs.pods
                    if p.waiting_reason in FAULTS and not p.terminating)
    gang = spec.scheduling.gang
    mins = {ROLE_PREFILL: gang.min_prefill, ROLE_DECODE: gang.min_decode}
    bound_ok = all(roles[r]["scheduled"] >= n for r, n in mins.items())
    conds: list[dict[str, Any]] = []

    # GangScheduled
    if gang.backend == GangBackend.NONE:
        gs = (True, "GangSchedulingDisabled", "scheduling.gang.backend is none: pods schedule one by one")
    elif bound_ok:
        gs = (True, "GangPlaced", f"minimum set bound: prefill {roles[ROLE_PREFILL]['scheduled']}/"
                                  f"{gang.min_prefill}, decode {roles[ROLE_DECODE]['scheduled']}/{gang.min_decode}")
    else:
        since = gang_pending_since(obs, dd)
        waited = age_seconds(since, now) if since else 0
        detail = obs.gang_message or "waiting for the scheduler to place the minimum set"
        if waited > gang.timeout_seconds:
            reason = "GangTimeout"
            detail = f"not placed after {int(waited)}s (timeout {gang.timeout_seconds}s): {detail}"
        elif obs.gang_fits is False:
            reason = "InsufficientCapacity"
        else:
            reason = "Pending"
        gs = (False, reason, detail)
    conds.append(_condition(prev_conds, ConditionType.GANG_SCHEDULED, *gs, generation, now))

    # Degraded
    if obs.blocked:
        deg = (True, obs.blocked[0], obs.blocked[1])
    elif obs.apply_error:
        deg = (True, "ApplyFailed", f"generation {generation} could not be applied: {obs.apply_error}")
    elif faults:
        deg = (True, faults[0][2], "; ".join(f"{reason} on {role} pod {name}{_fault_detail(dd, reason, message)}"
                                             for role, name, reason, message in faults))
    elif pool and not pool.name:   # picker mode without its InferencePool: no gateway can route to it
        deg = (True, pool.reason, pool.message)
    else:
        short = [f"{r} {roles[r]['ready']}/{roles[r]['desired']} ready" for r in ROLES
                 if roles[r]["ready"] < roles[r]["desired"]]
        was_ready = prev_conds.get(ConditionType.READY, {}).get("status") == "True"
        if was_ready and short:  # it served, and lost replicas since (a node gone, pods evicted)
            deg = (True, "ReplicasUnavailable", ", ".join(short))
        else:
            deg = (False, "AsExpected", "no faults observed")
    conds.append(_condition(prev_conds, ConditionType.DEGRADED, *deg, generation, now))

    # Progressing
    moving = []
    if obs.applied_generation is not None and obs.applied_generation < generation:
        moving.append(f"generation {generation} not applied yet")
    for role in ROLES:
        r, dep = roles[role], obs.deployments.get(role)
        if dep is None:
            moving.append(f"{role} not created yet")
        elif dep.observed_generation < dep.generation or r["updated"] < r["desired"]:
            moving.append(f"{role} {r['updated']}/{r['desired']} updated")
        elif r["ready"] != r["desired"] or dep.ready != r["desired"]:
            moving.append(f"{role} {r['ready']}/{r['desired']} ready")
    if obs.blocked:
        prog = (False, obs.blocked[0], obs.blocked[1])
    elif moving:
        prog = (True, "RollingOut" if any("updated" in m for m in moving) else "Scaling", ", ".join(moving))
    else:
        prog = (False, "Complete", "every role has its desired replicas, updated and ready")
    conds.append(_condition(prev_conds, ConditionType.PROGRESSING, *prog, generation, now))

    # Ready: can serve: at least one ready prefill (unless none wanted), decode and router.
    missing = [role for role in ROLES if roles[role]["ready"] == 0 and roles[role]["desired"] > 0]
    if obs.blocked:
        rd = (False, obs.blocked[0], obs.blocked[1])
    elif missing:
        rd = (False, "NoReady" + "".join(m.capitalize() for m in missing),
              "no ready " + ", ".join(missing) + " pods" + ("" if bound_ok else f"; {gs[2]}"))
    else:
        rd = (True, "Serving", f"prefill {roles[ROLE_PREFILL]['summary']}, decode {roles[ROLE_DECODE]['summary']}, "
                               f"router {roles[ROLE_ROUTER]['summary']} ready")
    conds.append(_condition(prev_conds, ConditionType.READY, *rd, generation, now))

    # InferencePoolApplied, in picker mode once the operator has applied (or tried to apply) the pool
    if pool and picker:
        ip = (True, "Applied", f"InferencePool {pool.name} selects the decode pods that serve; its endpoint picker "
                               f"is Service {dd.metadata.name} port {picker.port} (failureMode "
                               f"{picker.failure_mode})") if pool.name else (False, pool.reason, pool.message)
        conds.append(_condition(prev_conds, ConditionType.INFERENCE_POOL_APPLIED, *ip, generation, now))

    kept = [c for c in previous.get("conditions") or [] if c["type"] not in OWNED]
    if rd[0] and not deg[0]:
        phase = Phase.READY
    elif deg[0]:
        phase = Phase.DEGRADED
    elif prog[0] or not bound_ok:
        phase = Phase.PROGRESSING if bound_ok else Phase.PENDING
    else:
        phase = Phase.PENDING
    status = {"observedGeneration": generation, "phase": str(phase), "conditions": conds + kept,
              "prefill": roles[ROLE_PREFILL], "decode": roles[ROLE_DECODE], "router": roles[ROLE_ROUTER],
              "endpoint": endpoint}
    if spec.flex is not None:
        from . import flex

        status["flex"] = flex.status(spec.flex.replicas, obs.pods, previous.get("flex"), obs.flex_switches)

    # Events: a condition that turned (True/False), or anything worth a warning when it appears or its
    # reason changes. Not a condition's first, unremarkable value, nor a new reason for the same state
    # (NoReadyPrefill -> NoReadyDecode): the status shows those, and as events they were 9 writes per new
    # deployment, at fleet scale the API server's most frequent write, posted one by one minutes late.
    events = []
    for cond in conds:
        old = prev_conds.get(cond["type"])
        turned = old is not None and old.get("status") != cond["status"]
        new_reason = old is None or old.get("reason") != cond["reason"]
        warn = (cond["type"] in (ConditionType.DEGRADED,) and cond["status"] == "True") or (
            cond["type"] in (ConditionType.GANG_SCHEDULED, ConditionType.READY) and cond["status"] == "False"
            and cond["reason"] not in ("Pending",) and not cond["reason"].startswith("NoReady"))
        if turned or (warn and new_reason):
            events.append(("Warning" if warn else "Normal", cond["reason"], f"{cond['type']}={cond['status']}: "
                                                                            f"{cond['message']}"))
    return status, events


def age_seconds(since: str, now: str | None = None) -> float:
    def parse(stamp: str) -> dt.datetime:
        return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")
    return (parse(now or _now()) - parse(since)).total_seconds()


def changed(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether writing `new` would change the status (fields this module owns)."""
    old = old or {}
    return any(old.get(k) != v for k, v in new.items())
