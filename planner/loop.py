"""The planner loop: every DisaggDeployment with ``spec.planner.enabled``, every ``intervalSeconds``.

observe (Prometheus) -> decide (pure) -> apply (executor). Clients are made once at
start-up and passed in; per-deployment memory (load history, online correction,
cooldown clocks) lives in the loop object, keyed by the deployment's UID.

Between decisions, every scrape interval, the fast path (:func:`disagg.planner.decide.react`) reads the
waiting queues and scales a role up at once when its queue grows faster than its replicas drain it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml

from disagg.api.names import GROUP
from disagg.api.v1alpha1 import PLURAL, VERSION, ConditionType, DisaggDeploymentSpec

from . import perfmodel, slo
from .apply import Executor
from .decide import Decision, Memory, Observation, RoleModels, Target, decide, react
from .endpoints import Allowlist, Endpoint
from .metrics_source import DEFAULT_SCRAPE_INTERVAL, FAST_SCRAPES, MetricsSource, query_window
from .reasons import PROMETHEUS_NOT_ALLOWED

log = logging.getLogger("disagg.planner")

DEFAULT_GPU = "H100-SXM"
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_ANNOTATION = f"{GROUP}/gpu"


def resolve_model_name(spec: DisaggDeploymentSpec) -> str:
    """The models.yaml entry for the deployment's model: the hf:// repo, else a case-insensitive name match."""
    known = perfmodel.known_models()
    source = spec.model.source
    candidates = [source[len("hf://"):]] if source.startswith("hf://") else []
    candidates.append(spec.model.name)
    for c in candidates:
        for k in known:
            if c.lower() == k.lower() or c.lower() == k.split("/")[-1].lower():
                return k
    return DEFAULT_MODEL


def resolve_gpu(obj: dict[str, Any], spec: DisaggDeploymentSpec) -> str:
    """From the ``serving.disagg.dev/gpu`` annotation, else the roles' ``nvidia.com/gpu.product`` selector."""
    known = perfmodel.known_gpus()
    hint = (obj["metadata"].get("annotations") or {}).get(GPU_ANNOTATION) or \
        spec.prefill.node_selector.get(GPU_PRODUCT_LABEL) or spec.decode.node_selector.get(GPU_PRODUCT_LABEL) or ""
    for k in known:
        if hint == k:
            return k
    for k in known:  # "NVIDIA-H100-80GB-HBM3" -> H100-SXM
        if k.split("-")[0].lower() in hint.lower():
            return k
    return DEFAULT_GPU


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def readiness(obj: dict[str, Any]) -> tuple[bool, bool]:
    """(ready, rolling out) from the operator's status."""
    status = obj.get("status") or {}
    ready = (condition(obj, ConditionType.READY) or {}).get("status") == "True"
    progressing = (condition(obj, ConditionType.PROGRESSING) or {}).get("status") == "True"
    stale = status.get("observedGeneration") not in (None, obj["metadata"].get("generation"))
    return ready, progressing or stale


@dataclass
class _State:
    memory: Memory = field(default_factory=Memory)
    last: float | None = None
    last_fast: float | None = None     # the fast path's last look at the queues


