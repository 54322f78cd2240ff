"""The planner loop: every DisaggDeployment with ``spec.planner.enabled``, every ``intervalSeconds``.

observe (Prometheus) -> decide (pure) -> apply (executor). Clients are made once at
start-up and passed in; per-deployment memory (load history, online correction,
cooldown clocks) lives in the loop object, keyed by the deployment's UID.

Between decisions, every scrape interval, the fast path (:func:`disagg.planner.decide.react`) reads the
waiting queues and scales a role up at once when its queue grows faster than its replicas drain it.

A failed call (Kubernetes or Prometheus) costs one pass, or one deployment's pass, never the process: it is
logged (one JSON line), counted (``disagg_planner_errors_total{stage, error}``), every deployment's memory
stays, and the next pass tries again. Each pass, and each deployment handled, is a heartbeat
(:meth:`PlannerLoop.stalled_for`) that the planner's ``/healthz`` reads. A deployment that leaves the listing
(deleted, or neither planned nor reported any more) leaves the loop's memory and the planner's metrics.

The model and GPU are looked up in the performance model's data; one it does not know is never planned as
another: the planner holds, says why in status (``UnknownModel``, ``UnknownGPU``), in a log line and in
``disagg_planner_model_known``.

A deployment with a flex pool (``spec.flex``) is planned by :func:`disagg.planner.flex.decide_flex` (and
:func:`~disagg.planner.flex.react_flex` between decisions) on what the loop observes of the pool
(:meth:`PlannerLoop.flex_pool`): its pods (each one's serving-role label, readiness, the time the planner
gave it that role) from the API server, and from Prometheus the workers its routers have draining for a
switch and each engine's requests. The executor carries a switch out as the pod's serving-role label (the
routers drain, then flip; the operator reports it), before it writes any replica count. The pool's bounds:
``spec.flex.minReplicas`` (none: 0) to ``spec.flex.maxReplicas`` (none: the dedicated roles' own limit,
the GPU budget bounding all three).
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import threading
import traceback
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import yaml

from disagg.api.names import (ANNOTATION_POD_DELETION_COST, ANNOTATION_SERVING_ROLE_SINCE, GROUP, LABEL_DEPLOYMENT,
                              LABEL_ROLE, LABEL_SERVING_ROLE, ROLE_FLEX, SERVING_ROLES, initial_serving_role)
from disagg.api import metrics as m
from disagg.api.v1alpha1 import PLURAL, VERSION, ConditionType, DisaggDeploymentSpec
from disagg.perf import model as perfmodel

from . import slo
from .apply import KUBE_REQUEST_TIMEOUT, REMOVE_COST, Executor, FlexPool, PlannerMetrics
from .decide import MAX_REPLICAS, Decision, Memory, Observation, RoleModels, Target, decide, react
from .flex import (STARTING, SERVING, SWITCHING, FlexDecision, FlexMemory, FlexTarget, FlexWorker, decide_flex,
                   react_flex)
from .endpoints import Allowlist, Endpoint
from .metrics_source import DEFAULT_SCRAPE_INTERVAL, FAST_SCRAPES, FlexSignals, MetricsSource, query_window
from .reasons import PROMETHEUS_NOT_ALLOWED, UNKNOWN_GPU, UNKNOWN_MODEL

if TYPE_CHECKING:   # (off, the planner imports no OpenTelemetry)
    from .tracing import DecisionTracer

log = logging.getLogger("disagg.planner")

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_ANNOTATION = f"{GROUP}/gpu"


def resolve_model_name(spec: DisaggDeploymentSpec, profile: perfmodel.Profile | None = None) -> str | None:
    """The models.yaml entry for the deployment's model: the hf:// repo, else a case-insensitive name match,
    else the model its measured profile names; None when none is known (the planner then holds)."""
    known = perfmodel.known_models()
    source = spec.model.source
    candidates = [source[len("hf://"):]] if source.startswith("hf://") else []
    candidates.append(spec.model.name)
    if profile is not None:
        candidates.append(profile.model)
    for c in candidates:
        for k in known:
            if c.lower() == k.lower() or c.lower() == k.split("/")[-1].lower():
                return k
    return None


def gpu_hint(obj: dict[str, Any], spec: DisaggDeploymentSpec, profile: perfmodel.Profile | None = None) -> str:
    """What names the GPU: the ``serving.disagg.dev/gpu`` annotation, else the roles' ``nvidia.com/gpu.product``
    selector, else the GPU the measured profile was taken on; "" when nothing does."""
    return ((obj["metadata"].get("annotations") or {}).get(GPU_ANNOTATION) or
            spec.prefill.node_selector.get(GPU_PRODUCT_LABEL) or spec.decode.node_selector.get(GPU_PRODUCT_LABEL) or
            (profile.gpu if profile is not None else "") or "")


def resolve_gpu(obj: dict[str, Any], spec: DisaggDeploymentSpec,
                profile: perfmodel.Profile | None = None) -> str | None:
    """The gpus.yaml entry :func:`gpu_hint` names; None when it names none (the planner then holds)."""
    known = perfmodel.known_gpus()
    hint = gpu_hint(obj, spec, profile)
    if not hint:
        return None
    for k in known:
        if hint == k:
            return k
    for k in known:  # "NVIDIA-H100-80GB-HBM3" -> H100-SXM
        if k.split("-")[0].lower() in hint.lower():
            return k
    return None


@dataclass(frozen=True)
class Unplannable:
    """Why the performance model cannot size a deployment (a reason of :mod:`.reasons`, and words for status)."""

    reason: str
    message: str


def unplannable(obj: dict[str, Any], spec: DisaggDeploymentSpec,
                profile: perfmodel.Profile | None = None) -> Unplannable | None:
    """None when the model and the GPU are both known, else what is missing and how to name it."""
    problems = []
    if resolve_model_name(spec, profile) is None:
        problems.append((UNKNOWN_MODEL, f"model unknown: spec.model.source {spec.model.source!r} and spec.model.name "
                                        f"{spec.model.name!r} match no model of the planner's performance model "
                                        f"({', '.join(perfmodel.known_models())})"))
    if resolve_gpu(obj, spec, profile) is None:
        hint = gpu_hint(obj, spec, profile)
        said = f"GPU {hint!r} unknown" if hint else "no GPU named"
        problems.append((UNKNOWN_GPU, f"{said}: the {GPU_ANNOTATION} annotation or a role's nodeSelector "
                                      f"{GPU_PRODUCT_LABEL} names one of {', '.join(perfmodel.known_gpus())}"))
    if not problems:
        return None
    return Unplannable(problems[0][0], "; ".join(p for _, p in problems) +
                       ": the planner holds rather than size the deployment for a model or GPU it was not given")


def _readable(obs: Observation) -> bool:
    """decide()'s own first checks: an observation it holds on before it reads any model."""
    return (not obs.error and not obs.missing and obs.request_rate is not None and
            math.isfinite(obs.request_rate))


