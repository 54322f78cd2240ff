"""Discrete-event simulator of one P/D deployment, driven by a trace, resized by a policy.

What it models (latencies from :mod:`disagg.perf.model`, optionally a
``reality`` factor slower than the model the planner plans with):

* arrivals from a :class:`~disagg.simulator.traces.Trace`; the router holds one FIFO queue per
  role and hands work to ready replicas as they free up (so a new replica takes load at once);
* prefill: batches of up to ``max_batch_tokens`` (per data-parallel rank) from the queue; cached
  prefix blocks (a shared LRU sized by the prefill replicas' KV capacity, as a
  KV-aware router sees it) are not recomputed;
* KV transfer to decode (bytes over the interconnect);
* decode: continuous batching per replica (step time from the model for the batch
  and its context), admission bounded by KV memory and ``max_num_seqs`` (per data-parallel rank);
* replicas start ``startup`` seconds after they are asked for; removed ones drain;
* flex workers (``flex_max`` > 0, a policy with ``plan_flex``, or switches at set times, ``flex_switches``;
  :mod:`disagg.planner.flex`): replicas of the
  one shape both roles share that serve one role at a time. A switch drains the old role (no new work; a
  prefill's batch finishes and the KV blocks it holds for decodes wait until a decode admits the request, or
  until their lease, ``kv_lease``, expires, which it does only while no decode serves to extend it: then
  the decode that takes the request prefills the prompt itself, as the router's ``kv_transfer_failed``
  fallback does), then flips in ``switch_flip`` seconds (no weight reload:
  ``kv_both``); a drain past ``switch_drain_limit`` is given up and the worker serves its old role again.

Every ``interval`` the policy sees an :class:`~disagg.planner.decide.Observation`
built from the last interval (the same snapshot a metrics source gives) and
returns replica counts. The planner policy runs :func:`disagg.planner.decide.decide`
unchanged. TTFT is arrival to the first token out of decode; ITL is a request's
mean time between its output tokens.

The observation also carries what Prometheus gives the real planner about capacity: each role's replicas
serving, and, for a role whose queue never emptied over the interval with the same replicas serving, what
each replica did (uncached prompt tokens/s; output tokens/s and requests decoding). Between decisions, every
``fast_check`` seconds, a policy with a ``react`` method (the planner's fast path) sees the queues and their
growth since the last look.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from disagg.perf import serving
from disagg.perf.model import PerfModel, lora_step_factor
from disagg.api.parallelism import Layout
from disagg.perf.parallel import group_startup, role_engine
from disagg.planner.decide import (HISTORY, Decision, Load, Memory, Observation, RoleModels, Target, decide, react,
                                   size_decode, size_prefill)
from disagg.planner.flex import (SERVING, STARTING, SWITCHING, FlexDecision, FlexMemory, FlexTarget, FlexWorker,
                                 decide_flex, react_flex)

from .traces import BLOCK_TOKENS, Trace


@dataclass(frozen=True)
class SimConfig:
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    gpu: str = "H100-SXM"
    prefill_tp: int = 1
    decode_tp: int = 1
    link: str = "infiniband-ndr"
    ttft_target: float = 2.0           # seconds
    itl_target: float = 0.05           # seconds
    percentile: float = 90.0
    interval: float = 30.0
    cooldown: float = 300.0
    startup: float = 90.0              # seconds from asking for a replica to it serving
    prefill_min: int = 1
    decode_min: int = 1
    prefill_max: int = 64
    decode_max: int = 64
    gpu_budget: int | None = None
    initial_prefill: int = 1
    initial_decode: int = 1
    predictor: str = "moving-average"
    max_batch_tokens: int = 16384
    max_num_seqs: int = 256
    reality: float = 1.0               # true latency / planning model's latency
    metrics_outages: tuple[tuple[float, float], ...] = ()  # [start, end) with no metrics
    drain_limit: float = 900.0         # stop this long after the last arrival
    # between decisions, a policy that reacts to queue growth (the planner's fast path) sees the queues this
    # often (the metrics' scrape interval: a real planner cannot see them sooner); 0: never
    fast_check: float = 15.0
    # a replica as a group of pods (a multi-node layout): pods per replica of each role, and how much later
    # than the first the last pod of a group is ready (image pull, weights); the group serves when its
    # slowest pod does (disagg.perf.parallel.group_startup) and is added, counted and removed whole
    prefill_pods: int = 1
    decode_pods: int = 1
    pod_startup_spread: float = 0.0
    # data-parallel ranks of a replica (above 1: data-parallel attention with expert parallel, a
    # mixture-of-experts model's wide-EP layout, priced by disagg.perf.parallel's terms; each rank of
    # prefill_tp / decode_tp GPUs), and the NVLink domain its all-to-all stays inside (0: a pod)
    prefill_data: int = 1
    decode_data: int = 1
    nvlink_domain: int = 0
    # flex workers (one engine, kv_both, either role; the prefill and decode layouts must be one shape): the
    # pool's bounds, how many start in each role, a switch's flip once drained (the router sees the new role
    # label), the bound after which a drain is given up, and how long a prefill holds KV blocks for a decode
    # that has not pulled them: NixlConnector's lease (kv_connector_extra_config kv_lease_duration, 30 s in
    # vLLM 0.32), which the decode whose queue the request waits in extends by heartbeats; so it runs out
    # only while no decode serves
    flex_min: int = 0
    flex_max: int = 0
    flex_spare: int = 0                # flex workers kept beyond both roles' need (FlexTarget.spare)
    initial_flex_prefill: int = 0
    initial_flex_decode: int = 0
    switch_flip: float = 1.0
    switch_drain_limit: float = 120.0
    kv_lease: float = 30.0
    # role switches at set times, whatever the policy: (time, role), the first flex worker neither serving nor
    # switching to ``role`` switches to it then (bench/sim_vs_real.py --flex replays the switch it wrote to the
    # real router's roles file at that moment; a policy's own switches come through plan_flex/react_flex)
    flex_switches: tuple[tuple[float, str], ...] = ()

    def with_flex(self, flex_max: int = 64, flex_min: int = 0, spare: int = 0) -> SimConfig:
        """The same deployment with a flex pool: the dedicated pools start at their floors and the rest of the
        initial size starts as flex workers in those roles."""
        fp, fd = max(self.prefill_min, 1), max(self.decode_min, 1)
        return replace(self, flex_min=flex_min, flex_max=flex_max, flex_spare=spare,
                       initial_prefill=min(self.initial_prefill, fp), initial_decode=min(self.initial_decode, fd),
                       initial_flex_prefill=max(self.initial_prefill - fp, 0),
                       initial_flex_decode=max(self.initial_decode - fd, 0))

    @property
    def flex(self) -> bool:
        return self.flex_max > 0 or self.initial_flex_prefill > 0 or self.initial_flex_decode > 0
    # LoRA adapters: each adapter's share of the requests (the rest ask for the base model), given to the
    # trace's requests at random (seeded), and the engines' adapter slots (spec.model.maxLoras). A step runs
    # perf.model.lora_step_factor slower per distinct adapter in its batch (at most max_loras of them)
    adapter_mix: tuple[float, ...] = ()
    max_loras: int = 4
    adapter_seed: int = 0

    def layout(self, role: str) -> Layout:
        """One replica's layout of ``role`` (disagg.api.parallelism)."""
        tp, data, pods = ((self.prefill_tp, self.prefill_data, self.prefill_pods) if role == "prefill"
                          else (self.decode_tp, self.decode_data, self.decode_pods))
        return Layout(tensor=tp, data=data, expert=data > 1, pods=pods)

    def group_startup(self, role: str) -> float:
        """Seconds from asking for a replica of ``role`` to it serving: its slowest pod's start-up."""
        pods = self.prefill_pods if role == "prefill" else self.decode_pods
        spread = self.pod_startup_spread if pods > 1 else 0.0
        return group_startup([self.startup + spread * i / max(pods - 1, 1) for i in range(pods)])

    def target(self, prefill: int, decode: int, ready: bool = True) -> Target:
        return Target(prefill=prefill, decode=decode, ttft_target=self.ttft_target, itl_target=self.itl_target,
                      percentile=self.percentile, prefill_tp=self.prefill_tp, decode_tp=self.decode_tp,
                      prefill_gpus=self.layout("prefill").gpus_per_replica,
                      decode_gpus=self.layout("decode").gpus_per_replica,
                      prefill_min=self.prefill_min, decode_min=self.decode_min, prefill_max=self.prefill_max,
                      decode_max=self.decode_max, gpu_budget=self.gpu_budget, interval=self.interval,
                      cooldown=self.cooldown, startup=max(self.group_startup("prefill"), self.group_startup("decode")),
                      predictor=self.predictor, ready=ready)

    def planning_models(self) -> tuple[PerfModel, PerfModel]:
        """Each role's model (:func:`disagg.perf.parallel.role_engine`, the planner's way): one engine of
        its tensor size, or a data-parallel expert-parallel replica with the multi-node terms."""
        return tuple(role_engine(self.model, self.gpu, self.layout(role), self.link, nvlink_domain=self.nvlink_domain)
                     for role in ("prefill", "decode"))


