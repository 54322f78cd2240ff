"""The executor: carries a planner decision out on the cluster.

* ``spec.prefill.replicas`` and ``spec.decode.replicas`` by server-side apply under the
  field manager ``disagg-planner`` (forced: the planner owns replica counts while it is
  enabled; a user's ``kubectl apply`` of a manifest without replicas leaves them alone);
* ``status.planner`` (inputs, prediction, decision, reason, who owns the replicas) and the
  ``PlannerActive`` condition, by server-side apply on the status subresource;
* ``status.latency`` and the ``SLOMet`` condition (:mod:`.slo`), in the same apply, and on their own
  for deployments with ``spec.slo`` but no planner;
* an Event when the size changes or the planner starts or stops holding for want of metrics;
* ``disagg_planner_*`` metrics.

With a flex pool (``spec.flex``), switch before scale: each flex worker whose role the decision changes
gets its pod's serving-role label (and the time, :data:`~disagg.api.names.ANNOTATION_SERVING_ROLE_SINCE`)
first, a metadata patch that the routers carry out as drain-then-flip and the operator reports; each worker
to remove gets the lowest pod-deletion-cost, so its ReplicaSet removes that one; only then
``spec.flex.replicas``, beside the dedicated roles' replicas, in the same apply.

Every Kubernetes call carries ``_request_timeout=`` :data:`KUBE_REQUEST_TIMEOUT` (the client's default is
none: one API server that accepts a connection and never answers would stall the loop for good).
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from disagg.api import kube
from disagg.api import metrics as m
from dataclasses import dataclass

from disagg.api.names import (ANNOTATION_POD_DELETION_COST, ANNOTATION_SERVING_ROLE_SINCE, GROUP, LABEL_SERVING_ROLE,
                              ROLE_DECODE, ROLE_FLEX, ROLE_PREFILL, SERVING_ROLES)
from disagg.api.v1alpha1 import API_VERSION, KIND, PLURAL, VERSION, ConditionType

from .decide import Decision, Target
from .flex import FlexDecision, FlexTarget
from .metrics_source import FlexSignals
from .reasons import METRICS_OK, ROLE_SWITCHED, UNKNOWN_GPU, UNKNOWN_MODEL
from .slo import Verdict

FIELD_MANAGER = "disagg-planner"
APPLY = "application/apply-patch+yaml"
# Every Kubernetes call the planner makes (the loop's and the executor's) carries the project's one timeout
# (disagg/api/kube.py): a call cut by it fails that deployment's pass, or the whole pass for a list, and the
# next pass tries again
KUBE_REQUEST_TIMEOUT = kube.KUBE_REQUEST_TIMEOUT

log = logging.getLogger("disagg.planner")
# the pod-deletion-cost of a flex worker the planner removes: below the default 0 of every other pod
REMOVE_COST = "-1000"


@dataclass(frozen=True)
class FlexPool:
    """A flex pool as the loop observed it (PlannerLoop.flex_pool): the target decide_flex takes, the live
    pods by name (a worker without one is a replica not created yet), what Prometheus said of the pool, and
    spec.flex.replicas as read."""

    target: FlexTarget
    pods: dict[str, Any]
    signals: FlexSignals
    replicas: int


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def replicas_owner(obj: dict[str, Any]) -> str:
    """The field manager owning ``spec.prefill.replicas`` (and decode's, when they differ: both, comma-joined)."""
    owners = []
    for role in (ROLE_PREFILL, ROLE_DECODE):
        for entry in obj.get("metadata", {}).get("managedFields") or []:
            spec = (entry.get("fieldsV1") or {}).get("f:spec", {})
            if "f:replicas" in spec.get(f"f:{role}", {}) and entry.get("subresource", "") == "":
                if entry["manager"] not in owners:
                    owners.append(entry["manager"])
    return ",".join(owners)


def owns_flex_replicas(obj: dict[str, Any]) -> bool:
    """Whether the planner's field manager owns ``spec.flex.replicas``."""
    return any(e.get("manager") == FIELD_MANAGER and e.get("subresource", "") == "" and
               "f:replicas" in (e.get("fieldsV1") or {}).get("f:spec", {}).get("f:flex", {})
               for e in obj.get("metadata", {}).get("managedFields") or [])


def _find(obj: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == ctype), None)


def _condition(obj: dict[str, Any], ctype: str, status: str, reason: str, message: str) -> dict[str, Any]:
    """A condition whose lastTransitionTime moves only when its status flips."""
    previous = _find(obj, ctype)
    return {"type": str(ctype), "status": status, "reason": reason, "message": message[:32768],
            "lastTransitionTime": previous["lastTransitionTime"]
            if previous and previous.get("status") == status else _now(),
            "observedGeneration": obj["metadata"].get("generation")}