def _error_kind(e: BaseException) -> str:
    """A label value with few values: the HTTP status of an API error, else the exception's class."""
    status = getattr(e, "status", None)
    return f"http_{status}" if isinstance(status, int) else type(e).__name__


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def readiness(obj: dict[str, Any]) -> tuple[bool, bool]:
    """(ready, rolling out) from the operator's status."""
    status = obj.get("status") or {}
    ready = (condition(obj, ConditionType.READY) or {}).get("status") == "True"
    progressing = (condition(obj, ConditionType.PROGRESSING) or {}).get("status") == "True"
    stale = status.get("observedGeneration") not in (None, obj["metadata"].get("generation"))
    return ready, progressing or stale


@dataclass(frozen=True)
class Switch:
    """A role switch the planner asked for, until its routers report the worker's drain over."""

    frm: str
    to: str
    asked: float     # time.monotonic() when the label was written (the drain's bound is wall time)
    # the routers' flips frm -> to (after a drain, past its bound) when it was asked; None: not known then
    flips: tuple[float, float] | None = None


@dataclass
class _State:
    namespace: str
    name: str
    memory: Memory = field(default_factory=Memory)
    last: float | None = None
    last_fast: float | None = None     # the fast path's last look at the queues
    unplannable: Unplannable | None = None   # as last logged (logged again only when it changes)
    flex: FlexMemory | None = None     # with spec.flex: the planner's memory plus each role's keep size
    switching: dict[str, Switch] = field(default_factory=dict)   # flex pod -> the switch it drains for
    last_flex: FlexDecision | None = None
    # the roles of the flex workers the planner asked for that have no pod yet, in order: a new pod takes
    # the next one (the operator follows the planner's split, status.planner, but a pod it labelled before
    # that split was written, or by the role fewer serve, is relabelled)
    adding: list[str] = field(default_factory=list)
    adding_at: Any = None    # when they were asked for (a pod created before is not one of them)
    # the flex pods of the last decision carried out: a pod among them took its role then, and is never
    # taken for a later ask (its label, the operator's or the planner's, is its role)
    known: frozenset[str] = frozenset()