# ---------------------------------------------------------------- policies

class Policy(Protocol):
    name: str

    def plan(self, obs: Observation, target: Target, now: float) -> tuple[int, int]: ...


class PlannerPolicy:
    """The SLO planner: :func:`decide` with its memory, exactly as the loop runs it."""

    name = "planner"

    def __init__(self, config: SimConfig, season_intervals: int = 0):
        # decide() sizes both roles from one model; prefill and decode TP differ only in tp
        self.prefill_model, self.decode_model = config.planning_models()
        self.memory = Memory()
        self.season = season_intervals
        self.decisions: list[Decision] = []
        self.reactions: list[tuple[float, Decision]] = []

    def plan(self, obs: Observation, target: Target, now: float) -> tuple[int, int]:
        d, self.memory = decide(obs, target, self.memory, RoleModels(self.prefill_model, self.decode_model), now,
                                self.season)
        self.decisions.append(d)
        return d.prefill.replicas, d.decode.replicas

    def react(self, obs: Observation, target: Target, now: float) -> tuple[int, int] | None:
        """The fast path between decisions (:func:`react`): new sizes, or None."""
        d, self.memory = react(obs, target, self.memory, RoleModels(self.prefill_model, self.decode_model), now)
        if d is None:
            return None
        self.reactions.append((now, d))
        return d.prefill.replicas, d.decode.replicas


class FlexPlannerPolicy:
    """The SLO planner with a flex pool (:func:`disagg.planner.flex.decide_flex`): :func:`decide` unchanged on the
    role totals, then switch flex workers before scaling, grow the pool when neither role has one to spare,
    shrink it when both are idle. Needs a config with flex workers (``SimConfig.with_flex``)."""

    name = "planner-flex"

    def __init__(self, config: SimConfig, season_intervals: int = 0):
        if not config.flex:
            raise ValueError("planner-flex needs flex workers: SimConfig.with_flex()")
        self.prefill_model, self.decode_model = config.planning_models()
        self.memory = FlexMemory()
        self.season = season_intervals
        self.decisions: list[Decision] = []           # decide's decisions, with the flex decision's reason
        self.flex_decisions: list[FlexDecision] = []
        self.reactions: list[tuple[float, FlexDecision]] = []

    def _models(self) -> RoleModels:
        return RoleModels(self.prefill_model, self.decode_model)

    def plan(self, obs: Observation, target: Target, now: float) -> tuple[int, int]:
        raise TypeError("planner-flex plans with plan_flex")

    def plan_flex(self, obs: Observation, target: FlexTarget, now: float) -> FlexDecision:
        fd, self.memory = decide_flex(obs, target, self.memory, self._models(), now, self.season)
        self.flex_decisions.append(fd)
        self.decisions.append(replace(fd.decision, reason=fd.reason, message=fd.message))
        return fd

    def react_flex(self, obs: Observation, target: FlexTarget, now: float) -> FlexDecision | None:
        fd, self.memory = react_flex(obs, target, self.memory, self._models(), now)
        if fd is not None:
            self.reactions.append((now, fd))
        return fd


class StaticPolicy:
    """A fixed size (for example sized for the trace's peak)."""

    name = "static"

    def __init__(self, prefill: int, decode: int, name: str = "static"):
        self.size = (prefill, decode)
        self.name = name

    def plan(self, obs: Observation, target: Target, now: float) -> tuple[int, int]:
        return self.size