class PlannerLoop:
    def __init__(self, api_client: Any, executor: Executor, source_for: Callable[[Endpoint], MetricsSource],
                 endpoints: Allowlist | None = None, namespace: str | list[str] | None = None,
                 clock: Callable[[], float] = time.time, scrape_interval: float = DEFAULT_SCRAPE_INTERVAL):
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

    def _list(self) -> list[dict[str, Any]]:
        if self.namespaces:
            items = [o for ns in self.namespaces
                     for o in self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]]
        else:
            items = self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
        # the planner sizes those with the planner enabled, and reports latency against spec.slo for
        # every deployment that has one
        return [o for o in items if (o.get("spec", {}).get("planner") or {}).get("enabled")
                or o.get("spec", {}).get("slo")]

    def _models(self, obj: dict[str, Any], spec: DisaggDeploymentSpec) -> RoleModels:
        name, gpu = resolve_model_name(spec), resolve_gpu(obj, spec)
        profile = None
        if spec.planner.profile_ref:
            cm = self.core.read_namespaced_config_map(spec.planner.profile_ref.name, obj["metadata"]["namespace"])
            profile = perfmodel.Profile.from_dict(yaml.safe_load((cm.data or {})[perfmodel.PROFILE_KEY]))
        return RoleModels(perfmodel.PerfModel.analytic(name, gpu, spec.prefill.tensor_parallel_size, profile=profile),
                          perfmodel.PerfModel.analytic(name, gpu, spec.decode.tensor_parallel_size, profile=profile))

    def plan_one(self, obj: dict[str, Any], now: float | None = None) -> Decision:
        """Observe, decide and apply for one deployment, now (the interval is the caller's business)."""
        now = self.clock() if now is None else now
        meta = obj["metadata"]
        spec = DisaggDeploymentSpec.model_validate(obj["spec"])
        ready, rolling = readiness(obj)
        target = Target.from_spec(spec, ready=ready, rolling=rolling)
        state = self.state.setdefault(meta["uid"], _State())
        obs, window = self._observe(meta, spec, now)
        decision, state.memory = decide(obs, target, state.memory, self._models(obj, spec), now)
        state.last = now
        self.executor.apply(obj, decision, target, slo.judge(obs, spec.slo, window))
        return decision

    def react_one(self, obj: dict[str, Any], now: float | None = None) -> Decision | None:
        """The fast path for one deployment between its decisions: read the queues, scale up if one grows
        faster than its replicas drain it (applied at once), else nothing. Only after a first decision
        (it sizes from that decision's memory) and only from a source that reads queues."""
        now = self.clock() if now is None else now
        meta = obj["metadata"]
        state = self.state.get(meta["uid"])
        if state is None or state.last is None:
            return None
        state.last_fast = now
        spec = DisaggDeploymentSpec.model_validate(obj["spec"])
        endpoint = self.endpoints.resolve(spec.planner.prometheus)
        observe_queues = None if isinstance(endpoint, str) else getattr(self.source_for(endpoint), "observe_queues",
                                                                        None)
        if observe_queues is None:
            return None
        ready, rolling = readiness(obj)
        target = Target.from_spec(spec, ready=ready, rolling=rolling)
        obs = observe_queues(meta["namespace"], meta["name"], FAST_SCRAPES * self.scrape_interval)
        decision, state.memory = react(obs, target, state.memory, self._models(obj, spec), now)
        if decision is not None:  # (an unreadable Prometheus is left to the next decision to report)
            log.info('{"deployment": "%s/%s", "fast_path": "%s"}', meta["namespace"], meta["name"], decision.message)
            self.executor.apply(obj, decision, target)
        return decision

    def report_one(self, obj: dict[str, Any], now: float | None = None) -> slo.Verdict:
        """Latency and SLOMet for a deployment with spec.slo and no planner."""
        now = self.clock() if now is None else now
        spec = DisaggDeploymentSpec.model_validate(obj["spec"])
        obs, window = self._observe(obj["metadata"], spec, now)
        verdict = slo.judge(obs, spec.slo, window)
        self.state.setdefault(obj["metadata"]["uid"], _State()).last = now
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
        for obj in self._list():
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
                        log.exception('{"deployment": "%s/%s", "error": "%s"}', meta["namespace"], meta["name"], e)
                continue
            try:
                if (obj["spec"].get("planner") or {}).get("enabled"):
                    done.append((meta["namespace"], meta["name"], self.plan_one(obj, now)))
                else:
                    done.append((meta["namespace"], meta["name"], self.report_one(obj, now)))
            except Exception as e:  # one broken deployment must not stop the others
                log.exception('{"deployment": "%s/%s", "error": "%s"}', meta["namespace"], meta["name"], e)
        return done

    def run(self, stop: threading.Event, tick: float = 1.0) -> None:
        while not stop.is_set():
            self.step()
            stop.wait(tick)