def _since(value: str | None) -> float:
    try:
        since = float(value) if value is not None else 0.0
    except ValueError:
        return 0.0
    return since if math.isfinite(since) else 0.0


def _pod_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []) if pod.status)


class PlannerLoop:
    def __init__(self, api_client: Any, executor: Executor, source_for: Callable[[Endpoint], MetricsSource],
                 endpoints: Allowlist | None = None, namespace: str | list[str] | None = None,
                 clock: Callable[[], float] = time.time, scrape_interval: float = DEFAULT_SCRAPE_INTERVAL,
                 metrics: PlannerMetrics | None = None,
                 request_timeout: float | tuple[float, float] = KUBE_REQUEST_TIMEOUT,
                 tracer: DecisionTracer | None = None):
        """``metrics``: the planner's own (default: the executor's); ``request_timeout``: of every Kubernetes
        call the loop makes (the executor has its own, the same by default); ``tracer``: records every
        decision as a span (None: tracing off)."""
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.executor = executor
        self.source_for = source_for
        self.endpoints = endpoints or Allowlist({})  # the only Prometheus servers it may read
        # one namespace, several (a namespaced planner role in each: never a cluster-wide list), or all
        self.namespaces = [namespace] if isinstance(namespace, str) else list(namespace or [])
        self.clock = clock
        self.scrape_interval = scrape_interval  # of the series it reads: its windows span at least four
        self.state: dict[str, _State] = {}
        self.metrics = metrics if metrics is not None else executor.metrics
        self.request_timeout = request_timeout
        self.tracer = tracer
        self._heartbeat = time.monotonic()   # a new loop gets its first pass's worth of grace

    # -- liveness and failures

    def _beat(self) -> None:
        self._heartbeat = time.monotonic()
        if self.metrics:
            self.metrics.last_pass.set(time.time())

    def stalled_for(self) -> float:
        """Seconds since the loop last made progress (a pass ended, or one deployment was handled): what
        the planner's liveness probe reads. A pass that fails still ends: only a hung loop stalls."""
        return time.monotonic() - self._heartbeat

    def _failed(self, stage: str, e: BaseException, deployment: str | None = None) -> None:
        kind = _error_kind(e)
        if self.metrics:
            self.metrics.errors.labels(stage=stage, error=kind).inc()
        record = {"event": "planner_error", "stage": stage, "error": kind, "message": str(e)[:2000]}
        if deployment:
            record["deployment"] = deployment
        if not getattr(e, "status", None):  # (an API answer needs no traceback; anything else may be a bug)
            record["traceback"] = traceback.format_exc(limit=8)
        log.error(json.dumps(record))

    # -- what there is to plan

    def _list(self) -> tuple[list[dict[str, Any]], set[str] | None]:
        """The deployments to plan or report, and where that list is complete: the namespaces listed (None:
        every namespace). A namespace whose list fails is left out of this pass, the others go on."""
        listed: set[str] | None = None
        if self.namespaces:
            items, listed = [], set()
            for ns in self.namespaces:
                try:
                    items += self.custom.list_namespaced_custom_object(
                        GROUP, VERSION, ns, PLURAL, _request_timeout=self.request_timeout)["items"]
                    listed.add(ns)
                except Exception as e:
                    self._failed("list", e, f"{ns}/*")
        else:
            items = self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL,
                                                           _request_timeout=self.request_timeout)["items"]
        # the planner sizes those with the planner enabled, and reports latency against spec.slo for
        # every deployment that has one
        return [o for o in items if (o.get("spec", {}).get("planner") or {}).get("enabled")
                or o.get("spec", {}).get("slo")], listed

    def _forget_departed(self, items: list[dict[str, Any]], listed: set[str] | None) -> None:
        """Free the memory and metrics of deployments gone from a complete listing; never on a failed one
        (a deployment that merely could not be listed keeps its cooldowns and history)."""
        present = {o["metadata"]["uid"] for o in items}
        names = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in items}
        for uid, state in list(self.state.items()):
            if uid in present or (listed is not None and state.namespace not in listed):
                continue
            del self.state[uid]
            # (a deployment deleted and made again under the same name keeps the series its new self writes)
            if self.metrics and (state.namespace, state.name) not in names:
                self.metrics.forget(state.namespace, state.name)
            log.info(json.dumps({"deployment": f"{state.namespace}/{state.name}", "uid": uid, "event": "forgotten"}))

    def _state(self, meta: dict[str, Any]) -> _State:
        return self.state.setdefault(meta["uid"], _State(meta["namespace"], meta["name"]))

    def _models(self, obj: dict[str, Any], spec: DisaggDeploymentSpec) -> tuple[RoleModels | None,
                                                                                 Unplannable | None]:
        """The performance models of the roles, or (None, why) when the model or GPU is not known."""
        profile = None
        if spec.planner.profile_ref:
            cm = self.core.read_namespaced_config_map(spec.planner.profile_ref.name, obj["metadata"]["namespace"],
                                                      _request_timeout=self.request_timeout)
            profile = perfmodel.Profile.from_dict(yaml.safe_load((cm.data or {})[perfmodel.PROFILE_KEY]))
        problem = unplannable(obj, spec, profile)
        if problem is not None:
            return None, problem
        name, gpu = resolve_model_name(spec, profile), resolve_gpu(obj, spec, profile)
        return RoleModels.from_spec(spec, name, gpu, profile), None

    def _say_unplannable(self, meta: dict[str, Any], state: _State, problem: Unplannable | None) -> None:
        if self.metrics:
            self.metrics.model_known.labels(namespace=meta["namespace"], deployment=meta["name"]).set(
                0 if problem else 1)
        if problem != state.unplannable:
            deployment = f'{meta["namespace"]}/{meta["name"]}'
            if problem:
                log.warning(json.dumps({"deployment": deployment, "event": "unplannable", "reason": problem.reason,
                                        "message": problem.message}))
            else:
                log.info(json.dumps({"deployment": deployment, "event": "plannable"}))
            state.unplannable = problem

    def plan_one(self, obj: dict[str, Any], now: float | None = None) -> Decision:
        """Observe, decide and apply for one deployment, now (the interval is the caller's business)."""
        now = self.clock() if now is None else now
        started = time.time_ns()
        meta = obj["metadata"]
        spec = DisaggDeploymentSpec.model_validate(obj["spec"])
        ready, rolling = readiness(obj)
        target = Target.from_spec(spec, ready=ready, rolling=rolling)
        state = self._state(meta)
        obs, window = self._observe(meta, spec, now)
        models, problem = self._models(obj, spec)
        self._say_unplannable(meta, state, problem)
        if spec.flex is not None:
            return self._plan_flex(obj, spec, target, state, obs, window, models, problem, now, started)
        if problem is not None and _readable(obs):
            # hold, in decide()'s own words, with what was observed; nothing is learnt from this interval
            held = Observation.unavailable(obs.time, problem.message, problem.reason)
            decision, _ = decide(held, target, state.memory, models, now)
            decision = replace(decision, inputs=obs.inputs())
        else:
            # (with the model unknown, decide() holds on the unreadable metrics before it reads a model;
            # the metrics' outage comes first in status, the model's problem after it)
            decision, state.memory = decide(obs, target, state.memory, models, now)
            if problem is not None:
                decision = replace(decision, message=f"{decision.message}; also {problem.message}")
        state.last = now
        self.executor.apply(obj, decision, target, slo.judge(obs, spec.slo, window))
        if self.tracer is not None:
            endpoint = self.endpoints.resolve(spec.planner.prometheus)
            self.tracer.record(meta, obs, decision, target, started, window_seconds=window,
                               prometheus=None if isinstance(endpoint, str) else endpoint.name)
        return decision

    def _plan_flex(self, obj: dict[str, Any], spec: DisaggDeploymentSpec, target: Target, state: _State,
                   obs: Observation, window: float, models: RoleModels | None, problem: Unplannable | None,
                   now: float, started: int) -> Decision:
        """plan_one for a deployment with a flex pool: :func:`decide_flex` on the pool as observed, carried
        out switch first (the executor), every switch remembered until its drain is seen over."""
        meta = obj["metadata"]
        pool = self.flex_pool(obj, spec, target, state, now)
        memory = state.flex or FlexMemory(state.memory)
        if problem is not None and _readable(obs):
            held = Observation.unavailable(obs.time, problem.message, problem.reason)
            fd, _ = decide_flex(held, pool.target, memory, models, now)
            fd = replace(fd, decision=replace(fd.decision, inputs=obs.inputs()))
        else:
            fd, state.flex = decide_flex(obs, pool.target, memory, models, now)
            state.memory = state.flex.planner
            if problem is not None:
                fd = replace(fd, message=f"{fd.message}; also {problem.message}")
        state.last = now
        decision = self._carry_out(obj, fd, pool, state, now, slo.judge(obs, spec.slo, window))
        if self.tracer is not None:
            endpoint = self.endpoints.resolve(spec.planner.prometheus)
            self.tracer.record(meta, obs, decision, pool.target.combined(), started, window_seconds=window,
                               prometheus=None if isinstance(endpoint, str) else endpoint.name)
        return decision

    def _carry_out(self, obj: dict[str, Any], fd: FlexDecision, pool: FlexPool, state: _State, now: float,
                   verdict: slo.Verdict | None = None) -> Decision:
        """Apply ``fd`` and remember its switches; the decision as plan_one returns it (its reason and
        message are the flex decision's: RoleSwitched, FlexPoolGrown, FlexPoolShrunk or decide's own)."""
        decision = replace(fd.decision, reason=fd.reason, message=fd.message)
        self.executor.apply(obj, decision, pool.target.dedicated, verdict, flex=(fd, pool), now=now)
        meta = obj["metadata"]
        for name, frm, to in fd.switches:
            if name not in pool.pods:   # a replica not created yet: it takes its role when it is
                continue
            previous = state.switching.pop(name, None)
            if previous is not None and previous.frm == to:   # asked back before its drain ended
                self._switch_outcome(meta, previous, m.SWITCH_CANCELLED)
            else:
                state.switching[name] = Switch(frm, to, time.monotonic(), pool.signals.flips(frm, to))
        state.last_flex = fd
        state.known = frozenset(pool.pods)
        adding = [role for name, role in fd.roles if name not in pool.pods] + list(fd.add)
        if not state.adding or state.adding_at is None:
            # (creation timestamps are whole seconds)
            state.adding_at = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
        state.adding = adding
        return decision

    def _switch_outcome(self, meta: dict[str, Any], switch: Switch, outcome: str) -> None:
        if self.metrics:
            self.metrics.role_switches.labels(namespace=meta["namespace"], deployment=meta["name"],
                                              from_role=switch.frm, to_role=switch.to, outcome=outcome).inc()

    def flex_pool(self, obj: dict[str, Any], spec: DisaggDeploymentSpec, target: Target, state: _State,
                  now: float) -> FlexPool:
        """The flex pool now, as :func:`decide_flex` takes it: each live flex pod a worker in the role its
        label gives it (starting while not ready, or while it has no role yet: it then counts in the role
        the operator will give it), switching while its routers still drain it for a switch the planner
        asked for; each replica its Deployment has yet to create, a starting worker."""
        meta = obj["metadata"]
        ns, name = meta["namespace"], meta["name"]
        flex = spec.flex
        pods = [p for p in self.core.list_namespaced_pod(
            ns, label_selector=f"{LABEL_DEPLOYMENT}={name},{LABEL_ROLE}={ROLE_FLEX}",
            _request_timeout=self.request_timeout).items if p.metadata.deletion_timestamp is None]
        # pods past spec.flex.replicas that the planner marked for removal: their ReplicaSet is removing them
        marked = [p for p in pods if (p.metadata.annotations or {}).get(ANNOTATION_POD_DELETION_COST) == REMOVE_COST]
        going = {p.metadata.name for p in marked[:max(len(pods) - flex.replicas, 0)]}
        # past spec.flex.replicas otherwise (a rollout's surge): the ready ones count, the rest wait their turn
        pods = sorted((p for p in pods if p.metadata.name not in going),
                      key=lambda p: (not _pod_ready(p), p.metadata.name))[:flex.replicas]
        pods.sort(key=lambda p: p.metadata.name)
        signals = self._flex_signals(meta, spec)
        self._settle_switches(meta, state, pods, signals, flex.switch_drain_seconds)
        serving = [(p.metadata.labels or {}).get(LABEL_SERVING_ROLE) for p in pods]
        serving = [r for r in serving if r in SERVING_ROLES]
        adding = list(state.adding)
        workers = []
        for p in sorted(pods, key=lambda p: (p.metadata.creation_timestamp is None, p.metadata.creation_timestamp,
                                             p.metadata.name)):
            labels, notes = p.metadata.labels or {}, p.metadata.annotations or {}
            role = labels.get(LABEL_SERVING_ROLE)
            if (adding and ANNOTATION_SERVING_ROLE_SINCE not in notes and p.metadata.name not in state.known
                    and state.adding_at is not None
                    and p.metadata.creation_timestamp is not None and p.metadata.creation_timestamp >= state.adding_at):
                # a pod the planner asked for whose role is not the planner's yet: the one it was asked for
                # (the executor labels it; a pod already serving the operator's pick drains it first)
                role = adding.pop(0)
                wstate = STARTING if not _pod_ready(p) or labels.get(LABEL_SERVING_ROLE) not in SERVING_ROLES \
                    else SWITCHING if labels.get(LABEL_SERVING_ROLE) != role else SERVING
            elif role not in SERVING_ROLES:
                role = initial_serving_role(serving)
                serving.append(role)
                wstate = STARTING
            elif p.metadata.name in state.switching:
                wstate = SWITCHING
            else:
                wstate = SERVING if _pod_ready(p) else STARTING
            workers.append(FlexWorker(p.metadata.name, role, wstate, _since(notes.get(ANNOTATION_SERVING_ROLE_SINCE)),
                                      (signals.load or {}).get(p.metadata.name, 0.0)))
        for i in range(max(flex.replicas - len(pods), 0)):
            role = adding.pop(0) if adding else initial_serving_role(serving)
            serving.append(role)
            workers.append(FlexWorker(f"(not created {i})", role, STARTING, now))
        workers.sort(key=lambda w: w.name)
        flex_max = flex.max_replicas if flex.max_replicas is not None else MAX_REPLICAS
        return FlexPool(FlexTarget(target, tuple(workers), flex.min_replicas or 0, max(flex_max, flex.min_replicas or 0)),
                        {p.metadata.name: p for p in pods}, signals, spec.flex.replicas)

    def _flex_signals(self, meta: dict[str, Any], spec: DisaggDeploymentSpec) -> FlexSignals:
        endpoint = self.endpoints.resolve(spec.planner.prometheus)
        if isinstance(endpoint, str):
            return FlexSignals(error=endpoint)
        observe_flex = getattr(self.source_for(endpoint), "observe_flex", None)
        if observe_flex is None:
            return FlexSignals(error="the metrics source reads no flex pool")
        return observe_flex(meta["namespace"], meta["name"])

    def _settle_switches(self, meta: dict[str, Any], state: _State, pods: list[Any], signals: FlexSignals,
                         bound: float) -> None:
        """Forget the switches that are over: once the routers flipped the worker (their
        ``disagg_router_role_switches_total`` that way rose since the label was written) and none still
        drains a worker out of the old role, counted ``switched`` (``abandoned`` where a router flipped
        past its drain's bound); ``abandoned`` too past the drain's bound with no flip seen (the routers
        flip anyway). The drain gauge alone does not say a switch is over: it reads 0 too before a router
        has seen the new label, and a scrape can land in that gap. Where the flips were not known when
        it was asked (Prometheus unreadable then), a drain seen over at least a scrape interval after the
        label was written ends it. A switch whose pod is gone or relabelled by someone else is dropped
        uncounted."""
        labels = {p.metadata.name: (p.metadata.labels or {}).get(LABEL_SERVING_ROLE) for p in pods}
        clock = time.monotonic()
        for name, sw in list(state.switching.items()):
            drained = (signals.draining is not None and sw.frm in signals.draining and not signals.draining[sw.frm])
            flips = signals.flips(sw.frm, sw.to)
            if labels.get(name) != sw.to:
                del state.switching[name]
            elif sw.flips is not None and flips is not None and sum(flips) > sum(sw.flips) and (
                    not (signals.draining or {}).get(sw.frm)):
                del state.switching[name]
                self._switch_outcome(meta, sw, m.SWITCH_ABANDONED if flips[1] > sw.flips[1] else m.SWITCH_SWITCHED)
            elif sw.flips is None and drained and clock - sw.asked >= self.scrape_interval:
                # (no drain series at all: no router says)
                del state.switching[name]
                self._switch_outcome(meta, sw, m.SWITCH_SWITCHED)
            elif clock - sw.asked > bound:
                del state.switching[name]
                self._switch_outcome(meta, sw, m.SWITCH_ABANDONED)

    def react_one(self, obj: dict[str, Any], now: float | None = None) -> Decision | None:
        """The fast path for one deployment between its decisions: read the queues, scale up if one grows
        faster than its replicas drain it (applied at once), else nothing. Only after a first decision
        (it sizes from that decision's memory) and only from a source that reads queues."""
        now = self.clock() if now is None else now
        started = time.time_ns()
        meta = obj["metadata"]
        state = self.state.get(meta["uid"])
        if state is None or state.last is None:
            return None
        state.last_fast = now
        spec = DisaggDeploymentSpec.model_validate(obj["spec"])
        if state.unplannable is not None:  # (the decisions say why; the next one looks again)
            return None
        endpoint = self.endpoints.resolve(spec.planner.prometheus)
        observe_queues = None if isinstance(endpoint, str) else getattr(self.source_for(endpoint), "observe_queues",
                                                                        None)
        if observe_queues is None:
            return None
        ready, rolling = readiness(obj)
        target = Target.from_spec(spec, ready=ready, rolling=rolling)
        obs = observe_queues(meta["namespace"], meta["name"], FAST_SCRAPES * self.scrape_interval)
        models, problem = self._models(obj, spec)
        if models is None:
            return None
        if spec.flex is not None:
            pool = self.flex_pool(obj, spec, target, state, now)
            fd, state.flex = react_flex(obs, pool.target, state.flex or FlexMemory(state.memory), models, now)
            state.memory = state.flex.planner
            if fd is None:
                return None
            log.info('{"deployment": "%s/%s", "fast_path": "%s"}', meta["namespace"], meta["name"], fd.message)
            decision = self._carry_out(obj, fd, pool, state, now)
            if self.tracer is not None:
                self.tracer.record(meta, obs, decision, pool.target.combined(), started, fast=True,
                                   prometheus=endpoint.name, window_seconds=FAST_SCRAPES * self.scrape_interval)
            return decision
        decision, state.memory = react(obs, target, state.memory, models, now)
        if decision is not None:  # (an unreadable Prometheus is left to the next decision to report)
            log.info('{"deployment": "%s/%s", "fast_path": "%s"}', meta["namespace"], meta["name"], decision.message)
            self.executor.apply(obj, decision, target)
            if self.tracer is not None:
                self.tracer.record(meta, obs, decision, target, started, fast=True, prometheus=endpoint.name,
                                   window_seconds=FAST_SCRAPES * self.scrape_interval)
        return decision

    def report_one(self, obj: dict[str, Any], now: float | None = None) -> slo.Verdict:
        """Latency and SLOMet for a deployment with spec.slo and no planner."""
        now = self.clock() if now is None else now
        spec = DisaggDeploymentSpec.model_validate(obj["spec"])
        obs, window = self._observe(obj["metadata"], spec, now)
        verdict = slo.judge(obs, spec.slo, window)
        self._state(obj["metadata"]).last = now
        if self.metrics:  # (planned once, then the planner switched off: its sizing series are stale)
            self.metrics.forget(obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.executor.report(obj, verdict)
        return verdict

    def _observe(self, meta: dict[str, Any], spec: DisaggDeploymentSpec, now: float) -> tuple[Observation, float]:
        """The last interval's observation from the deployment's Prometheus, and that window in seconds."""
        window = query_window(spec.planner.interval_seconds, self.scrape_interval)
        endpoint = self.endpoints.resolve(spec.planner.prometheus)
        if isinstance(endpoint, str):  # not allowed (or none): hold, and say which field to change
            return Observation.unavailable(now, endpoint, PROMETHEUS_NOT_ALLOWED), window
        return self.source_for(endpoint).observe(meta["namespace"], meta["name"], spec.slo.percentile, window), window

    def step(self, now: float | None = None) -> list[tuple[str, str, Decision | slo.Verdict]]:
        """One pass: plan every enabled deployment whose interval has passed (a Decision each), and report
        latency for those with spec.slo and no planner (a Verdict each)."""
        now = self.clock() if now is None else now
        done = []
        try:
            items, listed = self._list()
        except Exception as e:  # the API server's error or its silence: this pass is lost, no memory
            self._failed("list", e)
            self._beat()
            return done
        self._forget_departed(items, listed)
        for obj in items:
            self._beat()
            meta = obj["metadata"]
            state = self.state.get(meta["uid"])
            interval = (obj["spec"].get("planner") or {}).get("intervalSeconds", 30)
            if state and state.last is not None and now - state.last < interval:
                # between decisions: the fast path, every scrape interval (its reactions are not decisions)
                enabled = (obj["spec"].get("planner") or {}).get("enabled")
                if enabled and now - max(state.last, state.last_fast or state.last) >= self.scrape_interval:
                    try:
                        self.react_one(obj, now)
                    except Exception as e:
                        self._failed("fast_path", e, f'{meta["namespace"]}/{meta["name"]}')
                continue
            planned = bool((obj["spec"].get("planner") or {}).get("enabled"))
            try:
                if planned:
                    done.append((meta["namespace"], meta["name"], self.plan_one(obj, now)))
                else:
                    done.append((meta["namespace"], meta["name"], self.report_one(obj, now)))
            except Exception as e:  # one broken deployment must not stop the others
                self._failed("plan" if planned else "report", e, f'{meta["namespace"]}/{meta["name"]}')
        self._beat()
        return done

    def run(self, stop: threading.Event, tick: float = 1.0) -> None:
        while not stop.is_set():
            try:
                self.step()
            except Exception as e:  # a fault of the pass itself: the memory outlives it, the next pass runs
                self._failed("pass", e)
            stop.wait(tick)