class PlannerMetrics:
    """The planner's own /metrics (one registry per process)."""

    def __init__(self, registry: Any = None):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry or CollectorRegistry()
        labels = ["namespace", "deployment"]
        r = self.registry
        self.decisions = Counter(m.PLANNER_DECISIONS, "Planner decisions", labels + ["role", "direction", "reason"],
                                 registry=r)
        self.desired = Gauge(m.PLANNER_DESIRED_REPLICAS, "Replicas the planner chose", labels + ["role"], registry=r)
        self.predicted_rate = Gauge(m.PLANNER_PREDICTED_REQUEST_RATE, "Predicted request rate (requests/s)", labels,
                                    registry=r)
        self.ttft = Gauge(m.PLANNER_OBSERVED_TTFT_SECONDS, "Observed TTFT at the SLO percentile", labels, registry=r)
        self.itl = Gauge(m.PLANNER_OBSERVED_ITL_SECONDS, "Observed ITL at the SLO percentile", labels, registry=r)
        self.available = Gauge(m.PLANNER_METRICS_AVAILABLE, "1 when the planner had the metrics it needs", labels,
                               registry=r)
        self.model_known = Gauge(m.PLANNER_MODEL_KNOWN, "1 when the model and GPU are in the performance model's "
                                 "data (0: the planner holds)", labels, registry=r)
        self.flex_workers = Gauge(m.PLANNER_FLEX_WORKERS, "Flex workers by the role the planner gave them (serving "
                                  "it or draining to switch to it)", labels + ["role"], registry=r)
        self.role_switches = Counter(m.PLANNER_ROLE_SWITCHES, "Role switches the planner asked for, by how they "
                                     "ended (switched: the routers drained and flipped; abandoned: the drain's "
                                     "bound passed; cancelled: asked back first)",
                                     labels + ["from_role", "to_role", "outcome"], registry=r)
        # per deployment: what forget() removes when a deployment goes (or leaves the planner)
        self._per_deployment = (self.decisions, self.desired, self.predicted_rate, self.ttft, self.itl,
                                self.available, self.model_known, self.flex_workers, self.role_switches)
        self.errors = Counter(m.PLANNER_ERRORS, "Failed calls and passes (the loop goes on)", ["stage", "error"],
                              registry=r)
        self.last_pass = Gauge(m.PLANNER_LAST_PASS, "When the loop last made progress (unix seconds)", registry=r)

    def forget(self, namespace: str, name: str) -> None:
        """Drop every series of one deployment (deleted, or no longer planned): a departed deployment's last
        ``metrics_available 0`` would otherwise keep its alert firing."""
        for metric in self._per_deployment:
            metric.remove_by_labels({"namespace": namespace, "deployment": name})

    def record(self, namespace: str, name: str, decision: Decision, target: Target,
               flex: tuple[FlexDecision, FlexTarget] | None = None) -> None:
        """``flex``: a deployment with a flex pool, whose changes are counted per role as
        :meth:`FlexDecision.records` names them (role ``flex`` for the pool; a switch one role up, the other
        down, reason RoleSwitched), its desired replicas the dedicated ones and the pool's."""
        lab = {"namespace": namespace, "deployment": name}
        if flex is not None:
            fd, ftarget = flex
            records = fd.records(ftarget) or [(role, "hold", fd.reason) for role in (ROLE_PREFILL, ROLE_DECODE,
                                                                                      ROLE_FLEX)]
            for role, direction, reason in records:
                self.decisions.labels(**lab, role=role, direction=direction, reason=reason).inc()
            for role, n in ((ROLE_PREFILL, fd.prefill), (ROLE_DECODE, fd.decode), (ROLE_FLEX, fd.flex)):
                self.desired.labels(**lab, role=role).set(n)
            for role in SERVING_ROLES:
                self.flex_workers.labels(**lab, role=role).set(fd.total(role) - (fd.prefill if role == ROLE_PREFILL
                                                                                 else fd.decode))
        else:
            for role, rd, current in ((ROLE_PREFILL, decision.prefill, target.prefill),
                                      (ROLE_DECODE, decision.decode, target.decode)):
                self.decisions.labels(**lab, role=role, direction=rd.direction(current), reason=rd.reason).inc()
                self.desired.labels(**lab, role=role).set(rd.replicas)
        # a hold for an unknown model or GPU comes only after the metrics were read (the loop sees to it): the
        # metrics alert must not fire for it, PlannerActive and model_known say it instead
        self.available.labels(**lab).set(1 if decision.metrics_ok or decision.reason in (UNKNOWN_MODEL, UNKNOWN_GPU)
                                         else 0)
        if "requestRate" in decision.prediction:
            self.predicted_rate.labels(**lab).set(decision.prediction["requestRate"])
        if "ttft" in decision.inputs:
            self.ttft.labels(**lab).set(decision.inputs["ttft"])
        if "itl" in decision.inputs:
            self.itl.labels(**lab).set(decision.inputs["itl"])


