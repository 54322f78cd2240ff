"""Flex workers (spec.flex): the serving role on each flex pod, and what the operator reports of it.

A flex pod's role is its LABEL_SERVING_ROLE label. The planner owns it where it runs (its decision, written
on the pod, disagg.planner.apply); the operator writes it only on a pod that has none yet, and never changes
a role someone set. A new flex worker takes the role the planner asked new workers for: its split of the
pool (status.planner.flexPrefill/flexDecode, which the planner writes before the spec.flex.replicas that grow
the pool) less the
workers already in each role. So a pod the planner grew the pool by starts in its role, and never drains
to take it at the planner's next pass. With no planner (or a split the pool already has), the role fewer
flex workers serve (decode on a tie: decode's KV memory is what a burst of long answers runs out of first),
so a pool with no planner stays split evenly. Each change
of the label it sees (against ANNOTATION_OBSERVED_SERVING_ROLE, its record on the pod) is reported once: an
event RoleSwitched and disagg_operator_role_switches_total. The routers carry a switch out: they drain the
worker of its old role's work before they send it the new role's (router/fleet.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from disagg.api.names import (ANNOTATION_OBSERVED_SERVING_ROLE, LABEL_SERVING_ROLE, ROLE_DECODE, ROLE_FLEX,
                              ROLE_PREFILL, SERVING_ROLES, initial_serving_role)

from . import metrics
from . import status as statuses


@dataclass(frozen=True)
class Split:
    """The planner's split of the flex pool as its last pass wrote it (status.planner): workers per role,
    and the pool's size it was made for."""

    prefill: int
    decode: int
    replicas: int

    def get(self, role: str) -> int:
        return self.prefill if role == ROLE_PREFILL else self.decode


def planned_split(obj: dict[str, Any], planner_enabled: bool) -> Split | None:
    """The planner's split of the flex pool, from status.planner; None without a planner (a split left from
    one since disabled is not followed)."""
    planner = (obj.get("status") or {}).get("planner") or {}
    if not planner_enabled or not all(k in planner for k in ("flexPrefill", "flexDecode", "flexReplicas")):
        return None
    return Split(int(planner["flexPrefill"]), int(planner["flexDecode"]), int(planner["flexReplicas"]))


def initial_role(pods: list[statuses.PodView], planned: Split | None = None) -> tuple[str, str]:
    """The role a new flex worker takes, and why: the one the planner's split (``planned``) has most workers
    short of, else the one fewer flex workers serve, decode on a tie."""
    serving = [p.serving_role for p in pods if p.role == ROLE_FLEX and not p.terminating]
    if planned:
        short = {role: planned.get(role) - serving.count(role) for role in (ROLE_DECODE, ROLE_PREFILL)}
        role = max(short, key=lambda r: short[r])    # decode first on a tie
        if short[role] > 0:
            return role, "the planner's split of the pool"
    return initial_serving_role(serving), "the role fewer flex workers serve"


def split_lags(pods: list[statuses.PodView], planned: Split | None) -> bool:
    """Whether the pool has more live workers than the planner's split was made for: spec.flex.replicas
    raised by someone else, or a status write of the planner's that failed or came from an older planner,
    which wrote its status after the replicas."""
    return planned is not None and sum(p.role == ROLE_FLEX and not p.terminating for p in pods) > planned.replicas


def run(core, namespace: str, name: str, pods: list[statuses.PodView], written: dict[str, str],
        planned: Split | None = None) -> tuple[list[statuses.PodView], list[tuple[str, str, str]], int]:
    """Labels the flex pods that have no serving role yet and records the switches seen since the last
    refresh. Returns the pods as they are now, the events, and how many switches were seen. ``written``
    (pod -> the role this operator last wrote or recorded on it, kept across refreshes) stands in for the
    pod's label and annotation until the pod watch brings them back, so nothing is written or counted
    twice. ``planned``: the planner's split of the pool (:func:`planned_split`), which new pods follow; while
    it lags the pool (:func:`split_lags`), a new pod that is not ready yet waits for it unlabelled (the
    status write that follows brings a refresh; a pod that gets ready first takes the role fewer serve)."""
    events: list[tuple[str, str, str]] = []
    switches = 0
    out = list(pods)
    live = {p.name for p in out}
    for gone in [n for n in written if n not in live]:
        del written[gone]
    for i, p in enumerate(out):
        if p.role != ROLE_FLEX or p.terminating:
            continue
        if p.name in written:
            mine = written[p.name]
            if p.serving_role not in SERVING_ROLES:        # our label, not back from the watch yet
                p = out[i] = replace(p, serving_role=mine, observed_role=mine)
            elif p.serving_role == mine:                   # our annotation, not back yet
                p = out[i] = replace(p, observed_role=mine)
        patch: dict[str, Any] = {}
        if p.serving_role not in SERVING_ROLES:
            lags = split_lags(out, planned)
            if lags and not p.ready:
                continue
            role, why = initial_role(out, None if lags else planned)
            patch = {"labels": {LABEL_SERVING_ROLE: role}, "annotations": {ANNOTATION_OBSERVED_SERVING_ROLE: role}}
            events.append(("Normal", "FlexRoleAssigned", f"flex worker {p.name} serves {role} (no role set: "
                                                         f"{why})"))
            out[i] = replace(p, serving_role=role, observed_role=role)
        elif p.observed_role != p.serving_role:
            patch = {"annotations": {ANNOTATION_OBSERVED_SERVING_ROLE: p.serving_role}}
            if p.observed_role in SERVING_ROLES:
                switches += 1
                metrics.role_switches.labels(namespace, name, p.observed_role, p.serving_role).inc()
                events.append(("Normal", "RoleSwitched", f"flex worker {p.name}: {p.observed_role} -> "
                                                         f"{p.serving_role} (the routers drain it of its "
                                                         f"{p.observed_role} work first)"))
            out[i] = replace(p, observed_role=p.serving_role)
        if patch:
            core.patch_namespaced_pod(p.name, namespace, {"metadata": patch})
            written[p.name] = out[i].serving_role
    for role in SERVING_ROLES:
        metrics.flex_workers.labels(namespace, name, role).set(
            sum(p.role == ROLE_FLEX and not p.terminating and p.serving_role == role for p in out))
    return out, events, switches


def status(desired: int, pods: list[statuses.PodView], previous: dict[str, Any] | None, switches: int
           ) -> dict[str, Any]:
    """status.flex: desired, ready, per serving role, and the switches seen so far."""
    live = [p for p in pods if p.role == ROLE_FLEX and not p.terminating]
    ready = sum(p.ready for p in live)
    return {"desired": desired, "ready": ready,
            ROLE_PREFILL: sum(p.serving_role == ROLE_PREFILL for p in live),
            ROLE_DECODE: sum(p.serving_role == ROLE_DECODE for p in live),
            "roleSwitches": ((previous or {}).get("roleSwitches") or 0) + switches,
            "summary": f"{ready}/{desired}"}


def forget(namespace: str, name: str) -> None:
    """Drops a deleted deployment's gauges."""
    for role in SERVING_ROLES:
        try:
            metrics.flex_workers.remove(namespace, name, role)
        except KeyError:
            pass