def static_peak(config: SimConfig, trace: Trace) -> StaticPolicy:
    """Sized with the performance model for the busiest interval of the trace (no prefix hits assumed)."""
    pm, dm = config.planning_models()
    buckets: dict[int, list] = {}
    for r in trace.requests:
        buckets.setdefault(int(r.t // config.interval), []).append(r)
    p = d = 1
    for reqs in buckets.values():
        ins = sorted(r.input_tokens for r in reqs)
        load = Load(len(reqs) / config.interval, sum(ins) / len(ins), _pct(ins, config.percentile),
                    sum(r.output_tokens for r in reqs) / len(reqs))
        p = max(p, size_prefill(pm, load, config.ttft_target, config.percentile, config.prefill_max)[0])
        d = max(d, size_decode(dm, load, config.itl_target, config.percentile, config.decode_max)[0])
    p, d = max(p, config.prefill_min), max(d, config.decode_min)
    return StaticPolicy(p, d, "static-peak")


class ReactivePolicy:
    """What KEDA setups do: each role on its own, replicas = ceil(queue metric / target per replica),
    scale-up at once, scale-down stabilised over a window (HPA's default 300 s)."""

    name = "reactive"

    def __init__(self, prefill_queue_per_replica: float = 2.0, decode_running_per_replica: float = 32.0,
                 stabilization: float = 300.0):
        self.targets = (prefill_queue_per_replica, decode_running_per_replica)
        self.stabilization = stabilization
        self.history: deque[tuple[float, int, int]] = deque()

    def plan(self, obs: Observation, target: Target, now: float) -> tuple[int, int]:
        if obs.error or obs.prefill_queue is None or obs.decode_queue is None:
            return target.prefill, target.decode
        pq = obs.prefill_queue + (obs.prefill_running or 0.0)
        dq = obs.decode_queue + (obs.decode_running or 0.0)
        p = min(max(math.ceil(pq / self.targets[0]), target.floor_prefill), target.prefill_max)
        d = min(max(math.ceil(dq / self.targets[1]), target.floor_decode), target.decode_max)
        self.history.append((now, p, d))
        while self.history and self.history[0][0] < now - self.stabilization:
            self.history.popleft()
        return max(h[1] for h in self.history), max(h[2] for h in self.history)


# ---------------------------------------------------------------- the simulation

class DynamoPolicy:
    """A throughput-based planner modelled on NVIDIA Dynamo's SLA planner (its published design,
    ``docs/design_docs/planner_design.md``), for comparison. Every interval:

    * corrections: prefill = mean TTFT / the profile's TTFT of one prompt of the mean length; decode = mean
      ITL / the profile's ITL at the observed concurrency per decode replica (requests x mean request
      duration / interval / replicas) and context (ISL + OSL / 2);
    * load: the next interval's request count, mean ISL and mean OSL from a predictor;
    * prefill = ceil(requests x ISL / interval x min(1, prefill correction) / the profile's prefill
      throughput per GPU at that ISL (ISL / TTFT of one prompt) / GPUs per replica);
    * decode = ceil(requests x OSL / interval / the best decode throughput per GPU whose ITL meets
      target / decode correction at that context (KV cache permitting) / GPUs per replica);
    * at least one replica each; set directly (no cooldown, no hysteresis), scaled to the GPU budget.

    Its "profile" is the same performance model the planner starts from (the data sheet), so neither is
    told when the hardware is slower or faster than that. Means, not percentiles: that is Dynamo's design.
    """

    name = "dynamo"

    def __init__(self, config: SimConfig, predictor: str | None = None, season_intervals: int = 0):
        self.prefill_model, self.decode_model = config.planning_models()
        self.predictor = predictor or config.predictor
        self.season = season_intervals
        self.history: dict[str, list[float]] = {"rate": [], "isl": [], "osl": []}
        self.p_correction = self.d_correction = 1.0

    def _next(self, key: str) -> float:
        from disagg.planner.predictors import get as get_predictor

        params = {"season": self.season} if self.predictor == "holt-winters" else {}
        return get_predictor(self.predictor, **params).predict(self.history[key][-HISTORY:])

    def _decode_throughput_per_gpu(self, itl: float, isl: float, osl: float) -> float:
        """Tokens/s per GPU at the largest concurrency whose ITL meets ``itl`` and whose KV cache fits."""
        dm, ctx = self.decode_model, isl + osl / 2.0
        batch = max(min(dm.max_concurrency_for_itl(itl, ctx), dm.max_concurrency(isl + osl)), 1)
        return batch / dm.itl(batch, ctx) / dm.gpus

    def plan(self, obs: Observation, target: Target, now: float) -> tuple[int, int]:
        if (obs.error or not obs.request_rate or obs.input_tokens_mean is None
                or obs.output_tokens_mean is None):
            return target.prefill, target.decode   # no traffic or no metrics: Dynamo skips the adjustment
        isl, osl = obs.input_tokens_mean, obs.output_tokens_mean
        if obs.ttft_mean is not None and obs.itl_mean is not None and obs.request_seconds_mean is not None:
            self.p_correction = obs.ttft_mean / max(self.prefill_model.ttft(isl), 1e-9)
            concurrency = obs.request_rate * obs.request_seconds_mean / max(target.decode, 1)
            self.d_correction = obs.itl_mean / max(self.decode_model.itl(max(concurrency, 1.0), isl + osl / 2.0),
                                                   1e-9)
        self.history["rate"].append(obs.request_rate)
        self.history["isl"].append(isl)
        self.history["osl"].append(osl)
        rate, isl_n, osl_n = self._next("rate"), max(self._next("isl"), 1.0), max(self._next("osl"), 1.0)
        pm = self.prefill_model
        p_tput = isl_n * pm.servers / max(pm.ttft(isl_n), 1e-9) / pm.gpus   # prompt tokens/s per GPU
        p = math.ceil(rate * isl_n * min(1.0, self.p_correction) / p_tput / pm.gpus - 1e-9)
        itl = target.itl_target / self.d_correction if self.d_correction > 0 else target.itl_target
        d_tput = self._decode_throughput_per_gpu(itl, isl_n, osl_n)
        d = math.ceil(rate * osl_n / d_tput / self.decode_model.gpus - 1e-9)
        p = min(max(p, target.floor_prefill), target.prefill_max)
        d = min(max(d, target.floor_decode), target.decode_max)
        if target.gpu_budget is not None and target.gpus(p, d) > target.gpu_budget:
            scale = target.gpu_budget / target.gpus(p, d)
            p = max(target.floor_prefill, round(p * scale))
            gp, gd = target.replica_gpus
            d = max(target.floor_decode, (target.gpu_budget - p * gp) // gd)
        return p, d


class _Req:
    __slots__ = ("r", "cached", "admit", "first", "finish", "remaining", "ctx", "reserve", "src", "kv_lost")

    def __init__(self, r):
        self.r = r
        self.src = None          # the flex prefill worker holding its KV blocks until a decode admits it
        self.kv_lost = False     # the blocks' lease expired first: the decode prefills it itself
        self.cached = 0
        self.admit = self.first = self.finish = math.nan
        self.remaining = float(r.output_tokens)
        self.ctx = float(r.input_tokens)
        self.reserve = r.input_tokens + r.output_tokens


@dataclass
class _Replica:
    id: int
    role: str
    start: float
    ready_at: float
    draining: bool = False
    end: float | None = None
    busy: bool = False
    running: int = 0                  # prefill: prompts in the batch being computed
    active: list = field(default_factory=list)
    last: float = 0.0
    step: float = 0.0
    version: int = 0
    reserved: float = 0.0
    # flex workers: ``role`` is the role it serves (the list it is in); ``switching`` the role it drains
    # towards, ``held`` the requests whose KV blocks it holds for a decode, ``since`` when it took its role
    flex: bool = False
    switching: str | None = None
    switch_start: float = 0.0
    switch_seq: int = 0
    held: int = 0
    since: float = 0.0

    def ready(self, now: float) -> bool:
        return self.ready_at <= now and not self.draining and self.end is None and self.switching is None


@dataclass
class Interval:
    t: float
    prefill: int
    decode: int
    gpus: int
    request_rate: float
    ttft_p: float | None
    itl_p: float | None
    attainment: float | None   # of the requests finished in the interval
    reason: str = ""
    # what the planner sized for and what waited (the bench's per-interval trace: why a row misses)
    sized_rate: float | None = None
    prefill_queue: float = 0.0
    decode_queue: float = 0.0
    ready_prefill: int = 0
    ready_decode: int = 0
    flex: int = 0              # flex workers (counted in prefill and decode by their role)
    switches: int = 0          # role switches asked for at this decision


@dataclass
class SimResult:
    policy: str
    trace: str
    config: SimConfig
    intervals: list[Interval]
    ttft: list[float]
    itl: list[float]
    finished: int
    arrived: int
    met: int
    duration: float
    gpu_seconds: float
    switches: int = 0                                          # role switches begun (flex workers)
    switch_drains: list[float] = field(default_factory=list)   # seconds from asked to serving the new role
    switches_abandoned: int = 0                                # drains past switch_drain_limit, given up
    kv_leases_expired: int = 0                                 # KV blocks a switching prefill let go unpulled

    @property
    def attainment(self) -> float:
        return self.met / self.arrived if self.arrived else 1.0

    @property
    def goodput(self) -> float:
        """Requests per second served within both targets."""
        return self.met / self.duration if self.duration else 0.0

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600.0

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy, "trace": self.trace, "requests": self.arrived, "finished": self.finished,
                "slo_attainment": round(self.attainment, 4), "goodput_rps": round(self.goodput, 4),
                "gpu_hours": round(self.gpu_hours, 3),
                "goodput_per_gpu_hour": round(self.met / self.gpu_hours, 2) if self.gpu_seconds else 0.0,
                # share of arrived requests inside each target on its own
                "ttft_attainment": round(sum(v <= self.config.ttft_target for v in self.ttft) / self.arrived, 4)
                if self.arrived else 1.0,
                "itl_attainment": round(sum(v <= self.config.itl_target for v in self.itl) / self.arrived, 4)
                if self.arrived else 1.0,
                "ttft_p_s": _round(_pct(self.ttft, self.config.percentile)),
                "itl_p_s": _round(_pct(self.itl, self.config.percentile)),
                "max_prefill": max((i.prefill for i in self.intervals), default=0),
                "max_decode": max((i.decode for i in self.intervals), default=0),
                "max_flex": max((i.flex for i in self.intervals), default=0),
                "role_switches": self.switches, "switches_abandoned": self.switches_abandoned,
                "switch_drain_p90_s": _round(_pct(self.switch_drains, 90.0))}

    def write(self, directory: str | Path, plot: bool = True, name: str | None = None) -> dict[str, Path]:
        """``<name or trace>-<policy>``.csv (per interval), .json (summary) and .png under ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        stem = f"{name or self.trace}-{self.policy}"
        paths = {"intervals": d / f"{stem}.csv", "summary": d / f"{stem}.json"}
        with paths["intervals"].open("w") as f:
            cols = list(asdict(self.intervals[0]).keys()) if self.intervals else []
            f.write(",".join(cols) + "\n")
            for i in self.intervals:
                f.write(",".join("" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))
                                 for v in asdict(i).values()) + "\n")
        paths["summary"].write_text(json.dumps(self.summary(), indent=2) + "\n")
        if plot:
            paths["plot"] = d / f"{stem}.png"
            plot_results([self], paths["plot"])
        return paths


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def with_adapters(trace: Trace, mix: tuple[float, ...], seed: int = 0) -> Trace:
    """``trace`` with each request given an adapter (``lora-<i>``) with probability ``mix[i]``, else none."""
    if not mix:
        return trace
    import random

    if any(p < 0 for p in mix) or sum(mix) > 1 + 1e-9:
        raise ValueError(f"adapter_mix: shares must be >= 0 and sum to at most 1: {mix}")
    rng = random.Random(seed)
    names = [f"lora-{i}" for i in range(len(mix))]

    def pick() -> str:
        u, acc = rng.random(), 0.0
        for name, p in zip(names, mix):
            acc += p
            if u < acc:
                return name
        return ""
    return replace(trace, requests=tuple(replace(r, adapter=pick()) for r in trace.requests))


class Simulation:
    def __init__(self, config: SimConfig, trace: Trace, policy: Policy):
        self.cfg = config
        self.trace = with_adapters(trace, config.adapter_mix, config.adapter_seed)
        self.policy = policy
        pm, dm = config.planning_models()
        self.prefill_model = pm.corrected(config.reality, config.reality)
        self.decode_model = dm.corrected(config.reality, config.reality)
        self.events: list = []
        self.seq = itertools.count()
        self.replicas: dict[str, list[_Replica]] = {"prefill": [], "decode": []}
        self.ids = itertools.count()
        self.cache: OrderedDict = OrderedDict()
        self.prefill_queue: deque[_Req] = deque()
        self.decode_queue: deque[_Req] = deque()
        # when each hand-off lane is next free: one lane per serving decode replica (its frontend takes
        # in one request and one KV transfer at a time; a burst's hand-offs queue, they do not overlap)
        self.handoff_free: list[float] = []
        self.now = 0.0
        # per-interval accumulators
        self._acc_arrivals: list = []
        self._acc_ttft: list[float] = []
        self._acc_itl: list[float] = []
        self._acc_met = 0
        self._acc_done = 0
        self._acc_seconds = 0.0
        self._acc_prompt = 0
        self._acc_cached = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.met = 0
        self.finished = 0
        self.intervals: list[Interval] = []
        # what the saturation measurement reads (per interval): did the role's queue ever empty, how many
        # replicas served at its start, the work its ready replicas did (uncached prompt tokens; output
        # tokens and request-seconds decoding)
        self._emptied = {"prefill": True, "decode": True}
        self._ready_start = {"prefill": 0, "decode": 0}
        self._acc_prefill_tokens = 0.0
        self._acc_decode_tokens = 0.0
        self._acc_decode_batch_s = 0.0
        self._last_queues = (0.0, 0.0, 0.0)   # (time, prefill queue, decode queue) at the last look
        if config.flex and config.layout("prefill") != config.layout("decode"):
            raise ValueError(f"flex workers serve both roles, so both roles need one shape: prefill "
                             f"{config.layout('prefill')} != decode {config.layout('decode')}")
        self.switches = 0
        self.switch_drains: list[float] = []
        self.switches_abandoned = 0
        self.kv_leases_expired = 0

    # -- plumbing
    def _at(self, t: float, kind: str, *payload) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def _add(self, role: str, now: float, delay: float, flex: bool = False) -> _Replica:
        r = _Replica(next(self.ids), role, start=now, ready_at=now + delay, last=now, flex=flex, since=now)
        self.replicas[role].append(r)
        self._at(r.ready_at, "ready", r)
        return r

    def _live(self, role: str) -> list[_Replica]:
        return [r for r in self.replicas[role] if r.end is None and not r.draining]

    def _scale(self, role: str, n: int, now: float) -> None:
        live = [r for r in self._live(role) if not r.flex]   # the dedicated replicas
        for _ in range(n - len(live)):
            self._add(role, now, self.cfg.group_startup(role))
        if n < len(live):
            # remove replicas still starting first, then the least loaded ready ones
            victims = sorted(live, key=lambda r: (r.ready_at <= now, len(r.active) + r.busy))
            for r in victims[:len(live) - n]:
                r.draining = True
                self._maybe_retire(r, now)

    def _maybe_retire(self, r: _Replica, now: float) -> None:
        if r.draining and r.end is None and not r.active and not r.busy and not r.held:
            r.end = now
        elif r.switching is not None and not r.draining and not r.active and not r.busy and not r.held:
            self._flip(r, now)

    # -- flex workers
    def _flex_workers(self, now: float) -> tuple[FlexWorker, ...]:
        out = []
        for role in ("prefill", "decode"):
            for r in self._live(role):
                if not r.flex:
                    continue
                state = SWITCHING if r.switching else STARTING if r.ready_at > now else SERVING
                out.append(FlexWorker(str(r.id), r.switching or r.role, state,
                                      r.switch_start if r.switching else r.since,
                                      float(len(r.active) + r.running + r.held)))
        return tuple(out)

    def _switch(self, r: _Replica, to: str, now: float) -> None:
        """Stop sending ``r`` its role's work; it flips once what it has in flight and the KV blocks it holds
        for decodes are gone (``_maybe_retire``), or goes back to its role after ``switch_drain_limit``."""
        if r.switching is not None and to == r.role:     # switching away, asked back: it serves on at once
            r.switching = None
            self._kick(r, now)
            return
        if to == r.role:
            return
        self.switches += 1
        if r.ready_at > now:                             # still starting: it drains nothing
            self.switch_drains.append(0.0)
            self._move(r, to, now)
            return
        r.switching, r.switch_start = to, now
        r.switch_seq += 1
        self._at(now + self.cfg.switch_drain_limit, "switch_limit", r, r.switch_seq)
        self._maybe_retire(r, now)

    def _move(self, r: _Replica, to: str, now: float) -> None:
        self.replicas[r.role].remove(r)
        r.role, r.since = to, now
        self.replicas[to].append(r)

    def _flip(self, r: _Replica, now: float) -> None:
        to = r.switching
        r.switching = None
        self.switch_drains.append(now - r.switch_start + self.cfg.switch_flip)
        self._move(r, to, now)
        r.ready_at = now + self.cfg.switch_flip
        r.running, r.busy, r.step, r.last = 0, False, 0.0, now
        self._at(r.ready_at, "ready", r)

    def _switch_limit(self, r: _Replica, seq: int, now: float) -> None:
        if r.switching is not None and r.switch_seq == seq and r.end is None:
            r.switching = None                        # given up: it serves its old role again
            self.switches_abandoned += 1
            self._kick(r, now)

    def _kick(self, r: _Replica, now: float) -> None:
        if r.role == "prefill":
            self._start_prefill(r, now)
        else:
            self._decode_update(r, now)

    def _release(self, req: _Req, now: float) -> None:
        """A decode admitted ``req``: the flex prefill worker that held its KV blocks lets them go."""
        src, req.src = req.src, None
        if src is not None:
            src.held -= 1
            self._maybe_retire(src, now)

    def _lease(self, req: _Req, now: float) -> None:
        if req.src is None or not math.isnan(req.admit):
            return
        if any(r.ready(now) for r in self.replicas["decode"]):
            # waiting in a serving decode's queue: that decode's heartbeats extend the lease
            self._at(now + self.cfg.kv_lease, "lease", req)
            return
        req.kv_lost = True
        self.kv_leases_expired += 1
        self._release(req, now)

    def _scheduled_switch(self, to: str, now: float) -> None:
        other = "decode" if to == "prefill" else "prefill"
        r = next((r for r in self._live(other) if r.flex and r.switching is None), None)
        if r is not None:
            self._switch(r, to, now)

    def _apply_flex(self, fd: FlexDecision, now: float) -> None:
        by_name = {str(r.id): r for role in ("prefill", "decode") for r in self._live(role) if r.flex}
        for name in fd.remove:
            r = by_name[name]
            r.switching = None
            r.draining = True
            self._maybe_retire(r, now)
        for name, _frm, to in fd.switches:
            self._switch(by_name[name], to, now)
        for role in fd.add:
            self._add(role, now, self.cfg.group_startup(role), flex=True)
        self._scale("prefill", fd.prefill, now)
        self._scale("decode", fd.decode, now)

    def _kv_capacity_blocks(self) -> float:
        n = sum(1 for r in self.replicas["prefill"] if r.end is None)
        return max(n, 1) * self.prefill_model.kv_capacity_tokens() / BLOCK_TOKENS

    # -- prefill
    def _arrive(self, req: _Req, now: float) -> None:
        self._acc_arrivals.append(req.r)
        self.prefill_queue.append(req)
        for rep in self.replicas["prefill"]:
            if not self.prefill_queue:
                break
            self._start_prefill(rep, now)

    def _cached_tokens(self, req: _Req) -> int:
        hits = 0
        for b in req.r.blocks:
            if b not in self.cache:
                break
            self.cache.move_to_end(b)
            hits += 1
        return min(hits * BLOCK_TOKENS, max(req.r.input_tokens - 1, 0))

    def _start_prefill(self, rep: _Replica, now: float) -> None:
        if rep.busy or not self.prefill_queue or not rep.ready(now):
            return
        batch, tokens = [], 0
        queue = self.prefill_queue
        # a data-parallel replica takes a batch for each of its ranks (the model spreads it over them)
        budget = self.cfg.max_batch_tokens * self.prefill_model.servers
        while queue and (not batch or tokens + queue[0].r.input_tokens <= budget):
            req = queue.popleft()
            req.cached = self._cached_tokens(req)
            tokens += req.r.input_tokens - req.cached
            batch.append(req)
        if not queue:
            self._emptied["prefill"] = True
        rep.busy = True
        rep.running = len(batch)
        t = self.prefill_model.prefill_time([(b.r.input_tokens - b.cached, b.cached) for b in batch])
        t *= self._lora_factor(batch)
        self._at(now + t, "prefill_done", rep, batch)

    def _lora_factor(self, batch) -> float:
        """How much slower a step runs for the distinct adapters in ``batch`` (1.0 without a mix)."""
        if not self.cfg.adapter_mix:
            return 1.0
        distinct = len({b.r.adapter for b in batch} - {""})
        return lora_step_factor(min(distinct, self.cfg.max_loras))

    def _prefill_done(self, rep: _Replica, batch: list[_Req], now: float) -> None:
        cap = self._kv_capacity_blocks()
        for req in batch:
            self._acc_prompt += req.r.input_tokens
            self._acc_cached += req.cached
            self._acc_prefill_tokens += req.r.input_tokens - req.cached
            for b in req.r.blocks:
                self.cache[b] = True
                self.cache.move_to_end(b)
            while len(self.cache) > cap:
                self.cache.popitem(last=False)
            self._at(self._handoff(now, serving.kv_transfer_time(self.prefill_model, req.r.input_tokens,
                                                                 self.decode_model.tp)), "kv_done", req)
            if rep.flex:   # its blocks stay on this worker until a decode admits the request (or the lease ends)
                req.src = rep
                rep.held += 1
                self._at(now + self.cfg.kv_lease, "lease", req)
        rep.busy = False
        rep.running = 0
        self._start_prefill(rep, now)
        self._maybe_retire(rep, now)

    def _handoff(self, now: float, seconds: float) -> float:
        """When a hand-off of ``seconds`` that can start at ``now`` ends: on the first free of one lane per
        serving decode replica (at least one). A CPU P/D pair, 2026-12-04: ten prompts arriving at once
        reached their first tokens 20-25 ms apart beyond their prefill, the decode side taking them in one
        after another; charged as overlapping delays, a burst's TTFT p50 was simulated at 0.57 of the real."""
        lanes = max(sum(1 for r in self.replicas["decode"] if r.ready(now)), 1)
        free = sorted(self.handoff_free)[:lanes]
        free += [now] * (lanes - len(free))
        i = min(range(lanes), key=free.__getitem__)
        free[i] = max(free[i], now) + seconds
        self.handoff_free = free
        return free[i]

    # -- decode
    def _kv_done(self, req: _Req, now: float) -> None:
        self.decode_queue.append(req)
        for rep in sorted(self.replicas["decode"], key=lambda r: (len(r.active), r.id)):
            if not self.decode_queue:
                break
            if rep.ready(now):
                self._decode_update(rep, now)

    def _decode_update(self, rep: _Replica, now: float) -> None:
        if rep.ready_at > now or rep.end is not None:
            return
        if rep.active and rep.step > 0:  # advance everyone by the steps since the last update
            steps = (now - rep.last) / rep.step
            for a in rep.active:
                a.remaining -= steps
                a.ctx += steps
            self._acc_decode_tokens += steps * len(rep.active)
            self._acc_decode_batch_s += (now - rep.last) * len(rep.active)
        rep.last = now
        still = []
        for a in rep.active:
            if a.remaining <= 1e-6:
                self._finish(a, rep, now)
            else:
                still.append(a)
        rep.active = still
        cap = self.decode_model.kv_capacity_tokens()
        admitted = []
        queue = self.decode_queue
        seqs = self.cfg.max_num_seqs * self.decode_model.servers   # each data-parallel rank its own
        while rep.ready(now) and queue and len(rep.active) < seqs and (
                not rep.active or rep.reserved + queue[0].reserve <= cap):
            a = queue.popleft()
            a.admit = now
            rep.reserved += a.reserve
            rep.active.append(a)
            admitted.append(a)
            if a.src is not None:
                self._release(a, now)
            if not queue:
                self._emptied["decode"] = True
        rep.version += 1
        if rep.active:
            rep.step = (self.decode_model.decode_step_time(len(rep.active), sum(a.ctx for a in rep.active))
                        * self._lora_factor(rep.active))
            for a in admitted:
                a.first = now + rep.step
                if a.kv_lost:   # its prefill let the blocks go: this decode prefills the prompt itself
                    a.first += self.decode_model.prefill_time([(a.r.input_tokens, 0)])
                self._ttft(a)
            k = min(math.ceil(a.remaining - 1e-6) for a in rep.active)
            self._at(now + max(k, 1) * rep.step, "decode_tick", rep, rep.version)
        else:
            rep.step = 0.0
        self._maybe_retire(rep, now)

    def _ttft(self, a: _Req) -> None:
        v = a.first - a.r.t
        self.ttft.append(v)
        self._acc_ttft.append(v)

    def _finish(self, a: _Req, rep: _Replica, now: float) -> None:
        a.finish = now
        rep.reserved -= a.reserve
        itl = (now - a.first) / (a.r.output_tokens - 1) if a.r.output_tokens > 1 else rep.step
        self.itl.append(itl)
        self._acc_itl.append(itl)
        self.finished += 1
        self._acc_done += 1
        self._acc_seconds += now - a.r.t
        if a.first - a.r.t <= self.cfg.ttft_target and itl <= self.cfg.itl_target:
            self.met += 1
            self._acc_met += 1

    # -- planning
    def _observe(self, now: float) -> Observation:
        arr = self._acc_arrivals
        if any(s <= now - self.cfg.interval / 2 < e for s, e in self.cfg.metrics_outages):
            return Observation.unavailable(now, "simulated metrics outage")
        ins = sorted(r.input_tokens for r in arr)
        outs = sorted(r.output_tokens for r in arr)
        ready = {role: sum(r.ready(now) for r in self.replicas[role]) for role in ("prefill", "decode")}
        # the saturation measurement: only when the role's queue never emptied and the same replicas served
        # the whole interval (as a Prometheus query over replicas whose waiting gauge stayed >= 1)
        sat = {role: not self._emptied[role] and ready[role] > 0 and ready[role] == self._ready_start[role]
               for role in ("prefill", "decode")}
        span = self.cfg.interval
        growth = self._queue_growth(now)
        return Observation(
            time=now, request_rate=len(arr) / self.cfg.interval,
            ttft=_pct(self._acc_ttft, self.cfg.percentile), itl=_pct(self._acc_itl, self.cfg.percentile),
            input_tokens_mean=sum(ins) / len(ins) if ins else None, input_tokens_p=_pct(ins, self.cfg.percentile),
            input_tokens_tail=_pct(ins, serving.TAIL_PERCENTILE),
            output_tokens_mean=sum(outs) / len(outs) if outs else None,
            output_tokens_p=_pct(outs, self.cfg.percentile),
            prefix_hit_ratio=self._acc_cached / self._acc_prompt if self._acc_prompt else 0.0,
            prefill_queue=float(len(self.prefill_queue)),
            prefill_running=float(sum(r.running for r in self.replicas["prefill"] if r.end is None)),
            decode_queue=float(len(self.decode_queue)),
            decode_running=float(sum(len(r.active) for r in self.replicas["decode"] if r.end is None)),
            # as the routers report them: every adapter of the mix is loaded on the decode workers
            lora_adapters=float(len(self.cfg.adapter_mix)) or None,
            ttft_mean=_mean(self._acc_ttft), itl_mean=_mean(self._acc_itl),
            request_seconds_mean=self._acc_seconds / self._acc_done if self._acc_done else None,
            prefill_ready=float(ready["prefill"]), decode_ready=float(ready["decode"]),
            prefill_saturated_tokens=self._acc_prefill_tokens / (span * ready["prefill"]) if sat["prefill"] else None,
            decode_saturated_tokens=self._acc_decode_tokens / (span * ready["decode"]) if sat["decode"] else None,
            decode_saturated_batch=self._acc_decode_batch_s / (span * ready["decode"]) if sat["decode"] else None,
            prefill_queue_growth=growth[0], decode_queue_growth=growth[1])

    def _queue_growth(self, now: float) -> tuple[float | None, float | None]:
        """Each queue's growth (requests/s) since the last look (a plan or a fast check)."""
        t0, p0, d0 = self._last_queues
        p, d = float(len(self.prefill_queue)), float(len(self.decode_queue))
        self._last_queues = (now, p, d)
        if now <= t0:
            return None, None
        return (p - p0) / (now - t0), (d - d0) / (now - t0)

    def _react(self, now: float) -> None:
        """A fast check between decisions: the queues and their growth, for a policy that reacts to them."""
        react_ = getattr(self.policy, "react", None)
        react_flex_ = getattr(self.policy, "react_flex", None)
        if (react_ is None and react_flex_ is None) or any(s <= now < e for s, e in self.cfg.metrics_outages):
            return
        live_p, live_d = self._live("prefill"), self._live("decode")
        growth = self._queue_growth(now)
        obs = Observation(time=now, prefill_queue=float(len(self.prefill_queue)),
                          decode_queue=float(len(self.decode_queue)),
                          prefill_ready=float(sum(r.ready(now) for r in live_p)),
                          decode_ready=float(sum(r.ready(now) for r in live_d)),
                          prefill_queue_growth=growth[0], decode_queue_growth=growth[1])
        ready = all(r.ready_at <= now for r in live_p + live_d)
        if react_flex_ is not None:
            fd = react_flex_(obs, self._flex_target(now, ready), now)
            if fd is not None:
                self._apply_flex(fd, now)
            return
        sized = react_(obs, self.cfg.target(len(live_p), len(live_d), ready=ready), now)
        if sized is not None:
            self._scale("prefill", sized[0], now)
            self._scale("decode", sized[1], now)

    def _flex_target(self, now: float, ready: bool) -> FlexTarget:
        dedicated = [sum(1 for r in self._live(role) if not r.flex) for role in ("prefill", "decode")]
        return FlexTarget(self.cfg.target(*dedicated, ready=ready), self._flex_workers(now), self.cfg.flex_min,
                          self.cfg.flex_max, self.cfg.flex_spare)

    def _plan(self, now: float) -> None:
        obs = self._observe(now)
        live_p, live_d = self._live("prefill"), self._live("decode")
        ready = all(r.ready_at <= now for r in live_p + live_d)
        target = self.cfg.target(len(live_p), len(live_d), ready=ready)
        plan_flex = getattr(self.policy, "plan_flex", None)
        flex = switches = 0
        if plan_flex is not None:
            fd = plan_flex(obs, self._flex_target(now, ready), now)
            self._apply_flex(fd, now)
            p, d, flex, switches = fd.total("prefill"), fd.total("decode"), fd.flex, len(fd.switches)
        else:
            p, d = self.policy.plan(obs, target, now)
            self._scale("prefill", p, now)
            self._scale("decode", d, now)
        decisions = getattr(self.policy, "decisions", None)
        self.intervals.append(Interval(
            t=now, prefill=p, decode=d, gpus=target.gpus(p, d),
            request_rate=obs.request_rate or 0.0, ttft_p=obs.ttft, itl_p=obs.itl,
            attainment=self._acc_met / self._acc_done if self._acc_done else None,
            reason=decisions[-1].reason if decisions else "",
            sized_rate=decisions[-1].prediction.get("sizedRate") if decisions else None,
            prefill_queue=obs.prefill_queue or 0.0, decode_queue=obs.decode_queue or 0.0,
            ready_prefill=sum(r.ready(now) for r in live_p), ready_decode=sum(r.ready(now) for r in live_d),
            flex=flex, switches=switches))
        self._acc_arrivals, self._acc_ttft, self._acc_itl = [], [], []
        self._acc_met = self._acc_done = self._acc_prompt = self._acc_cached = 0
        self._acc_seconds = 0.0
        self._acc_prefill_tokens = self._acc_decode_tokens = self._acc_decode_batch_s = 0.0
        self._emptied = {"prefill": not self.prefill_queue, "decode": not self.decode_queue}
        self._ready_start = {role: sum(r.ready(now) for r in self.replicas[role]) for role in ("prefill", "decode")}

    def run(self) -> SimResult:
        cfg = self.cfg
        for _ in range(cfg.initial_prefill):
            self._add("prefill", 0.0, 0.0)
        for _ in range(cfg.initial_decode):
            self._add("decode", 0.0, 0.0)
        for role, n in (("prefill", cfg.initial_flex_prefill), ("decode", cfg.initial_flex_decode)):
            for _ in range(n):
                self._add(role, 0.0, 0.0, flex=True)
        for r in self.trace.requests:
            self._at(r.t, "arrive", _Req(r))
        for t, role in cfg.flex_switches:
            self._at(t, "scheduled_switch", role)
        end_arrivals = self.trace.duration
        self._at(cfg.interval, "plan")
        stop = end_arrivals + cfg.drain_limit
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if t > stop:
                break
            if (kind == "lease" and payload[0].src is None) or (
                    kind == "switch_limit" and (payload[0].switching is None or payload[0].switch_seq != payload[1])):
                continue   # moot (the blocks were pulled, the switch is done): not a moment the run lasts to
            self.now = t
            if kind == "arrive":
                self._arrive(payload[0], t)
            elif kind == "prefill_done":
                self._prefill_done(payload[0], payload[1], t)
            elif kind == "kv_done":
                self._kv_done(payload[0], t)
            elif kind == "decode_tick":
                rep, version = payload
                if version == rep.version:
                    self._decode_update(rep, t)
            elif kind == "ready":
                rep = payload[0]
                if rep.end is None:
                    self._start_prefill(rep, t) if rep.role == "prefill" else self._decode_update(rep, t)
            elif kind == "plan":
                self._plan(t)
                if t < end_arrivals or self.finished < len(self.trace.requests):
                    self._at(t + cfg.interval, "plan")
                    # fast checks between this decision and the next
                    k = 1
                    while cfg.fast_check > 0 and k * cfg.fast_check < cfg.interval - 1e-9:
                        self._at(t + k * cfg.fast_check, "check")
                        k += 1
            elif kind == "check":
                self._react(t)
            elif kind == "switch_limit":
                self._switch_limit(payload[0], payload[1], t)
            elif kind == "scheduled_switch":
                self._scheduled_switch(payload[0], t)
            elif kind == "lease":
                self._lease(payload[0], t)
        end = self.now
        gpu_s = 0.0
        for role in ("prefill", "decode"):
            gpus = cfg.layout(role).gpus_per_replica     # a replica's whole group
            for r in self.replicas[role]:
                gpu_s += ((r.end if r.end is not None else end) - r.start) * gpus
        return SimResult(self.policy.name, self.trace.name, cfg, self.intervals, self.ttft, self.itl, self.finished,
                         len(self.trace.requests), self.met, max(end_arrivals, cfg.interval), gpu_s,
                         self.switches, self.switch_drains, self.switches_abandoned, self.kv_leases_expired)


def simulate(trace: Trace, policy: Policy | str = "planner", config: SimConfig = SimConfig(),
             season_intervals: int = 0) -> SimResult:
    if isinstance(policy, str):
        if policy == "planner-flex" and not (config.initial_flex_prefill or config.initial_flex_decode):
            config = config.with_flex(config.flex_max or 64, config.flex_min, config.flex_spare)
        policy = make_policy(policy, config, trace, season_intervals)
    return Simulation(config, trace, policy).run()


def make_policy(name: str, config: SimConfig, trace: Trace, season_intervals: int = 0) -> Policy:
    if name == "planner":
        return PlannerPolicy(config, season_intervals)
    if name == "planner-flex":
        return FlexPlannerPolicy(config if config.flex else config.with_flex(), season_intervals)
    if name == "static-peak":
        return static_peak(config, trace)
    if name == "reactive":
        return ReactivePolicy(stabilization=config.cooldown)
    if name == "dynamo":
        return DynamoPolicy(config, season_intervals=season_intervals)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")


POLICIES = ("planner", "planner-flex", "static-peak", "reactive", "dynamo")


def plot_results(results: list[SimResult], path: str | Path) -> Path:
    """Request rate, replicas, latency percentiles against targets and SLO attainment over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    first = results[0]
    xs = [i.t / 60 for i in first.intervals]
    axes[0].plot(xs, [i.request_rate for i in first.intervals], color="black")
    axes[0].set_ylabel("requests/s")
    axes[0].set_title(f"{first.trace}: " + ", ".join(
        f"{r.policy} {r.attainment:.0%} in SLO, {r.gpu_hours:.1f} GPU-h" for r in results), fontsize=9)
    for r in results:
        x = [i.t / 60 for i in r.intervals]
        axes[1].step(x, [i.prefill for i in r.intervals], where="post", label=f"{r.policy} prefill")
        axes[1].step(x, [i.decode for i in r.intervals], where="post", linestyle="--", label=f"{r.policy} decode")
        axes[2].plot(x, [i.ttft_p if i.ttft_p is not None else math.nan for i in r.intervals],
                     label=f"{r.policy} TTFT p{r.config.percentile:g}")
        axes[3].plot(x, [i.itl_p * 1000 if i.itl_p is not None else math.nan for i in r.intervals],
                     label=f"{r.policy} ITL p{r.config.percentile:g}")
    axes[1].set_ylabel("replicas")
    axes[2].axhline(first.config.ttft_target, color="red", linewidth=0.8, label="TTFT target")
    axes[2].set_ylabel("TTFT (s)")
    axes[2].set_yscale("log")
    axes[3].axhline(first.config.itl_target * 1000, color="red", linewidth=0.8, label="ITL target")
    axes[3].set_ylabel("ITL (ms)")
    axes[3].set_xlabel("minutes")
    for ax in axes[1:]:
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- command line

def add_arguments(p: Any) -> None:
    """Arguments of ``disagg simulate``."""
    p.add_argument("--trace", default="step",
                   help="poisson, step, diurnal, bursty, real (the shared Mooncake trace) or a trace file "
                        "(CSV/JSONL: timestamp, input_tokens, output_tokens, prefix_group)")
    p.add_argument("--policy", default="planner", help=f"one of {', '.join(POLICIES)}, or 'all'")
    p.add_argument("--duration", type=float, default=3600.0, help="seconds (synthetic traces; cuts files)")
    p.add_argument("--rate", type=float, default=12.0, help="mean requests/s (synthetic traces)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply a file trace's request rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=SimConfig.model)
    p.add_argument("--gpu", default=SimConfig.gpu)
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--ttft-ms", type=float, default=1000.0)
    p.add_argument("--itl-ms", type=float, default=40.0)
    p.add_argument("--percentile", type=float, default=90.0)
    p.add_argument("--interval", type=float, default=30.0)
    p.add_argument("--cooldown", type=float, default=300.0)
    p.add_argument("--startup", type=float, default=90.0, help="seconds for a new replica to serve")
    p.add_argument("--gpu-budget", type=int, default=None)
    p.add_argument("--predictor", default="moving-average")
    p.add_argument("--season", type=int, default=0, help="season length in intervals (holt-winters)")
    p.add_argument("--reality", type=float, default=1.0,
                   help="simulated hardware is this much slower than the model the planner plans with")
    p.add_argument("--flex-max", type=int, default=0, help="planner-flex: the flex pool's maximum (0: 64)")
    p.add_argument("--flex-spare", type=int, default=0,
                   help="planner-flex: flex workers kept beyond both roles' need (a pooled headroom)")
    p.add_argument("--out", default="sim-out", help="directory for the CSV, JSON summary and PNG plot")


def load_trace(spec: str, repo: Path, duration: float, rate: float, seed: int, rate_scale: float = 1.0) -> Trace:
    from . import traces

    if spec in ("poisson", "step", "diurnal", "bursty"):
        return traces.synthetic(spec, duration=duration, rate=rate, seed=seed)
    trace = traces.real(repo) if spec == "real" else traces.load(spec)
    return trace.scaled(rate=rate_scale, limit=duration)


def run_cli(args: Any, repo: Path) -> int:
    trace = load_trace(args.trace, repo, args.duration, args.rate, args.seed, args.rate_scale)
    cfg = SimConfig(model=args.model, gpu=args.gpu, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                    ttft_target=args.ttft_ms / 1000.0, itl_target=args.itl_ms / 1000.0,
                    percentile=args.percentile, interval=args.interval, cooldown=args.cooldown,
                    startup=args.startup, gpu_budget=args.gpu_budget, predictor=args.predictor,
                    reality=args.reality, flex_max=args.flex_max, flex_spare=args.flex_spare)
    first = trace.scaled(limit=2 * cfg.interval)
    if first.requests:  # start from a size fit for the first minute's traffic
        p, d = static_peak(cfg, first).size
        cfg = SimConfig(**{**asdict(cfg), "initial_prefill": p, "initial_decode": d})
    names = POLICIES if args.policy == "all" else (args.policy,)
    results = [simulate(trace, name, cfg, args.season) for name in names]
    out = Path(args.out)
    for r in results:
        r.write(out, plot=len(results) == 1)
        print(json.dumps(r.summary()))
    if len(results) > 1:
        path = plot_results(results, out / f"{trace.name}-all.png")
        print(f"plot: {path}")
    else:
        print(f"plot: {out / f'{trace.name}-{results[0].policy}.png'}")
    return 0
