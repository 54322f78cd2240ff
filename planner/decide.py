"""The planner's decisions: a pure function from an observed snapshot to a decision.

``decide(observation, target, memory, model, now) -> (Decision, Memory)`` reads no
clock, no cluster and no Prometheus: the loop, the simulator and the tests call it
the same way. The executor (:mod:`disagg.planner.apply`) carries decisions out.

Sizing (per role, from the shared serving model :mod:`disagg.perf.serving`, corrected online):

* prefill: the replicas serve one queue (M/G/c) fed the predicted rate of prompts drawn from the
  observed prompt-length distribution (a lognormal fitted to the mean and the percentile length), so
  heavy-tailed prompts bring their service-time variance; ``n`` is the least whose TTFT at the SLO
  percentile (the percentile of wait + own prefill + own KV transfer) meets the target;
* decode: the largest batch per replica whose ITL meets the target and whose KV cache
  fits, and Little's law for the requests in flight (``rate x output tokens x ITL``)
  plus a percentile margin for their fluctuation.

Then: up at once, down only after ``scaleDownCooldownSeconds`` since the last scale-up,
with a hysteresis margin and at most a quarter of the role per interval; clamped to
the role's min/max, the gang minimum (never zero) and the GPU budget. Not Ready or
mid-rollout: hold unless saturated (then only up). Missing metrics: hold, say why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from disagg.perf import parallel, serving
from disagg.perf.model import OnlineCorrection, PerfModel

from .predictors import get as get_predictor
from .reasons import (BUDGET_LIMITED, COOLDOWN, METRICS_UNAVAILABLE, NOT_READY, PROMETHEUS_UNREACHABLE,
                      ROLLING_OUT, SCALED, STEADY)

HISTORY = 288               # intervals kept for the predictors
SCALE_DOWN_MARGIN = 1.2     # size for 20% more load before shrinking (hysteresis)
SCALE_DOWN_STEP = 0.25      # shrink at most a quarter of a role per interval (at least one replica)
LEARN_ABOVE = 0.5           # online correction learns from intervals with latency above this share of target
LEARN_STEP = 2.0            # ... and one interval moves it by at most this ratio (before smoothing)
LOAD_STEP = 0.25            # ... and whose request rate moved less than this share from the interval before
SATURATION = 2.0            # observed latency at this multiple of target counts as saturated
MAX_REPLICAS = 1024
UNATTAINABLE_SLACK = 1.25   # when a prompt alone misses the TTFT target, allow this much queueing on top
NEAR_TARGET = 0.8           # no role shrinks while its observed latency is above this share of its target
BURST_MEMORY = 3600.0       # seconds a rise of the load above its forecast is kept as headroom
BURST_NOISE = 2.0           # ... less this many Poisson standard deviations of one interval's rate
CAPACITY_ALPHA = 0.5        # weight of a new saturated interval in the learnt capacity (service-time scale)
CAPACITY_MAX_CV2 = 1.0      # ... learnt for prefill only from a prompt mix whose service cv^2 is at most this
MARGIN_AT = 0.5             # TTFT above this share of target adds prefill (before a breach) when ...
MARGIN_DRAIN = 0.5          # ... the prefill queue takes this share of the TTFT target to drain on the replicas
RISE_KEEPS = 1.0            # a role whose work rose this many standard deviations above its forecast keeps
                            # its size (RoleDecision.keep: no flex worker leaves it)



@dataclass(frozen=True)
class Observation:
    """One snapshot of the deployment's traffic and latency over the last interval.

    Latencies are in seconds at the SLO percentile; token counts per request.
    ``error`` says the source could not be read at all and ``error_reason`` why (Prometheus unreachable, or
    it refused a query); ``missing`` names required series that were absent or NaN.
    """

    time: float
    request_rate: float | None = None
    ttft: float | None = None
    itl: float | None = None
    input_tokens_mean: float | None = None
    input_tokens_p: float | None = None
    input_tokens_tail: float | None = None  # at serving.TAIL_PERCENTILE (99): the heavy tail of the mix
    output_tokens_mean: float | None = None
    output_tokens_p: float | None = None
    prefix_hit_ratio: float = 0.0
    prefill_queue: float | None = None      # requests waiting for a prefill slot (all replicas)
    decode_queue: float | None = None       # requests waiting for decode admission (KV memory full)
    prefill_running: float | None = None    # requests being prefilled
    decode_running: float | None = None     # requests decoding
    decode_kv_usage: float | None = None    # 0..1, mean over decode replicas
    # replicas serving (engines reporting metrics), per role; None: not known (then all, when Ready)
    prefill_ready: float | None = None
    decode_ready: float | None = None
    # capacity measured while saturated: over the replicas that had requests waiting throughout the window,
    # what each one did (a queue that never empties runs its replicas flat out, so this is their real
    # service rate, whatever the model says); None when no replica was saturated throughout
    prefill_saturated_tokens: float | None = None   # uncached prompt tokens/s per saturated prefill replica
    decode_saturated_tokens: float | None = None    # output tokens/s per saturated decode replica
    decode_saturated_batch: float | None = None     # requests decoding (mean) per saturated decode replica
    # how fast each waiting queue grew over the last short window (requests/s; the fast path reads it)
    prefill_queue_growth: float | None = None
    decode_queue_growth: float | None = None
    # LoRA adapters ready on the decode workers (the routers' disagg_router_adapter_workers): taken as the
    # distinct adapters in a batch (an upper bound: every served adapter in every batch), which slows each
    # step by perf.model.lora_step_factor
    lora_adapters: float | None = None
    # means over the interval (the simulator fills them; the Dynamo-style baseline reads them, as
    # Dynamo's planner reads average TTFT, ITL and request duration; decide() reads percentiles)
    ttft_mean: float | None = None
    itl_mean: float | None = None
    request_seconds_mean: float | None = None
    missing: tuple[str, ...] = ()
    error: str | None = None
    error_reason: str = PROMETHEUS_UNREACHABLE
    # what the source read to make it: (name, PromQL, value; None when empty or NaN), in order; a decision's
    # trace shows them (planner/tracing.py). Not compared: two observations of the same figures are equal
    reads: tuple[tuple[str, str, float | None], ...] = field(default=(), compare=False)

    @classmethod
    def unavailable(cls, time: float, error: str, reason: str = PROMETHEUS_UNREACHABLE,
                    reads: tuple[tuple[str, str, float | None], ...] = ()) -> Observation:
        return cls(time=time, error=error, error_reason=reason, reads=reads)

    def inputs(self) -> dict[str, float]:
        out = {}
        for key in ("request_rate", "ttft", "itl", "input_tokens_mean", "input_tokens_p", "input_tokens_tail",
                    "output_tokens_mean",
                    "output_tokens_p", "prefix_hit_ratio", "prefill_queue", "decode_queue", "prefill_running",
                    "decode_running", "decode_kv_usage", "prefill_ready", "decode_ready",
                    "prefill_saturated_tokens", "decode_saturated_tokens", "decode_saturated_batch",
                    "prefill_queue_growth", "decode_queue_growth", "lora_adapters"):
            v = getattr(self, key)
            if v is not None and math.isfinite(v):
                out[_camel(key)] = round(float(v), 6)
        return out


def _camel(s: str) -> str:
    head, *rest = s.split("_")
    return head + "".join(w.capitalize() for w in rest)


@dataclass(frozen=True)
class Target:
    """The deployment as the planner sees it: current size, bounds, SLO and planner settings."""

    prefill: int
    decode: int
    ttft_target: float                 # seconds
    itl_target: float                  # seconds
    percentile: float = 90.0
    prefill_tp: int = 1
    decode_tp: int = 1
    # GPUs one replica holds (pods x GPUs per pod: disagg.api.parallelism), when not its tensor parallel
    # size alone (pipeline, data parallel, replicas across pods); 0: the tensor parallel size
    prefill_gpus: int = 0
    decode_gpus: int = 0
    prefill_min: int = 1
    decode_min: int = 1
    prefill_max: int = MAX_REPLICAS
    decode_max: int = MAX_REPLICAS
    gpu_budget: int | None = None
    interval: float = 30.0
    cooldown: float = 300.0
    startup: float = 90.0              # seconds from asking for a replica to it serving (model load)
    season: int = 0                    # intervals in the traffic's cycle (holt-winters); 0: none
    predictor: str = "moving-average"
    ready: bool = True
    rolling: bool = False

    @classmethod
    def from_spec(cls, spec: Any, *, ready: bool = True, rolling: bool = False) -> Target:
        """From a :class:`disagg.api.v1alpha1.DisaggDeploymentSpec`."""
        gang = spec.scheduling.gang
        slo = spec.slo
        return cls(
            prefill=spec.prefill.replicas, decode=spec.decode.replicas,
            ttft_target=slo.ttft_ms / 1000.0, itl_target=slo.itl_ms / 1000.0, percentile=slo.percentile,
            prefill_tp=spec.prefill.tensor_parallel_size, decode_tp=spec.decode.tensor_parallel_size,
            prefill_gpus=spec.prefill.layout().gpus_per_replica, decode_gpus=spec.decode.layout().gpus_per_replica,
            prefill_min=max(1, gang.min_prefill, spec.prefill.min_replicas or 0),
            decode_min=max(1, gang.min_decode, spec.decode.min_replicas or 0),
            prefill_max=spec.prefill.max_replicas or MAX_REPLICAS,
            decode_max=spec.decode.max_replicas or MAX_REPLICAS,
            gpu_budget=spec.planner.gpu_budget, interval=spec.planner.interval_seconds,
            cooldown=spec.planner.scale_down_cooldown_seconds, startup=spec.planner.replica_startup_seconds,
            season=(spec.planner.season_seconds or 0) // spec.planner.interval_seconds,
            predictor=spec.planner.predictor, ready=ready, rolling=rolling)

    @property
    def floor_prefill(self) -> int:
        return max(1, self.prefill_min)

    @property
    def floor_decode(self) -> int:
        return max(1, self.decode_min)

    @property
    def replica_gpus(self) -> tuple[int, int]:
        """GPUs of one prefill and one decode replica: what the budget counts and scaling adds or frees."""
        return self.prefill_gpus or self.prefill_tp, self.decode_gpus or self.decode_tp

    def gpus(self, prefill: int, decode: int) -> int:
        gp, gd = self.replica_gpus
        return prefill * gp + decode * gd


@dataclass(frozen=True)
class Load:
    """Traffic to size for."""

    rate: float                 # requests/s
    input_mean: float           # prompt tokens
    input_p: float              # prompt tokens at the SLO percentile
    output_mean: float          # generated tokens
    prefix_hit: float = 0.0     # fraction of prompt tokens already cached
    input_tail: float | None = None  # prompt tokens at serving.TAIL_PERCENTILE (None: fit at input_p only)


@dataclass(frozen=True)
class Memory:
    """What the planner carries from one interval to the next (per deployment)."""

    rate: tuple[float, ...] = ()
    input_mean: tuple[float, ...] = ()
    input_p: tuple[float, ...] = ()
    input_tail: tuple[float, ...] = ()
    output_mean: tuple[float, ...] = ()
    prefix_hit: tuple[float, ...] = ()
    correction: OnlineCorrection = field(default_factory=OnlineCorrection)
    forecast: tuple[float, ...] = ()   # the rate each interval sized for (aligned with ``rate``)
    # each role's work per interval, observed and forecast (aligned with each other): uncached prompt
    # tokens/s for prefill, output tokens/s for decode (the burst headroom is over work, not requests: a
    # tenant mix that shifts to longer prompts is a rise of prefill work at a steady request rate)
    prefill_work: tuple[float, ...] = ()
    decode_work: tuple[float, ...] = ()
    forecast_prefill_work: tuple[float, ...] = ()
    forecast_decode_work: tuple[float, ...] = ()
    last_scale_up_prefill: float | None = None
    last_scale_up_decode: float | None = None
    # each role's service-time scale (real / model) learnt from saturated intervals (None: never saturated)
    capacity_prefill: float | None = None
    capacity_decode: float | None = None
    # how far each role's work of the last interval rose above what the planner forecast for it, in Poisson
    # standard deviations of one interval's work (``_sized_rates``; 0 when not above): a role whose work is
    # rising keeps its flex workers (RoleDecision.keep), whatever the model asks for it
    rise_prefill: float = 0.0
    rise_decode: float = 0.0

    def remember(self, obs: Observation, keep: int = HISTORY) -> Memory:
        def push(series: tuple[float, ...], value: float | None) -> tuple[float, ...]:
            if value is None or not math.isfinite(value):
                return series
            return (series + (float(value),))[-keep:]

        return replace(self, rate=push(self.rate, obs.request_rate),
                       input_mean=push(self.input_mean, obs.input_tokens_mean),
                       input_p=push(self.input_p, obs.input_tokens_p),
                       input_tail=push(self.input_tail, obs.input_tokens_tail),
                       output_mean=push(self.output_mean, obs.output_tokens_mean),
                       prefix_hit=push(self.prefix_hit, obs.prefix_hit_ratio))


@dataclass(frozen=True)
class RoleDecision:
    replicas: int
    needed: int            # what the model asked for before hysteresis and clamps
    reason: str
    # the least replicas the role keeps now: what the model asks (``needed``, headroom included, at least the
    # floor), the current size while its observed latency is above NEAR_TARGET of its target; None where the
    # decision did not size (a hold). What a flex worker may leave the role down to (disagg.planner.flex),
    # cooldown and hysteresis or not: a switch is undone in seconds, where a replica given up takes a start-up
    keep: int | None = None

    def direction(self, current: int) -> str:
        return "up" if self.replicas > current else "down" if self.replicas < current else "hold"


@dataclass(frozen=True)
class Decision:
    prefill: RoleDecision
    decode: RoleDecision
    reason: str
    message: str
    metrics_ok: bool
    inputs: dict[str, float] = field(default_factory=dict)
    prediction: dict[str, float] = field(default_factory=dict)

    def changes(self, target: Target) -> bool:
        return self.prefill.replicas != target.prefill or self.decode.replicas != target.decode


@dataclass(frozen=True)
class RoleModels:
    """A performance model per role (they differ when the roles' tensor parallelism does)."""

    prefill: PerfModel
    decode: PerfModel

    @classmethod
    def of(cls, model: PerfModel | RoleModels) -> RoleModels:
        return model if isinstance(model, RoleModels) else cls(model, model)

    def corrected(self, prefill_scale: float = 1.0, decode_scale: float = 1.0) -> RoleModels:
        return RoleModels(self.prefill.corrected(prefill_scale, decode_scale),
                          self.decode.corrected(prefill_scale, decode_scale))

    def with_lora(self, active_adapters: float) -> RoleModels:
        return RoleModels(self.prefill.with_lora(active_adapters), self.decode.with_lora(active_adapters))

    @classmethod
    def from_spec(cls, spec: Any, model_name: str, gpu_name: str, profile: Any = None) -> RoleModels:
        """Each role's model from its layout (:func:`disagg.perf.parallel.role_engine`): a data-parallel,
        expert-parallel replica of a mixture-of-experts model is priced with the multi-node terms (its
        all-to-all over NVLink across the replica when the deployment requires one NVLink domain per
        group, ``scheduling.topology`` on :data:`~disagg.perf.parallel.NVLINK_DOMAIN_KEY`, else within a
        pod); any other layout as one engine of its tensor size."""
        topo = spec.scheduling.topology
        one_domain = topo is not None and topo.key == parallel.NVLINK_DOMAIN_KEY and topo.mode == "required"

        def one(role: Any) -> PerfModel:
            lay = role.layout()
            return parallel.role_engine(model_name, gpu_name, lay, profile=profile,
                                        nvlink_domain=lay.gpus_per_replica if one_domain else 0)

        return cls(one(spec.prefill), one(spec.decode))


# ---------------------------------------------------------------- sizing (pure, monotone in load)
# The arithmetic is the shared serving model's (.serving); these adapt it to the planner's Load.

def _work(models: RoleModels, load: Load, percentile: float) -> serving.PrefillWork:
    mix = serving.PromptMix(load.input_mean, max(load.input_p, load.input_mean), percentile, load.input_tail)
    return serving.prefill_work(models.prefill, mix, load.prefix_hit, models.decode.tp)


def prefill_latency(model: PerfModel | RoleModels, load: Load, replicas: int, percentile: float) -> float:
    """Predicted TTFT at ``percentile`` with ``replicas`` prefill replicas (inf when overloaded)."""
    models = RoleModels.of(model)
    return serving.prefill_ttft(_work(models, load, percentile), max(load.rate, 0.0), replicas, percentile)


def size_prefill(model: PerfModel | RoleModels, load: Load, ttft_target: float, percentile: float,
                 limit: int = MAX_REPLICAS, capacity: PerfModel | RoleModels | None = None) -> tuple[int, float]:
    """Least prefill replicas meeting the TTFT target (``limit`` when none does), and the TTFT they give;
    never fewer than ``capacity``'s mean service time keeps under the utilisation cap."""
    models = RoleModels.of(model)
    work = _work(models, load, percentile)
    floor = _work(RoleModels.of(capacity), load, percentile).mean if capacity is not None else None
    # prompts that alone miss the target cannot be helped by more replicas: then plan for queueing of at
    # most a quarter of their own time instead of chasing the target
    alone = serving.prefill_ttft(work, 0.0, 1, percentile)
    goal = max(ttft_target, alone * UNATTAINABLE_SLACK)
    return serving.least_prefill(work, max(load.rate, 0.0), goal, percentile, limit, capacity_service=floor)


def decode_latency(model: PerfModel | RoleModels, load: Load, replicas: int, itl_target: float) -> float:
    """Predicted ITL with ``replicas`` decode replicas sharing the requests in flight."""
    return serving.decode_itl(RoleModels.of(model).decode, load.rate, load.input_mean, load.output_mean, replicas)


def size_decode(model: PerfModel | RoleModels, load: Load, itl_target: float, percentile: float,
                limit: int = MAX_REPLICAS) -> tuple[int, float]:
    """Least decode replicas keeping the ITL target for the requests in flight, and the ITL they give."""
    dm = RoleModels.of(model).decode
    n = min(serving.decode_replicas(dm, load.rate, load.input_mean, load.output_mean, itl_target, percentile), limit)
    return n, decode_latency(dm, load, n, itl_target)


def fit_budget(prefill: int, decode: int, target: Target) -> tuple[int, int, bool]:
    """Shrink (prefill, decode) to the GPU budget in proportion to what each asked above its floor."""
    budget = target.gpu_budget
    if budget is None or target.gpus(prefill, decode) <= budget:
        return prefill, decode, False
    fp, fd = min(target.floor_prefill, prefill), min(target.floor_decode, decode)
    avail = max(budget - target.gpus(fp, fd), 0)
    gp, gd = target.replica_gpus
    extra_p, extra_d = (prefill - fp) * gp, (decode - fd) * gd
    if extra_p + extra_d == 0:
        return fp, fd, True
    f = avail / (extra_p + extra_d)
    p = fp + int(extra_p * f // gp)
    d = fd + int(extra_d * f // gd)
    # hand out what rounding left, to the role furthest below its ask
    while True:
        options = []
        if p < prefill and target.gpus(p + 1, d) <= budget:
            options.append(((prefill - p) / prefill, 0))
        if d < decode and target.gpus(p, d + 1) <= budget:
            options.append(((decode - d) / decode, 1))
        if not options:
            break
        if max(options)[1] == 0:
            p += 1
        else:
            d += 1
    return p, d, True


# ---------------------------------------------------------------- the decision

def _hold(target: Target, memory: Memory, reason: str, message: str, obs: Observation) -> tuple[Decision, Memory]:
    # the current size, within the hard limits only: never zero (even when someone set it so), never
    # past maxReplicas or the GPU budget
    p = min(max(target.prefill, target.floor_prefill), max(target.prefill_max, target.floor_prefill))
    d = min(max(target.decode, target.floor_decode), max(target.decode_max, target.floor_decode))
    p, d, _ = fit_budget(p, d, target)
    return Decision(RoleDecision(p, p, reason), RoleDecision(d, d, reason), reason, message, metrics_ok=False,
                    inputs=obs.inputs()), memory


def _predict(name: str, history: tuple[float, ...], season: int, horizon: int = 1) -> float:
    """The most the predictor expects over the next ``horizon`` intervals."""
    params = {"season": season} if name == "holt-winters" else {}
    predictor = get_predictor(name, **params)
    return max(predictor.predict(history, ahead) for ahead in range(1, max(horizon, 1) + 1))


def decide(obs: Observation, target: Target, memory: Memory, model: PerfModel | RoleModels, now: float,
           season_intervals: int = 0) -> tuple[Decision, Memory]:
    """Plan the next interval. Pure: same inputs, same decision."""
    if obs.error:
        return _hold(target, memory, obs.error_reason,
                     f"holding at prefill={target.prefill} decode={target.decode}: {obs.error}", obs)
    if obs.missing or obs.request_rate is None or not math.isfinite(obs.request_rate):
        missing = ", ".join(obs.missing) or "request rate"
        return _hold(target, memory, METRICS_UNAVAILABLE,
                     f"holding at prefill={target.prefill} decode={target.decode}: no data for {missing}", obs)

    first = memory.last_scale_up_prefill is None
    if first:  # the planner's start counts as a scale-up: no shrinking on cold-start samples
        memory = replace(memory, last_scale_up_prefill=now, last_scale_up_decode=now)
    # (an infinite latency is a queue that never drains: a breach, though nothing to learn from)
    if obs.lora_adapters:      # the adapters in the batches slow every step (perf.model.lora_step_factor)
        model = RoleModels.of(model).with_lora(obs.lora_adapters)
    ttft_obs = obs.ttft if obs.ttft is not None and not math.isnan(obs.ttft) else None
    itl_obs = obs.itl if obs.itl is not None and not math.isnan(obs.itl) else None
    # plan with what was learnt up to the last interval; this interval's lesson applies from the next
    # (so one sample cannot both trigger and size a change, and the decision stays monotone in load)
    corr = memory.correction
    planning = _planning(model, memory)
    capacity = _capacity(model, memory)   # (the utilisation cap's service time; see below)
    memory = _correct(obs, target, memory, model, _finite(ttft_obs), _finite(itl_obs))
    memory = learn_capacity(obs, target, memory, model)
    season = season_intervals or target.season
    memory = memory.remember(obs, max(HISTORY, 2 * season + 2))

    # predicted load; never below what was just observed (scale up fast)
    last_rate = obs.request_rate
    # over the time a new replica takes to start, and the interval after (what a decision now can serve)
    horizon = math.ceil(target.startup / target.interval) + 1
    rate = max(_predict(target.predictor, memory.rate, season, horizon), last_rate)
    if season >= 2 and len(memory.rate) > season:
        # additive Holt-Winters overshoots a square burst (seen: 2.4x its peak, sizing twice the replicas
        # the burst needs); a seasonal forecast stays within the last season's peak, and a load that
        # outgrows it shows up as a rise above forecast (the headroom below)
        rate = max(min(rate, max(memory.rate[-season:])), last_rate)
    memory = replace(memory, forecast=(memory.forecast + (rate,))[-len(memory.rate):])
    in_mean = max(memory.input_mean[-1] if memory.input_mean else 0.0, 1.0)
    in_p = max(memory.input_p[-1] if memory.input_p else in_mean, in_mean)
    out_mean = max(memory.output_mean[-1] if memory.output_mean else 0.0, 1.0)
    hit = memory.prefix_hit[-1] if memory.prefix_hit else 0.0
    if len(memory.input_mean) > 1:  # token mixes: smoothed, but not below the last value
        in_mean = max(_predict("moving-average", memory.input_mean, 0), in_mean)
        out_mean = max(_predict("moving-average", memory.output_mean, 0), out_mean)
    # one interval's p99 is its few longest prompts: averaged over the recent intervals, not the last one
    tail = _predict("moving-average", memory.input_tail, 0) if memory.input_tail else None
    load = Load(rate, in_mean, in_p, out_mean, hit, tail)
    # headroom for the kind of rise this load has shown, per role in its own work (a replica asked for
    # now serves a start-up later, so a rise within that time is served by what runs already)
    memory, sized_rate_p, sized_rate_d = _sized_rates(obs, memory, load, horizon, target)
    sized_rate = max(sized_rate_p, sized_rate_d)
    # what is already waiting, and what will pile up until new replicas serve, must be cleared within
    # one start-up and interval, on top of the new load (and its headroom)
    horizon = target.startup + target.interval
    load_p = replace(load, rate=sized_rate_p + _backlog(obs.prefill_queue, rate, _prefill_capacity(
        planning, load, target.prefill, target.percentile), target.startup) / horizon)
    # (prompts waiting for prefill now wait for decode next)
    waiting_d = (obs.decode_queue or 0.0) + (obs.prefill_queue or 0.0)
    load_d = replace(load, rate=sized_rate_d + _backlog(waiting_d, rate, _decode_capacity(
        planning, load, target.decode, target.itl_target), target.startup) / horizon)

    p_limit = max(min(target.prefill_max, MAX_REPLICAS), target.floor_prefill)
    d_limit = max(min(target.decode_max, MAX_REPLICAS), target.floor_decode)
    # a correction below 1 says the engine's latency tail is shorter than the model's queueing predicts; it
    # lowers the predicted TTFT, never the capacity the utilisation cap reserves (a queue past its capacity
    # grows without bound, and one latency ratio cannot tell faster service from a gentler tail); a
    # capacity measured while saturated replaces that floor: it is the service rate itself
    need_p, ttft_pred = size_prefill(planning, load_p, target.ttft_target, target.percentile, p_limit, capacity)
    need_d, itl_pred = size_decode(planning, load_d, target.itl_target, target.percentile, d_limit)
    # the observed latency has the last word when it breaks the target the model claims is met
    # (TTFT is prefill's unless requests wait for decode admission; then decode needs room first); but
    # only on a role whose replicas all serve: while asked-for replicas start, the latency measures the
    # old size, and one more each interval stacked up past the need (flash: decode 1 -> 5 where 2 serve
    # the crowd). A model that is wrong about the hardware is corrected by the capacity measured while
    # saturated (learn_capacity), not by this rule.
    # Before a breach, a margin: TTFT above half its target with a prefill queue that alone takes half the
    # target to drain on the replicas (at the capacity the utilisation cap reserves) is a backlog building,
    # not the noise of a heavy tail (a 100k-token prompt piles up a few requests the others drain in a
    # second; a TTFT percentile near target with nothing queued is a long prompt's own prefill). Tenants'
    # first RAG step: one prefill replica at TTFT 1.1 s of 2 s with 26 waiting asks at 270 s, not 315 s.
    decode_waiting = (obs.decode_queue or 0.0) >= 1.0
    breach_p = (ttft_obs is not None and ttft_obs > target.ttft_target
                and (obs.prefill_queue is None or obs.prefill_queue >= target.prefill))
    margin_p = (ttft_obs is not None and ttft_obs > MARGIN_AT * target.ttft_target
                and obs.prefill_queue is not None and obs.prefill_queue >= MARGIN_DRAIN * target.ttft_target
                * _prefill_capacity(capacity, load, target.prefill, target.percentile))
    if ((breach_p or margin_p) and need_p <= target.prefill
            and _all_ready(obs.prefill_ready, target.prefill, target) and not decode_waiting):
        need_p = target.prefill + 1
    if (((itl_obs is not None and itl_obs > target.itl_target) or decode_waiting) and need_d <= target.decode
            and _all_ready(obs.decode_ready, target.decode, target)):
        need_d = target.decode + 1
    need_p = min(max(need_p, target.floor_prefill), p_limit)
    need_d = min(max(need_d, target.floor_decode), d_limit)

    saturated = ((ttft_obs is not None and ttft_obs > SATURATION * target.ttft_target)
                 or (itl_obs is not None and itl_obs > SATURATION * target.itl_target))

    def role(current: int, need: int, floor: int, limit: int, last_up: float | None, obs_lat: float | None,
             slo: float, shrink_size: int) -> RoleDecision:
        current_c = min(max(current, floor), limit)
        if not target.ready or target.rolling:
            why = NOT_READY if not target.ready else ROLLING_OUT
            if saturated and need > current_c:
                return RoleDecision(need, need, SCALED)
            return RoleDecision(current_c, need, why)
        if need > current_c:
            return RoleDecision(need, need, SCALED)
        if current_c > current:  # below its floor (or zero): lift it
            return RoleDecision(current_c, need, SCALED)
        if shrink_size >= current_c or (obs_lat is not None and obs_lat > NEAR_TARGET * slo):
            return RoleDecision(current_c, need, STEADY)
        if last_up is not None and now - last_up < target.cooldown:
            return RoleDecision(current_c, need, COOLDOWN)
        step = max(1, math.floor(current_c * SCALE_DOWN_STEP))
        return RoleDecision(max(shrink_size, current_c - step, floor), need, SCALED)

    # the size to shrink to is computed for more load than predicted (hysteresis)
    shrink_p = min(max(size_prefill(planning, replace(load_p, rate=load_p.rate * SCALE_DOWN_MARGIN),
                                    target.ttft_target, target.percentile, p_limit, capacity)[0], need_p), p_limit)
    shrink_d = min(max(size_decode(planning, replace(load_d, rate=load_d.rate * SCALE_DOWN_MARGIN),
                                   target.itl_target, target.percentile, d_limit)[0], need_d), d_limit)
    rp = role(target.prefill, need_p, target.floor_prefill, p_limit, memory.last_scale_up_prefill, ttft_obs,
              target.ttft_target, shrink_p)
    rd = role(target.decode, need_d, target.floor_decode, d_limit, memory.last_scale_up_decode, itl_obs,
              target.itl_target, shrink_d)

    def keep(current: int, need: int, floor: int, obs_lat: float | None, slo: float, rise: float) -> int:
        # near its target, or with its work rising above the forecast made for it (the model's need lags a
        # rise of the role's own: tenants seed 1, RAG's step, prefill's work 20% above its forecast at 630 s,
        # the model still asking 2 of the 3 it held; one was switched to decode and prefill missed for 150 s)
        if (obs_lat is not None and obs_lat > NEAR_TARGET * slo) or rise > RISE_KEEPS:
            return max(current, need, floor)
        return max(need, floor)

    # (TTFT is prefill's only while nothing waits for decode admission, as for the breach above: requests
    # queued at decode wait for their first token there, and prefill giving up a flex worker is what helps)
    rp = replace(rp, keep=keep(target.prefill, need_p, target.floor_prefill, None if decode_waiting else ttft_obs,
                               target.ttft_target, memory.rise_prefill))
    rd = replace(rd, keep=keep(target.decode, need_d, target.floor_decode, itl_obs, target.itl_target,
                               memory.rise_decode))

    p, d, limited = fit_budget(rp.replicas, rd.replicas, target)
    if p != rp.replicas:
        rp = RoleDecision(p, rp.needed, BUDGET_LIMITED, rp.keep)
    if d != rd.replicas:
        rd = RoleDecision(d, rd.needed, BUDGET_LIMITED, rd.keep)
    if rp.replicas > target.prefill:
        memory = replace(memory, last_scale_up_prefill=now)
    if rd.replicas > target.decode:
        memory = replace(memory, last_scale_up_decode=now)

    changed = rp.replicas != target.prefill or rd.replicas != target.decode
    reasons = [r.reason for r in (rp, rd)]
    if limited:
        reason = BUDGET_LIMITED
    elif changed:
        reason = SCALED
    else:
        reason = next((r for r in reasons if r != STEADY and r != SCALED), STEADY)
    message = (f"prefill {target.prefill}->{rp.replicas} (model asks {need_p}, {rp.reason}), "
               f"decode {target.decode}->{rd.replicas} (model asks {need_d}, {rd.reason}); "
               f"load {rate:.3g} req/s (sized for {sized_rate:.3g}), {in_mean:.0f} in / {out_mean:.0f} out tokens, "
               f"prefix hit {hit:.0%}; "
               f"TTFT p{target.percentile:g} observed {_ms(ttft_obs)} predicted {_ms(ttft_pred)} "
               f"target {_ms(target.ttft_target)}; ITL observed {_ms(itl_obs)} predicted {_ms(itl_pred)} "
               f"target {_ms(target.itl_target)}; correction prefill x{corr.prefill:.2f} decode x{corr.decode:.2f}")
    prediction = {"requestRate": round(rate, 6), "sizedRate": round(sized_rate, 6),
                  "sizedPrefillRate": round(sized_rate_p, 6), "sizedDecodeRate": round(sized_rate_d, 6),
                  "inputTokens": round(in_mean, 3), "outputTokens": round(out_mean, 3),
                  "prefillCorrection": round(corr.prefill, 4), "decodeCorrection": round(corr.decode, 4)}
    for key, value in (("prefillCapacityScale", memory.capacity_prefill),
                       ("decodeCapacityScale", memory.capacity_decode)):
        if value is not None:
            prediction[key] = round(value, 4)
    if math.isfinite(ttft_pred):
        prediction["ttftSeconds"] = round(ttft_pred, 6)
    if math.isfinite(itl_pred):
        prediction["itlSeconds"] = round(itl_pred, 6)
    return Decision(rp, rd, reason, message, True, obs.inputs(), prediction), memory


def _all_ready(ready: float | None, replicas: int, target: Target) -> bool:
    """Every replica of a role serves (from the engines reporting metrics; else from the deployment's Ready)."""
    return ready >= replicas if ready is not None else target.ready


def _planning(model: PerfModel | RoleModels, memory: Memory) -> RoleModels:
    """The model the planner sizes with: the latency correction, never faster than the capacity measured
    while saturated (a queue that never drains measures the service time itself)."""
    corr = memory.correction
    return RoleModels.of(model).corrected(max(corr.prefill, memory.capacity_prefill or 0.0),
                                          max(corr.decode, memory.capacity_decode or 0.0))


def _capacity(model: PerfModel | RoleModels, memory: Memory) -> RoleModels:
    """The model whose mean service time the utilisation cap reserves: the measured capacity where a role
    was seen saturated, else never faster than the model."""
    corr = memory.correction
    return RoleModels.of(model).corrected(
        max(corr.prefill, memory.capacity_prefill if memory.capacity_prefill is not None else 1.0),
        max(corr.decode, memory.capacity_decode if memory.capacity_decode is not None else 1.0))


def learn_capacity(obs: Observation, target: Target, memory: Memory, model: PerfModel | RoleModels) -> Memory:
    """Learn each role's service-time scale (real / model) from what its saturated replicas did.

    A replica with requests waiting throughout the window ran flat out: its uncached prompt tokens/s
    (prefill) or output tokens/s at its batch (decode) is its capacity, whatever the latency says. The
    model's prediction of the same quantity for the observed mix, at scale 1, over the observation is
    the scale; smoothed over saturated intervals (:data:`CAPACITY_ALPHA`) and clamped like the latency
    correction. Unlike that correction it needs no steady load and no latency near the target: it is
    measured exactly when the queue builds, which is when an optimistic model costs the most."""
    if obs.input_tokens_mean is None or obs.output_tokens_mean is None:
        return memory
    models = RoleModels.of(model)
    corr = memory.correction
    scales: dict[str, float] = {}
    if obs.prefill_saturated_tokens and obs.prefill_saturated_tokens > 0:
        load = Load(obs.request_rate or 0.0, obs.input_tokens_mean, obs.input_tokens_p or obs.input_tokens_mean,
                    obs.output_tokens_mean, obs.prefix_hit_ratio, obs.input_tokens_tail)
        work = _work(models, load, target.percentile)
        uncached = obs.input_tokens_mean * (1.0 - min(max(obs.prefix_hit_ratio, 0.0), 0.99))
        # with heavy-tailed prompts a queue saturates when long prompts cluster, so what the saturated
        # replicas served is heavier than the window's arrivals the prediction is made for: it would read
        # as slower hardware (2-hour heavy-lognormal: 0.63 -> 0.99x static-peak's GPU-hours)
        if work.mean > 0 and uncached > 0 and work.cv2 <= CAPACITY_MAX_CV2:
            # a replica's capacity is its servers' (a data-parallel replica prefills one prompt per rank)
            scales["prefill"] = uncached * work.servers / work.mean / obs.prefill_saturated_tokens
    if (obs.decode_saturated_tokens and obs.decode_saturated_tokens > 0 and obs.decode_saturated_batch
            and obs.decode_saturated_batch >= 1):
        ctx = obs.input_tokens_mean + obs.output_tokens_mean / 2.0
        predicted = models.decode.decode_throughput(obs.decode_saturated_batch, ctx)
        if predicted > 0:
            scales["decode"] = predicted / obs.decode_saturated_tokens
    out = {}
    for role, scale in scales.items():
        scale = min(max(scale, corr.lo), corr.hi)
        old = getattr(memory, f"capacity_{role}")
        out[f"capacity_{role}"] = scale if old is None else math.exp(
            (1 - CAPACITY_ALPHA) * math.log(old) + CAPACITY_ALPHA * math.log(scale))
    return replace(memory, **out) if out else memory


def react(obs: Observation, target: Target, memory: Memory, model: PerfModel | RoleModels,
          now: float) -> tuple[Decision | None, Memory]:
    """The fast path between decisions: scale a role up at once when its waiting queue grows faster than
    its ready replicas drain it (``obs`` carries the queues and their growth over a short window), sized
    so the ready replicas plus the new ones carry the arrivals (drain + growth) and clear what waits
    within one start-up and interval. Only ever up; replicas already asked for count; None when nothing
    needs doing. The full decision (:func:`decide`) and its scale-down rules are unchanged: a replica
    added here starts the role's cooldown like any scale-up."""
    if obs.error or not target.ready or target.rolling:
        return None, memory
    planning = _planning(model, memory)
    capacity = _capacity(model, memory)
    if not memory.input_mean or not memory.output_mean:
        return None, memory
    load = Load(memory.rate[-1] if memory.rate else 0.0, memory.input_mean[-1],
                memory.input_p[-1] if memory.input_p else memory.input_mean[-1], memory.output_mean[-1],
                memory.prefix_hit[-1] if memory.prefix_hit else 0.0,
                memory.input_tail[-1] if memory.input_tail else None)
    horizon = target.startup + target.interval
    asks = {}
    for role, queue, growth, ready, current in (
            ("prefill", obs.prefill_queue, obs.prefill_queue_growth, obs.prefill_ready, target.prefill),
            ("decode", obs.decode_queue, obs.decode_queue_growth, obs.decode_ready, target.decode)):
        serving_now = ready if ready is not None else current
        if queue is None or growth is None or growth <= 0:
            continue
        # requests/s one replica drains (at the planned batch for decode: what sizing plans for)
        per = (_prefill_capacity(capacity, load, 1, target.percentile) if role == "prefill"
               else _decode_capacity(planning, load, 1, target.itl_target))
        if not (per > 0 and math.isfinite(per)):
            continue
        # a queue the ready replicas drain within the TTFT target is the queueing the model plans for (a
        # heavy-tailed prompt holding a replica for seconds piles up a few; the next decision sees it)
        if queue < target.ttft_target * max(serving_now, 1) * per:
            continue
        need = math.ceil((serving_now * per + growth + queue / horizon) / per - 1e-9)
        if need > current:
            asks[role] = need
    if not asks:
        return None, memory
    p_limit = max(min(target.prefill_max, MAX_REPLICAS), target.floor_prefill)
    d_limit = max(min(target.decode_max, MAX_REPLICAS), target.floor_decode)
    p = min(max(asks.get("prefill", target.prefill), target.prefill), p_limit)
    d = min(max(asks.get("decode", target.decode), target.decode), d_limit)
    p, d, limited = fit_budget(p, d, target)
    p, d = max(p, min(target.prefill, p_limit)), max(d, min(target.decode, d_limit))
    if p <= target.prefill and d <= target.decode:
        return None, memory
    if p > target.prefill:
        memory = replace(memory, last_scale_up_prefill=now)
    if d > target.decode:
        memory = replace(memory, last_scale_up_decode=now)
    reason = BUDGET_LIMITED if limited else SCALED
    message = (f"queue growing: prefill {target.prefill}->{p} (waiting {obs.prefill_queue or 0:.0f}, "
               f"+{obs.prefill_queue_growth or 0:.2g}/s), decode {target.decode}->{d} "
               f"(waiting {obs.decode_queue or 0:.0f}, +{obs.decode_queue_growth or 0:.2g}/s)")
    return Decision(RoleDecision(p, asks.get("prefill", p), reason), RoleDecision(d, asks.get("decode", d), reason),
                    reason, message, True, obs.inputs()), memory


def _sized_rates(obs: Observation, memory: Memory, load: Load, horizon: int,
                 target: Target) -> tuple[Memory, float, float]:
    """``(memory, prefill rate, decode rate)``: the request rate each role is sized for, at the planned
    token mix: the forecast plus the burst headroom of the role's work (uncached prompt tokens/s,
    output tokens/s), never past the most work seen within :data:`BURST_MEMORY`."""
    rate = load.rate
    # this interval's observed work (at the planned mix where the interval has no token figures)
    in_tokens = obs.input_tokens_mean if obs.input_tokens_mean is not None else load.input_mean
    out_tokens = obs.output_tokens_mean if obs.output_tokens_mean is not None else load.output_mean
    uncached = 1.0 - min(max(obs.prefix_hit_ratio or 0.0, 0.0), 0.99)
    per_p = load.input_mean * (1.0 - min(max(load.prefix_hit, 0.0), 0.99))
    per_d = load.output_mean
    # one interval's work is a compound Poisson sum: its variance per request is E[tokens^2], which a
    # heavy-tailed prompt mix makes large (swings of that size are noise, not a burst to hold capacity for)
    mix = serving.PromptMix(load.input_mean, max(load.input_p, load.input_mean), target.percentile,
                            load.input_tail)
    unit_p = max(load.input_mean * math.exp(mix.sigma ** 2), 1.0) * (per_p / max(load.input_mean, 1.0))
    keep = len(memory.rate)
    sized = []
    for role, observed, per, unit in (("prefill", obs.request_rate * in_tokens * uncached, per_p, unit_p),
                                      ("decode", obs.request_rate * out_tokens, per_d, max(per_d, 1.0))):
        series, forecasts = getattr(memory, f"{role}_work"), getattr(memory, f"forecast_{role}_work")
        rise = ((observed - forecasts[-1]) / math.sqrt(max(observed, 1e-9) * unit / max(target.interval, 1.0))
                if forecasts and observed > forecasts[-1] else 0.0)
        memory = replace(memory, **{f"rise_{role}": rise})
        series = (series + (observed,))[-keep:]
        headroom, ceiling = burst_headroom(series, forecasts, horizon, target.interval, unit)
        forecast = rate * per
        memory = replace(memory, **{f"{role}_work": series,
                                    f"forecast_{role}_work": (forecasts + (forecast,))[-len(series):]})
        work = max(forecast, min(forecast + headroom, ceiling))
        sized.append(max(work / per, rate) if per > 0 else rate)
    return memory, sized[0], sized[1]


def burst_headroom(rates: tuple[float, ...], forecasts: tuple[float, ...], horizon: int,
                   interval: float, unit: float = 1.0) -> tuple[float, float]:
    """``(headroom, ceiling)`` in the series' units (requests/s, or a role's tokens/s): the largest rise of
    the observed series above what the planner forecast for it within ``horizon`` intervals (what a
    start-up and an interval leave to the replicas already running), over the last :data:`BURST_MEMORY`
    seconds, less :data:`BURST_NOISE` Poisson standard deviations of one interval's value (the queueing
    model already holds Poisson arrivals; ``unit`` is a request's second moment over its mean, in the
    series' units: 1 for requests, E[tokens^2] / E[tokens] for tokens); and the highest value seen over
    that time, which headroom never sizes past (a level never seen is not anticipated).
    ``forecasts[i]`` is the value sized for after ``rates[i]`` was observed; both oldest first."""
    keep = max(int(BURST_MEMORY / max(interval, 1.0)), 1)
    rates = rates[-keep:]
    forecasts = forecasts[-len(rates) + 1:] if len(rates) > 1 else ()
    # forecasts[j] was made after rates[off + j]; the load it had to carry is rates[off + j + 1 ...]
    off = len(rates) - 1 - len(forecasts)
    best = 0.0
    for j, f in enumerate(forecasts):
        ahead = rates[off + j + 1: off + j + 1 + max(horizon, 1)]
        peak = max(ahead)
        best = max(best, peak - f - BURST_NOISE * math.sqrt(max(peak, 0.0) * unit / max(interval, 1.0)))
    return best, max(rates, default=0.0)


def _backlog(queue: float | None, rate: float, capacity: float, startup: float) -> float:
    """Requests waiting once new replicas are up: those waiting now plus the shortfall meanwhile."""
    return (queue or 0.0) + max(rate - capacity, 0.0) * startup if queue else 0.0


def _prefill_capacity(model: RoleModels, load: Load, replicas: int, percentile: float) -> float:
    work = _work(model, load, percentile)
    return replicas * work.servers / work.mean if work.mean > 0 else math.inf


def _decode_capacity(model: RoleModels, load: Load, replicas: int, itl_target: float) -> float:
    """Requests/s that ``replicas`` decode replicas finish at their planned batch."""
    batch, ctx = serving.decode_batch(model.decode, load.input_mean, load.output_mean, itl_target)
    per_request = load.output_mean * model.decode.itl(batch, ctx)
    return replicas * batch / per_request if per_request > 0 else math.inf


def _correct(obs: Observation, target: Target, memory: Memory, model: PerfModel | RoleModels,
             ttft_obs: float | None, itl_obs: float | None) -> Memory:
    """Online correction: compare what was observed with what the model predicts for the observed load on
    the current size. Only from steady intervals (Ready, no rollout) with traffic and a full set of token
    figures; TTFT is prefill's only while nothing waits for decode admission."""
    if (not target.ready or target.rolling or not obs.request_rate or obs.input_tokens_mean is None
            or obs.output_tokens_mean is None):
        return memory
    corr = memory.correction
    planning = RoleModels.of(model).corrected(corr.prefill, corr.decode)
    load = Load(obs.request_rate, obs.input_tokens_mean, obs.input_tokens_p or obs.input_tokens_mean,
                obs.output_tokens_mean, obs.prefix_hit_ratio, obs.input_tokens_tail)
    if (obs.decode_queue or 0.0) >= 1.0:  # memory-bound decode: neither latency measures the model
        ttft_obs = itl_obs = None
    previous = memory.rate[-1] if memory.rate else None
    if previous is None or abs(obs.request_rate - previous) > LOAD_STEP * max(previous, obs.request_rate):
        # the load moved within the window: its latency is the backlog of the transition (queueing that
        # the steady-state model does not claim to predict), not a slower or faster engine
        ttft_obs = itl_obs = None
    ttft_pred = prefill_latency(planning, load, max(target.prefill, 1), target.percentile)
    itl_pred = decode_latency(planning, load, max(target.decode, 1), target.itl_target)
    # learn only where it matters for sizing: near the target (far below it, fixed overheads such as
    # network and routing would be mistaken for a slower GPU). Overheads only ever add latency, so far
    # below the target an interval faster than predicted still undoes a learnt slowdown (down to the
    # model, not past it): else one noisy interval of a heavy-tailed mix (a 100k-token prompt in a
    # 30 s window) teaches a slowdown that the over-sized deployment it causes can never unlearn, as
    # its latency stays far below the target
    floors = {}
    for phase, observed, predicted, slo in (("prefill", ttft_obs, ttft_pred, target.ttft_target),
                                            ("decode", itl_obs, itl_pred, target.itl_target)):
        if math.isfinite(predicted) and max(observed or 0.0, predicted) >= LEARN_ABOVE * slo:
            floors[phase] = 0.0
        elif (math.isfinite(predicted) and observed is not None and observed < predicted
              and getattr(corr, phase) > 1.0):
            floors[phase] = 1.0
    # one interval's percentile of a heavy-tailed mix is noisy: it moves the correction by at most
    # LEARN_STEP (before smoothing), so a run of intervals, not one, is what makes the model slower
    learnt = corr.observe(_within(ttft_obs, ttft_pred) if "prefill" in floors else None, ttft_pred,
                          _within(itl_obs, itl_pred) if "decode" in floors else None, itl_pred)
    learnt = replace(learnt, prefill=max(learnt.prefill, floors.get("prefill", 0.0)),
                     decode=max(learnt.decode, floors.get("decode", 0.0)))
    return replace(memory, correction=learnt)


def _within(observed: float | None, predicted: float) -> float | None:
    if observed is None or not math.isfinite(predicted) or predicted <= 0:
        return observed
    return min(max(observed, predicted / LEARN_STEP), predicted * LEARN_STEP)


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _ms(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    return f"{seconds * 1000:.0f}ms"