class Executor:
    def __init__(self, api_client: Any, metrics: PlannerMetrics | None = None,
                 request_timeout: float | tuple[float, float] = KUBE_REQUEST_TIMEOUT):
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.metrics = metrics
        self.request_timeout = request_timeout

    def apply(self, obj: dict[str, Any], decision: Decision, target: Target,
              verdict: Verdict | None = None, flex: tuple[FlexDecision, FlexPool] | None = None,
              now: float | None = None) -> dict[str, Any]:
        """Carry ``decision`` out on ``obj`` (the DisaggDeployment as read); returns the object after it.
        With a ``verdict``, status.latency and SLOMet are written in the same status apply. With ``flex``
        (a flex pool's decision and the pool it was made on; ``decision`` then carries its reason and
        message, ``target`` is the dedicated roles'), the pods' roles first, the replicas after;
        ``now``: the planner's clock, recorded on each pod it gives a role. A decision that grows the flex
        pool writes its status (the pool's split, which the operator gives new pods their roles by) before
        the replicas, so no new pod is seen before the split it is to follow."""
        meta = obj["metadata"]
        ns, name = meta["namespace"], meta["name"]
        owner = replicas_owner(obj)
        sizes = {"prefill": {"replicas": decision.prefill.replicas}, "decode": {"replicas": decision.decode.replicas}}
        changes = decision.changes(target)
        switched: list[str] = []
        fd = None
        if flex is not None:
            fd, pool = flex
            switched = self._flex_pods(ns, fd, pool, now)
            if switched:
                # the labels are the switch (the routers act on them): its event goes with them, so a spec
                # or status write failing below cannot lose it (the next pass sees the roles already given)
                self._event(obj, "Normal", ROLE_SWITCHED, f"{', '.join(switched)}: {decision.message}")
            sizes = {"prefill": {"replicas": fd.prefill}, "decode": {"replicas": fd.decode},
                     "flex": {"replicas": fd.flex}}
            changes = (fd.prefill, fd.decode, fd.flex) != (target.prefill, target.decode, pool.replicas)
        previous = _find(obj, ConditionType.PLANNER_ACTIVE)
        before = obj
        write_spec = changes or owner != FIELD_MANAGER or (flex is not None and not owns_flex_replicas(obj))
        split_first = write_spec and fd is not None and bool(fd.add)
        if split_first:
            # (a forced apply makes the planner the replicas' owner: the status says so before it lands)
            obj = self._status(obj, decision, sizes, FIELD_MANAGER, verdict, fd)
        if write_spec:
            # always every role: a field left out of an apply is a field given up
            body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": ns},
                    "spec": sizes}
            obj = self.custom.patch_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, name, body, field_manager=FIELD_MANAGER, force=True,
                _content_type=APPLY, _request_timeout=self.request_timeout)
        if not split_first or replicas_owner(obj) != FIELD_MANAGER:
            obj = self._status(obj, decision, sizes, replicas_owner(obj), verdict, fd)
        if verdict is not None:
            self._slo_event(before, obj, verdict)
        status = "True" if decision.metrics_ok else "False"
        if changes and not (switched and decision.reason == ROLE_SWITCHED):
            self._event(obj, "Normal", decision.reason, decision.message)
        elif not changes and (previous is None or previous.get("status") != status):
            self._event(obj, "Normal" if decision.metrics_ok else "Warning",
                        METRICS_OK if decision.metrics_ok else decision.reason, decision.message)
        if self.metrics:
            self.metrics.record(ns, name, decision, target, (fd, pool.target) if flex is not None else None)
        log.info('{"deployment": "%s/%s", "prefill": %d, "decode": %d%s, "reason": "%s"}', ns, name,
                 sizes["prefill"]["replicas"], sizes["decode"]["replicas"],
                 f', "flex": {fd.flex}, "switches": {len(fd.switches)}' if fd is not None else "", decision.reason)
        return obj

    def _status(self, obj: dict[str, Any], decision: Decision, sizes: dict[str, dict[str, int]], owner: str,
                verdict: Verdict | None, fd: FlexDecision | None) -> dict[str, Any]:
        """status.planner, PlannerActive (and with a ``verdict`` status.latency and SLOMet) in one apply;
        returns the object after it."""
        meta = obj["metadata"]
        status = "True" if decision.metrics_ok else "False"
        reason = METRICS_OK if decision.metrics_ok else decision.reason
        planner = {"replicasManagedBy": owner, "lastDecisionTime": _now(),
                   "prefillReplicas": sizes["prefill"]["replicas"], "decodeReplicas": sizes["decode"]["replicas"],
                   "reason": decision.reason, "message": decision.message[:32768],
                   "inputs": decision.inputs, "prediction": decision.prediction}
        if fd is not None:
            planner.update(flexReplicas=fd.flex, flexPrefill=fd.total(ROLE_PREFILL) - fd.prefill,
                           flexDecode=fd.total(ROLE_DECODE) - fd.decode)
        planner = {k: v for k, v in planner.items() if v != {}}  # (an empty map would be sent as null)
        written: dict[str, Any] = {"planner": planner, "conditions": [
            _condition(obj, ConditionType.PLANNER_ACTIVE, status, reason, decision.message)]}
        if verdict is not None:
            written["latency"] = verdict.latency
            written["conditions"].append(_condition(obj, ConditionType.SLO_MET, *verdict.condition()))
        body = {"apiVersion": API_VERSION, "kind": KIND,
                "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "status": written}
        return self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], body, field_manager=FIELD_MANAGER, force=True,
            _content_type=APPLY, _request_timeout=self.request_timeout)

    def _flex_pods(self, namespace: str, fd: FlexDecision, pool: FlexPool, now: float | None) -> list[str]:
        """The pods' side of a flex decision: the serving-role label of every kept worker whose pod has
        another (a switch) or none yet, and the lowest deletion cost on each worker to remove. Metadata only,
        on flex pods only: a planner role that patches pods is admitted no other change (the chart's
        planner-writes policy). Returns the switches written, as ``pod: from -> to``."""
        switched = []
        since = f"{now if now is not None else dt.datetime.now(dt.timezone.utc).timestamp():.0f}"
        for pod_name, role in fd.roles:
            pod = pool.pods.get(pod_name)
            old = (pod.metadata.labels or {}).get(LABEL_SERVING_ROLE) if pod is not None else None
            if pod is None or old == role:
                continue
            self.core.patch_namespaced_pod(pod_name, namespace, {"metadata": {
                "labels": {LABEL_SERVING_ROLE: role}, "annotations": {ANNOTATION_SERVING_ROLE_SINCE: since}}},
                _request_timeout=self.request_timeout)
            if old in SERVING_ROLES:
                switched.append(f"{pod_name}: {old} -> {role}")
        for pod_name in fd.remove:
            if pod_name in pool.pods:
                self.core.patch_namespaced_pod(pod_name, namespace, {"metadata": {
                    "annotations": {ANNOTATION_POD_DELETION_COST: REMOVE_COST}}}, _request_timeout=self.request_timeout)
        return switched

    def report(self, obj: dict[str, Any], verdict: Verdict) -> dict[str, Any]:
        """status.latency and SLOMet alone (a deployment with spec.slo and no planner)."""
        meta = obj["metadata"]
        body = {"apiVersion": API_VERSION, "kind": KIND,
                "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                "status": {"latency": verdict.latency,
                           "conditions": [_condition(obj, ConditionType.SLO_MET, *verdict.condition())]}}
        after = self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], body, field_manager=FIELD_MANAGER, force=True,
            _content_type=APPLY, _request_timeout=self.request_timeout)
        self._slo_event(obj, after, verdict)
        return after

    def _slo_event(self, before: dict[str, Any], after: dict[str, Any], verdict: Verdict) -> None:
        old = _find(before, ConditionType.SLO_MET)
        if old is None or old.get("status") != verdict.status:
            self._event(after, "Warning" if verdict.status == "False" else "Normal", verdict.reason,
                        f"SLOMet={verdict.status}: {verdict.message}")

    def _event(self, obj: dict[str, Any], kind: str, reason: str, message: str) -> None:
        meta = obj["metadata"]
        now = dt.datetime.now(dt.timezone.utc)
        body = {"metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
                                   "namespace": meta["namespace"], "uid": meta.get("uid")},
                "type": kind, "reason": reason, "message": message[:1024],
                "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
                "reportingInstance": FIELD_MANAGER, "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        try:
            self.core.create_namespaced_event(meta["namespace"], body, _request_timeout=self.request_timeout)
        except Exception as e:  # an event is worth a log line, never a failed decision
            log.warning('{"event": "failed", "deployment": "%s", "error": "%s"}', meta["name"], e)
