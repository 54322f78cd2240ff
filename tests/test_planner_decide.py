"""The planner's pure decision logic and predictors: no cluster, no Prometheus."""

import math
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from disagg.api import v1alpha1 as api
from disagg.perf import model as pm
from disagg.perf import serving
from disagg.perf.model import PerfModel
from disagg.planner import decide as dc
from disagg.planner import predictors

MODEL = PerfModel.analytic("meta-llama/Llama-3.1-8B-Instruct", "H100-SXM")


def obs(rate=2.0, ttft=0.5, itl=0.02, inp=4000, inp_p=None, out=300, hit=0.0, t=0.0, **kw):
    return dc.Observation(time=t, request_rate=rate, ttft=ttft, itl=itl, input_tokens_mean=inp,
                          input_tokens_p=inp_p or inp * 1.5, output_tokens_mean=out, output_tokens_p=out * 1.5,
                          prefix_hit_ratio=hit, **kw)


def target(**kw):
    base = dict(prefill=2, decode=2, ttft_target=1.0, itl_target=0.05, cooldown=300.0)
    base.update(kw)
    return dc.Target(**base)


# ---------------------------------------------------------------- predictors

def test_predictor_registry_refuses_unknown_and_duplicates():
    assert predictors.names() == sorted(p.value for p in api.Predictor)
    assert predictors.get().name == predictors.DEFAULT == "moving-average"
    with pytest.raises(ValueError, match="unknown predictor"):
        predictors.get("crystal-ball")
    with pytest.raises(ValueError, match="already registered"):
        predictors.register("last-value", predictors.LastValue)


def test_predictors_on_known_series():
    assert predictors.get("last-value").predict([1, 2, 7]) == 7
    assert predictors.get("moving-average", window=2).predict([1, 2, 4]) == 3
    assert predictors.get("moving-average").predict([]) == 0
    ramp = [float(i) for i in range(20)]
    assert predictors.get("holt-winters").predict(ramp) == pytest.approx(20, abs=0.5)  # follows the trend
    season = [10.0, 20.0, 30.0, 20.0] * 6
    hw = predictors.get("holt-winters", season=4).predict(season)
    assert hw == pytest.approx(season[len(season) % 4], abs=2.0)  # knows what comes next in the cycle
    assert abs(predictors.get("moving-average").predict(season) - season[0]) > 5  # an average does not
    assert predictors.get("holt-winters").predict([5.0, 0.0, 0.0]) >= 0  # never negative


# ---------------------------------------------------------------- sizing and decisions

def test_ttft_breach_scales_prefill_up_and_itl_breach_scales_decode_up():
    t = target(prefill=1, decode=1)
    d, _ = dc.decide(obs(rate=0.2, ttft=3.0, itl=0.02), t, dc.Memory(), MODEL, now=0)
    assert d.prefill.replicas > 1 and d.decode.replicas == 1 and d.reason == dc.SCALED
    d, _ = dc.decide(obs(rate=0.2, ttft=0.3, itl=0.2), t, dc.Memory(), MODEL, now=0)
    assert d.prefill.replicas == 1 and d.decode.replicas > 1


def test_scale_down_waits_for_the_cooldown_then_steps_down_slowly():
    t = target(prefill=8, decode=8, cooldown=300)
    mem = dc.Memory()
    d, mem = dc.decide(obs(rate=0.1), t, mem, MODEL, now=0)
    assert (d.prefill.replicas, d.decode.replicas) == (8, 8) and d.reason == dc.COOLDOWN
    d, mem = dc.decide(obs(rate=0.1), t, mem, MODEL, now=299)
    assert (d.prefill.replicas, d.decode.replicas) == (8, 8)
    d, mem = dc.decide(obs(rate=0.1), t, mem, MODEL, now=301)
    assert d.prefill.replicas == 6 and d.decode.replicas == 6  # a quarter per interval, not all at once
    sizes = []
    cur = t
    for i in range(10):
        d, mem = dc.decide(obs(rate=0.1), cur, mem, MODEL, now=330 + 30 * i)
        cur = dc.Target(**{**cur.__dict__, "prefill": d.prefill.replicas, "decode": d.decode.replicas})
        sizes.append((d.prefill.replicas, d.decode.replicas))
    assert sizes[-1] == (1, 1) and all(a >= b for a, b in zip(sizes, sizes[1:]))


def test_a_scale_up_restarts_the_cooldown():
    t = target(prefill=2, decode=2, cooldown=100)
    mem = dc.Memory()
    _, mem = dc.decide(obs(rate=0.1), t, mem, MODEL, now=0)
    up, mem = dc.decide(obs(rate=0.1, ttft=5.0), t, mem, MODEL, now=150)
    assert up.prefill.replicas == 3
    t3 = target(prefill=3, decode=2, cooldown=100)
    held, mem = dc.decide(obs(rate=0.1), t3, mem, MODEL, now=200)
    assert held.prefill.replicas == 3 and held.prefill.reason == dc.COOLDOWN
    assert held.decode.replicas == 1  # decode's cooldown was not restarted
    down, _ = dc.decide(obs(rate=0.1), t3, mem, MODEL, now=251)
    assert down.prefill.replicas == 2


def test_no_scale_down_while_latency_is_above_target():
    t = target(prefill=6, decode=6, cooldown=0)
    d, _ = dc.decide(obs(rate=0.1, ttft=1.5, itl=0.06), t, dc.Memory(), MODEL, now=0)
    assert d.prefill.replicas >= 6 and d.decode.replicas >= 6


@pytest.mark.parametrize("ready,rolling,reason", [(False, False, dc.NOT_READY), (True, True, dc.ROLLING_OUT)])
def test_hold_when_not_ready_or_rolling_out_unless_saturated(ready, rolling, reason):
    t = target(prefill=2, decode=2, ready=ready, rolling=rolling, cooldown=0)
    busy = obs(rate=20.0, ttft=1.5, itl=0.04)  # model wants more, but not saturated
    d, _ = dc.decide(busy, t, dc.Memory(), MODEL, now=0)
    assert (d.prefill.replicas, d.decode.replicas) == (2, 2) and d.reason == reason
    idle = obs(rate=0.01)
    d, _ = dc.decide(idle, t, dc.Memory(), MODEL, now=0)
    assert (d.prefill.replicas, d.decode.replicas) == (2, 2)
    saturated = obs(rate=20.0, ttft=5.0, itl=0.04)
    d, _ = dc.decide(saturated, t, dc.Memory(), MODEL, now=0)
    assert d.prefill.replicas > 2 and d.decode.replicas >= 2


@pytest.mark.parametrize("o,reason", [
    (dc.Observation.unavailable(0, "connection refused"), dc.PROMETHEUS_UNREACHABLE),
    (dc.Observation(time=0, request_rate=math.nan), dc.METRICS_UNAVAILABLE),
    (dc.Observation(time=0, request_rate=None), dc.METRICS_UNAVAILABLE),
    (dc.Observation(time=0, request_rate=3.0, missing=("ttft",)), dc.METRICS_UNAVAILABLE),
])
def test_missing_metrics_hold_and_say_why(o, reason):
    for p, d_ in ((3, 4), (0, 0)):
        t = target(prefill=p, decode=d_)
        d, mem = dc.decide(o, t, dc.Memory(), MODEL, now=0)
        assert d.reason == reason and not d.metrics_ok
        assert d.prefill.replicas == max(p, 1) and d.decode.replicas == max(d_, 1)  # hold, never zero
        assert mem == dc.Memory()
        if o.error:
            assert o.error in d.message


def test_prefix_hits_need_fewer_prefill_replicas():
    load = dc.Load(rate=10, input_mean=12000, input_p=20000, output_mean=300)
    cold, _ = dc.size_prefill(MODEL, load, 2.0, 90)
    warm, _ = dc.size_prefill(MODEL, dc.Load(10, 12000, 20000, 300, prefix_hit=0.7), 2.0, 90)
    assert warm < cold


def test_sized_deployment_meets_its_predicted_targets():
    load = dc.Load(rate=8, input_mean=3000, input_p=6000, output_mean=400)
    n, ttft = dc.size_prefill(MODEL, load, 1.0, 90)
    assert ttft <= 1.0 and dc.prefill_latency(MODEL, load, n - 1, 90) > 1.0
    n, itl = dc.size_decode(MODEL, load, 0.04, 90)
    assert itl <= 0.04


def test_online_correction_learns_a_slower_reality():
    slow = MODEL.corrected(2.0, 2.0)
    t = target(prefill=2, decode=2, cooldown=0)
    mem = dc.Memory()
    for i in range(15):
        load = dc.Load(4, 4000, 6000, 300)
        o = obs(rate=4, inp=4000, inp_p=6000, out=300, t=i * 30,
                ttft=dc.prefill_latency(slow, load, t.prefill, 90), itl=dc.decode_latency(slow, load, t.decode, 0.05))
        d, mem = dc.decide(o, t, mem, MODEL, now=i * 30)
        t = target(prefill=d.prefill.replicas, decode=d.decode.replicas, cooldown=0)
    assert mem.correction.prefill > 1.5 and mem.correction.decode > 1.3
    honest, _ = dc.size_prefill(slow, dc.Load(4, 4000, 6000, 300), 1.0, 90)
    assert t.prefill >= honest


def test_target_from_the_api_spec():
    spec = api.DisaggDeploymentSpec.model_validate({
        "model": {"name": "m", "source": "hf://x/y"},
        "prefill": {"replicas": 2, "tensorParallelSize": 2, "maxReplicas": 6},
        "decode": {"replicas": 3, "minReplicas": 2},
        "scheduling": {"gang": {"minPrefill": 1, "minDecode": 1}},
        "slo": {"ttftMs": 500, "itlMs": 40, "percentile": 99},
        "planner": {"enabled": True, "gpuBudget": 16, "scaleDownCooldownSeconds": 120, "predictor": "holt-winters",
                    "replicaStartupSeconds": 120, "seasonSeconds": 86400}})
    t = dc.Target.from_spec(spec)
    assert (t.prefill, t.decode, t.prefill_tp, t.decode_tp) == (2, 3, 2, 1)
    assert (t.floor_prefill, t.floor_decode, t.prefill_max, t.gpu_budget) == (1, 2, 6, 16)
    assert (t.ttft_target, t.itl_target, t.percentile, t.cooldown, t.predictor) == (0.5, 0.04, 99, 120, "holt-winters")
    assert (t.startup, t.season) == (120, 86400 // 30)
    default = dc.Target.from_spec(api.DisaggDeploymentSpec.model_validate({
        "model": {"name": "m", "source": "hf://x/y"}, "slo": {"ttftMs": 500, "itlMs": 40}}))
    assert (default.startup, default.season) == (90, 0)


def test_a_replica_spanning_pods_counts_every_gpu_of_its_pods_against_the_budget():
    """A prefill replica of 2 pods x 8 GPUs (data parallel 16 with expert parallel, tensor 1) holds 16 GPUs:
    not its tensor size (1), nor one pod's 8."""
    spec = api.DisaggDeploymentSpec.model_validate({
        "model": {"name": "m", "source": "hf://x/y"},
        "prefill": {"replicas": 1, "podsPerReplica": 2, "parallelism": {"data": 16, "expert": True}},
        "decode": {"replicas": 1, "parallelism": {"tensor": 8}},
        "scheduling": {"gang": {"minPrefill": 1, "minDecode": 1}},
        "slo": {"ttftMs": 500, "itlMs": 40}, "planner": {"enabled": True, "gpuBudget": 40}})
    t = dc.Target.from_spec(spec)
    assert t.replica_gpus == (16, 8) and t.gpus(2, 1) == 40
    # asked 3 + 2 (64 GPUs) under a budget of 40: one more 16-GPU prefill replica fits above the floors, and no
    # decode beside it (counted by one pod's GPUs, 3 x 8 + 2 x 8 = 40 would have looked like it fit; by tensor
    # size, 3 x 1 + 2 x 8 = 19)
    assert dc.fit_budget(3, 2, t) == (2, 1, True)


def test_a_season_from_the_spec_lets_the_planner_see_a_burst_coming():
    """Four quiet intervals then a burst, every eight: after one cycle, the seasonal planner is ready
    for the burst before it arrives; the trend-only one is not."""
    cycle = [1.0] * 4 + [30.0] * 4
    history = cycle * 2 + [1.0] * 3  # the next burst starts in one or two intervals
    sized = {}
    for season in (0, 8):
        t = target(prefill=1, decode=1, predictor="holt-winters", season=season, interval=30, startup=30)
        mem = dc.Memory(rate=tuple(history[:-1]))
        d, _ = dc.decide(obs(rate=history[-1]), t, mem, MODEL, now=0)
        sized[season] = d.prefill.replicas + d.decode.replicas
    assert sized[8] > sized[0]


def test_burst_headroom_is_the_rise_above_forecast_within_a_startup():
    interval, horizon = 30.0, 4
    flat = (6.0, 6.4, 5.7, 6.2, 5.9, 6.5, 6.0)   # Poisson noise at 6 requests/s: no headroom
    assert dc.burst_headroom(flat, flat[:-1], horizon, interval) == (0.0, 6.5)
    step = (6.0,) * 10 + (12.0,) * 3              # forecast 6, then 12 within a start-up
    headroom, ceiling = dc.burst_headroom(step, step[:-1], horizon, interval)
    assert headroom == pytest.approx(12 - 6 - dc.BURST_NOISE * (12 / interval) ** 0.5) and ceiling == 12
    # forgotten after BURST_MEMORY seconds of no rise
    later = step + (12.0,) * int(dc.BURST_MEMORY / interval)
    assert dc.burst_headroom(later, later[:-1], horizon, interval) == (0.0, 12.0)
    # a forecast that saw the rise coming leaves nothing to hold
    assert dc.burst_headroom(step, (12.0,) * 12, horizon, interval)[0] == 0.0
    assert dc.burst_headroom((), (), horizon, interval) == (0.0, 0.0)


def test_a_burst_seen_is_held_up_to_its_peak_and_the_planner_does_not_flap():
    """Square bursts (3 -> 30 requests/s, four intervals each): the first is met late (a start-up), the
    ones after find the size already there: no shrinking between bursts, never sized past the peak."""
    t = target(prefill=1, decode=1, predictor="holt-winters", season=8, interval=30, startup=90, cooldown=300)
    cycle = [3.0] * 4 + [30.0] * 4
    mem, sizes, sized, forecast = dc.Memory(), [], [], []
    for i, r in enumerate(cycle * 4):
        d, mem = dc.decide(obs(rate=r, ttft=0.3, itl=0.02, inp=3000), t, mem, MODEL, now=30.0 * i)
        t = replace(t, prefill=d.prefill.replicas, decode=d.decode.replicas)
        sizes.append((d.prefill.replicas, d.decode.replicas))
        sized.append(d.prediction["sizedRate"])
        forecast.append(d.prediction["requestRate"])
    # headroom never sizes past the peak seen (the forecast itself may: Holt's trend before a season)
    assert all(s <= max(f, 30.0) + 1e-9 for s, f in zip(sized, forecast))
    # once a season is seen, the seasonal forecast stays within its peak (additive Holt-Winters overshoots
    # a square burst), and so does the size
    assert max(forecast[9:]) <= 30.0 + 1e-9 and max(sized[9:]) <= 30.0 + 1e-9
    # after the first burst: only down (the trend's overshoot, slowly, after the cooldown), never shrunk
    # in a quiet phase and regrown for the next burst; the last cycle holds the size its bursts need
    after_first = sizes[8:]
    assert all(b[0] <= a[0] and b[1] <= a[1] for a, b in zip(after_first, after_first[1:])), sizes
    burst_need = dc.decide(obs(rate=30.0, ttft=0.3, itl=0.02, inp=3000), replace(t, season=0), dc.Memory(),
                           MODEL, now=0)[0]
    assert set(sizes[-8:]) == {(burst_need.prefill.needed, burst_need.decode.needed)}, sizes
    assert sizes[-8:][0] > sizes[1]           # the quiet intervals before the first burst were smaller


# ---------------------------------------------------------------- properties

configs = st.fixed_dictionaries({
    "prefill": st.integers(0, 40), "decode": st.integers(0, 40),
    "prefill_tp": st.sampled_from([1, 2, 4]), "decode_tp": st.sampled_from([1, 2, 4]),
    "prefill_min": st.integers(1, 4), "decode_min": st.integers(1, 4),
    "budget_slack": st.one_of(st.none(), st.integers(0, 64)),
    "ready": st.booleans(), "rolling": st.booleans(), "cooldown": st.sampled_from([0.0, 60.0, 600.0]),
    "ttft_target": st.sampled_from([0.3, 1.0, 3.0]), "itl_target": st.sampled_from([0.02, 0.05, 0.1]),
    "predictor": st.sampled_from(predictors.names()),
})
loads = st.fixed_dictionaries({
    "rate": st.floats(0, 200), "inp": st.floats(16, 32000), "out": st.floats(1, 2000),
    "hit": st.floats(0, 0.95), "ttft": st.one_of(st.none(), st.floats(0, 30)),
    "itl": st.one_of(st.none(), st.floats(0, 1)),
})


def _target(c):
    budget = None
    if c["budget_slack"] is not None:
        budget = c["prefill_min"] * c["prefill_tp"] + c["decode_min"] * c["decode_tp"] + c["budget_slack"]
    return dc.Target(prefill=c["prefill"], decode=c["decode"], ttft_target=c["ttft_target"],
                     itl_target=c["itl_target"], prefill_tp=c["prefill_tp"], decode_tp=c["decode_tp"],
                     prefill_min=c["prefill_min"], decode_min=c["decode_min"], gpu_budget=budget,
                     cooldown=c["cooldown"], predictor=c["predictor"], ready=c["ready"], rolling=c["rolling"])


def _obs(load, rate=None):
    return dc.Observation(time=0, request_rate=load["rate"] if rate is None else rate, ttft=load["ttft"],
                          itl=load["itl"], input_tokens_mean=load["inp"], input_tokens_p=load["inp"] * 1.5,
                          output_tokens_mean=load["out"], output_tokens_p=load["out"] * 2,
                          prefix_hit_ratio=load["hit"])


@settings(max_examples=300, deadline=None)
@given(c=configs, load=loads, history=st.lists(st.floats(0, 200), max_size=6), now=st.floats(0, 5000),
       outage=st.sampled_from([None, "error", "missing"]))
def test_never_below_gang_minimum_never_zero_never_above_budget(c, load, history, now, outage):
    t = _target(c)
    mem = dc.Memory(rate=tuple(history))
    o = _obs(load)
    if outage == "error":
        o = dc.Observation.unavailable(now, "connection refused")
    elif outage == "missing":
        o = replace(o, missing=("ttft",))
    d, _ = dc.decide(o, t, mem, MODEL, now=now)
    assert d.prefill.replicas >= max(1, c["prefill_min"]) and d.decode.replicas >= max(1, c["decode_min"])
    if t.gpu_budget is not None:
        assert t.gpus(d.prefill.replicas, d.decode.replicas) <= t.gpu_budget


@settings(max_examples=300, deadline=None)
@given(c=configs, load=loads, r1=st.floats(0, 200), r2=st.floats(0, 200))
def test_monotone_in_load(c, load, r1, r2):
    lo, hi = sorted((r1, r2))
    t = _target(c)
    a, _ = dc.decide(_obs(load, lo), t, dc.Memory(), MODEL, now=0)
    b, _ = dc.decide(_obs(load, hi), t, dc.Memory(), MODEL, now=0)
    if t.gpu_budget is None:
        assert b.prefill.replicas >= a.prefill.replicas and b.decode.replicas >= a.decode.replicas
    else:
        assert t.gpus(b.prefill.replicas, b.decode.replicas) >= t.gpus(a.prefill.replicas, a.decode.replicas) \
            or t.gpus(b.prefill.replicas, b.decode.replicas) >= t.gpu_budget - max(t.prefill_tp, t.decode_tp) + 1


@settings(max_examples=200, deadline=None)
@given(rate=st.floats(0, 500), inp=st.floats(16, 32000), out=st.floats(1, 4000), hit=st.floats(0, 0.95),
       f=st.floats(1.0, 3.0))
def test_sizing_is_monotone_in_rate(rate, inp, out, hit, f):
    a = dc.Load(rate, inp, inp * 1.5, out, hit)
    b = dc.Load(rate * f, inp, inp * 1.5, out, hit)
    assert dc.size_prefill(MODEL, b, 1.0, 90)[0] >= dc.size_prefill(MODEL, a, 1.0, 90)[0]
    assert dc.size_decode(MODEL, b, 0.05, 90)[0] >= dc.size_decode(MODEL, a, 0.05, 90)[0]


@settings(max_examples=200, deadline=None)
@given(p=st.integers(1, 200), d=st.integers(1, 200), tpp=st.sampled_from([1, 2, 8]), tpd=st.sampled_from([1, 4]),
       slack=st.integers(0, 100))
def test_fit_budget_stays_within_budget_and_above_floors(p, d, tpp, tpd, slack):
    t = dc.Target(prefill=1, decode=1, ttft_target=1, itl_target=0.05, prefill_tp=tpp, decode_tp=tpd,
                  gpu_budget=tpp + tpd + slack)
    fp, fd, limited = dc.fit_budget(p, d, t)
    assert 1 <= fp <= p and 1 <= fd <= d
    assert t.gpus(fp, fd) <= t.gpu_budget
    assert limited == (t.gpus(p, d) > t.gpu_budget)
    assume(limited)
    # nothing left that could still be handed out
    assert not (fp < p and t.gpus(fp + 1, fd) <= t.gpu_budget) and not (fd < d and t.gpus(fp, fd + 1) <= t.gpu_budget)


def test_ttft_breach_with_requests_waiting_for_decode_grows_decode_not_prefill():
    t = target(prefill=2, decode=2, cooldown=0)
    d, _ = dc.decide(obs(rate=0.5, ttft=4.0, itl=0.02, prefill_queue=0, decode_queue=30), t, dc.Memory(), MODEL, now=0)
    assert d.decode.replicas > 2 and d.prefill.replicas <= 2


def test_far_below_target_latency_does_not_teach_the_correction():
    t = target(prefill=2, decode=2)
    mem = dc.Memory()
    for i in range(10):  # 300 ms of fixed overhead on a 1 s target at light load: not a slower GPU
        _, mem = dc.decide(obs(rate=1, ttft=0.3, itl=0.01), t, mem, MODEL, now=i * 30)
    assert mem.correction.prefill == 1.0 and mem.correction.decode == 1.0


def test_no_scale_down_while_latency_is_near_target():
    t = target(prefill=6, decode=6, cooldown=0)
    near, _ = dc.decide(obs(rate=0.1, ttft=0.9, itl=0.045), t, dc.Memory(), MODEL, now=0)
    assert (near.prefill.replicas, near.decode.replicas) == (6, 6)
    assert near.prefill.reason == near.decode.reason == dc.STEADY
    clear, _ = dc.decide(obs(rate=0.1, ttft=0.5, itl=0.02), t, dc.Memory(), MODEL, now=0)
    assert clear.prefill.replicas < 6 and clear.decode.replicas < 6  # the same load, latency well inside: shrinks


def test_an_infinite_observed_latency_is_a_breach():
    t = target(prefill=2, decode=2, cooldown=0)
    d, mem = dc.decide(obs(rate=0.2, ttft=math.inf, itl=0.02), t, dc.Memory(), MODEL, now=0)
    assert d.prefill.replicas > 2 and mem.correction.prefill == 1.0  # grows; nothing learnt from inf


def test_prefill_is_sized_from_the_prompt_distribution_and_a_low_correction_keeps_capacity():
    """Issue 13's flat heavy-tailed load (4 requests/s, median ~12k, p90 ~39k prompt tokens): the mean
    service of the mix, not of a representative prompt, sets the capacity; and a correction learnt below 1
    (the engine's tail shorter than the queueing model's) never shrinks prefill past that capacity."""
    load = dc.Load(4.0, 18300, 39000, 70)
    work = dc._work(dc.RoleModels.of(MODEL), load, 90)
    capacity = math.ceil(4.0 * work.mean / serving.PREFILL_MAX_UTILIZATION)
    assert work.mean > MODEL.ttft(18300)  # attention is quadratic: the mix costs more than its mean prompt
    n, _ = dc.size_prefill(MODEL, load, 4.0, 90)
    assert n >= capacity
    t = target(prefill=capacity, decode=2, cooldown=0, ttft_target=4.0)
    mem = dc.Memory(correction=pm.OnlineCorrection(prefill=0.5))
    o = obs(rate=4.0, inp=18300, inp_p=39000, out=70, ttft=1.5, itl=0.02)
    for i in range(5):
        d, mem = dc.decide(o, t, replace(mem, correction=pm.OnlineCorrection(prefill=0.5)), MODEL, now=30 * i)
        assert d.prefill.replicas >= capacity
        t = replace(t, prefill=d.prefill.replicas, decode=d.decode.replicas)


def test_no_learning_from_a_load_step():
    slow = MODEL.corrected(2.0, 2.0)
    t = target(prefill=2, decode=2, cooldown=0)
    load = dc.Load(3, 8000, 12000, 300)   # the slow engine's TTFT near the 1 s target (learnable)
    steady = obs(rate=3, inp=8000, inp_p=12000, out=300, ttft=dc.prefill_latency(slow, load, 2, 90),
                 itl=dc.decode_latency(slow, load, 2, 0.05))
    assert steady.ttft > dc.LEARN_ABOVE * t.ttft_target
    _, mem = dc.decide(steady, t, dc.Memory(rate=(1.0,)), MODEL, now=0)   # from 1 to 3 requests/s
    assert mem.correction == pm.OnlineCorrection()
    _, mem = dc.decide(steady, t, dc.Memory(rate=(3.0,)), MODEL, now=0)   # steady at 3
    assert mem.correction.prefill > 1.0


def test_burst_headroom_is_over_each_roles_work_not_the_request_rate():
    """A tenant mix that shifts to long prompts at a steady request rate (RAG traffic stepping up under
    steady chat) is a rise of prefill work: once seen, prefill holds headroom for it; decode, whose
    output tokens/s did not move, does not."""
    t = target(prefill=2, decode=2, cooldown=0, interval=30, startup=90)
    mem = dc.Memory()
    mix = [2000.0] * 10 + [6000.0] * 3 + [2000.0] * 3
    for i, inp in enumerate(mix):
        d, mem = dc.decide(obs(rate=4.0, inp=inp, inp_p=inp * 1.5, out=300, ttft=0.3, itl=0.02, t=30 * i), t, mem,
                           MODEL, now=30 * i)
    p = d.prediction
    assert p["requestRate"] == pytest.approx(4.0)
    assert p["sizedDecodeRate"] == pytest.approx(4.0)       # output tokens/s never rose
    # prefill is sized for a rise of prompt tokens/s like the one seen (3x the work; never past the most seen)
    assert p["sizedPrefillRate"] > 1.5 * p["requestRate"]
    assert p["sizedRate"] == p["sizedPrefillRate"]
    # the rate-only headroom saw nothing to hold
    assert dc.burst_headroom(mem.rate, mem.forecast, 4, 30.0)[0] == 0.0


def test_one_noisy_slow_interval_is_unlearnt_far_below_target():
    """A heavy-tailed mix's p90 swings: one interval at several times the predicted TTFT moves the
    correction by at most LEARN_STEP (before smoothing), and the faster-than-predicted intervals that
    follow, far below the target, bring it back to the model (never below it, where fixed overheads
    could not be told from a faster engine)."""
    t = target(prefill=2, decode=2, cooldown=0, ttft_target=4.0)
    load = dc.Load(3.0, 8000, 12000, 150)
    predicted = dc.prefill_latency(MODEL, load, 2, 90)
    o = obs(rate=3.0, inp=8000, inp_p=12000, out=150, itl=0.02)
    _, mem = dc.decide(replace(o, ttft=max(10 * predicted, 3.0)), t, dc.Memory(rate=(3.0,)), MODEL, now=0)
    assert 1.0 < mem.correction.prefill <= dc.LEARN_STEP ** mem.correction.alpha + 1e-9
    for i in range(1, 15):   # the engine as fast as the model says, far below the 4 s target
        _, mem = dc.decide(replace(o, ttft=predicted * 0.9), t, mem, MODEL, now=30 * i)
    assert mem.correction.prefill == pytest.approx(1.0)
    # far below target a faster-than-predicted interval does not teach a correction below the model
    _, mem = dc.decide(replace(o, ttft=predicted * 0.5), t, dc.Memory(rate=(3.0,)), MODEL, now=0)
    assert mem.correction.prefill == 1.0


# ---------------------------------------------------------------- capacity from saturation, the fast path

def _saturated_prefill_tokens(scale, o):
    """Uncached prompt tokens/s one prefill replica does at ``scale`` x the model's service time."""
    load = dc.Load(o.request_rate, o.input_tokens_mean, o.input_tokens_p, o.output_tokens_mean, o.prefix_hit_ratio)
    work = dc._work(dc.RoleModels.of(MODEL), load, 90.0)
    return o.input_tokens_mean * (1 - o.prefix_hit_ratio) / work.mean / scale


def test_capacity_measured_while_saturated_is_learnt_and_sizes_a_slower_reality():
    base = obs(rate=6.0, ttft=0.4, itl=0.02)
    # hardware 1.5x slower than the model: the saturated replicas do 1/1.5 of the predicted work
    slow = replace(base, prefill_saturated_tokens=_saturated_prefill_tokens(1.5, base),
                   decode_saturated_batch=40.0,
                   decode_saturated_tokens=MODEL.decode_throughput(40.0, 4000 + 150) / 1.5)
    m = dc.learn_capacity(slow, target(), dc.Memory(), MODEL)
    assert m.capacity_prefill == pytest.approx(1.5, rel=1e-6) and m.capacity_decode == pytest.approx(1.5, rel=1e-6)
    # smoothed: a second saturated interval at 1.0 moves it part of the way back, not all
    m2 = dc.learn_capacity(replace(slow, prefill_saturated_tokens=_saturated_prefill_tokens(1.0, base)),
                           target(), m, MODEL)
    assert 1.0 < m2.capacity_prefill < 1.5
    # nothing saturated: nothing learnt
    assert dc.learn_capacity(base, target(), dc.Memory(), MODEL).capacity_prefill is None
    # heavy-tailed prompts: a queue saturates when long prompts cluster, so what was served is heavier than
    # the window's mix; prefill learns nothing from it (decode still does)
    heavy = replace(slow, input_tokens_p=4000 * 5, input_tokens_tail=4000 * 20)
    assert dc._work(dc.RoleModels.of(MODEL), dc.Load(6.0, 4000, 20000, 300, 0.0, 80000), 90.0).cv2 > dc.CAPACITY_MAX_CV2
    mh = dc.learn_capacity(replace(heavy, prefill_saturated_tokens=_saturated_prefill_tokens(1.5, heavy)),
                           target(), dc.Memory(), MODEL)
    assert mh.capacity_prefill is None and mh.capacity_decode == pytest.approx(1.5, rel=1e-6)
    # the slower capacity sizes more replicas for the same load, from the next decision on
    t = target(prefill=1, decode=1)
    for rate in (14.0, 20.0):
        plain, _ = dc.decide(obs(rate=rate, ttft=0.4, itl=0.02, t=30), t, dc.Memory(), MODEL, now=30)
        learnt, _ = dc.decide(obs(rate=rate, ttft=0.4, itl=0.02, t=30), t, m, MODEL, now=30)
        assert learnt.prefill.needed > plain.prefill.needed and learnt.decode.needed >= plain.decode.needed
    assert learnt.prediction["prefillCapacityScale"] == pytest.approx(1.5, rel=1e-3)


def test_observed_latency_adds_a_replica_only_when_the_roles_replicas_all_serve():
    t = target(prefill=2, decode=2)
    breach = obs(rate=0.5, ttft=3.0, itl=0.2, prefill_queue=5.0, decode_queue=0.0)
    d, _ = dc.decide(replace(breach, prefill_ready=2.0, decode_ready=2.0), t, dc.Memory(), MODEL, now=0)
    assert d.prefill.replicas == 3 and d.decode.replicas == 3
    # one of each still starting: the latency measures the old size; the model's ask stands alone
    d, _ = dc.decide(replace(breach, prefill_ready=1.0, decode_ready=1.0), t, dc.Memory(), MODEL, now=0)
    assert d.prefill.replicas == 2 and d.decode.replicas == 2



def test_ttft_past_half_its_target_with_a_backlog_building_adds_prefill_before_a_breach():
    """The SLO margin: TTFT above half its target with a prefill queue that alone takes half the target to
    drain on the serving replicas adds a replica before the target breaks; the same TTFT with a short
    queue (a long prompt's own prefill, a heavy tail's pile-up) or a long queue at a low TTFT does not."""
    t = target(prefill=2, decode=2)
    base = obs(rate=0.5, ttft=0.6, itl=0.02, decode_queue=0.0, prefill_ready=2.0, decode_ready=2.0)
    m = dc.Memory()
    load = dc.Load(0.5, base.input_tokens_mean, base.input_tokens_p, base.output_tokens_mean)
    per_second = dc._prefill_capacity(dc._capacity(MODEL, m), load, 2, t.percentile)  # both replicas
    drain = lambda seconds: replace(base, prefill_queue=float(math.ceil(seconds * per_second)))
    quiet, _ = dc.decide(replace(base, prefill_queue=0.0), t, m, MODEL, now=0)
    assert quiet.prefill.replicas == 2  # the model alone keeps two at this load
    d, _ = dc.decide(drain(0.6 * t.ttft_target), t, m, MODEL, now=0)
    assert d.prefill.replicas == 3 and d.decode.replicas == 2
    short, _ = dc.decide(drain(0.3 * t.ttft_target), t, m, MODEL, now=0)
    assert short.prefill.replicas == 2
    low, _ = dc.decide(replace(drain(0.6 * t.ttft_target), ttft=0.4), t, m, MODEL, now=0)
    assert low.prefill.replicas == 2
    starting, _ = dc.decide(replace(drain(0.6 * t.ttft_target), prefill_ready=1.0), t, m, MODEL, now=0)
    assert starting.prefill.replicas == 2  # a replica still starting: the latency measures the old size

def _memory_after(o, t):
    _, m = dc.decide(o, t, dc.Memory(), MODEL, now=0)
    return m


def test_fast_path_scales_up_on_a_growing_queue_and_ignores_a_short_one():
    t = target(prefill=1, decode=1)
    m = _memory_after(obs(rate=4.0, ttft=0.3, itl=0.02), t)
    per = dc._prefill_capacity(dc._capacity(MODEL, m), dc.Load(4.0, 4000, 6000, 300), 1, 90.0)
    # a queue of many seconds' work, growing: one replica drains `per`/s, arrivals are `per + growth`
    q = dc.Observation(time=15, prefill_queue=10 * per, prefill_queue_growth=per, prefill_ready=1.0,
                       decode_queue=0.0, decode_queue_growth=0.0, decode_ready=1.0)
    d, m2 = dc.react(q, t, m, MODEL, now=15)
    assert d is not None and d.prefill.replicas >= 2 and d.decode.replicas == 1 and d.reason == dc.SCALED
    assert m2.last_scale_up_prefill == 15 and m2.last_scale_up_decode == m.last_scale_up_decode
    # replicas already asked for count: nothing more while they start
    more, _ = dc.react(q, target(prefill=d.prefill.replicas, decode=1), m2, MODEL, now=30)
    assert more is None
    # a queue the ready replica drains within the TTFT target, a shrinking one, or none: nothing
    for quiet in (replace(q, prefill_queue=0.5 * per), replace(q, prefill_queue_growth=-1.0),
                  replace(q, prefill_queue=None)):
        assert dc.react(quiet, t, m, MODEL, now=15)[0] is None
    # never while not Ready or rolling out (the full decision owns those), never past maxReplicas
    assert dc.react(q, target(prefill=1, decode=1, ready=False), m, MODEL, now=15)[0] is None
    capped, _ = dc.react(replace(q, prefill_queue=1000 * per), target(prefill=1, decode=1, prefill_max=3), m,
                         MODEL, now=15)
    assert capped.prefill.replicas == 3


def test_fast_path_grows_decode_when_requests_wait_for_admission():
    t = target(prefill=1, decode=1)
    m = _memory_after(obs(rate=4.0, ttft=0.3, itl=0.02), t)
    per = dc._decode_capacity(dc._planning(MODEL, m), dc.Load(4.0, 4000, 6000, 300), 1, 0.05)
    q = dc.Observation(time=15, prefill_queue=0.0, prefill_queue_growth=0.0, prefill_ready=1.0,
                       decode_queue=5 * per, decode_queue_growth=0.2 * per, decode_ready=1.0)
    d, _ = dc.react(q, t, m, MODEL, now=15)
    assert d is not None and d.decode.replicas >= 2 and d.prefill.replicas == 1


def test_many_active_lora_adapters_need_more_replicas_and_are_an_input():
    """The routers' adapters (Observation.lora_adapters, disagg_router_adapter_workers) slow every step of the
    model the planner sizes with (perf.model.lora_step_factor): at the same load it asks for more decode, and
    says what it read."""
    load = dc.Load(rate=30, input_mean=3000, input_p=6000, output_mean=400)
    plain, _ = dc.size_decode(MODEL, load, 0.03, 90)
    loaded, _ = dc.size_decode(dc.RoleModels.of(MODEL).with_lora(16), load, 0.03, 90)
    assert loaded > plain
    o = obs(rate=30, inp=3000, out=400, itl=0.03, lora_adapters=16)
    assert o.inputs()["loraAdapters"] == 16
    with_lora, _ = dc.decide(o, target(), dc.Memory(), MODEL, now=0.0)
    without, _ = dc.decide(obs(rate=30, inp=3000, out=400, itl=0.03), target(), dc.Memory(), MODEL, now=0.0)
    assert with_lora.decode.replicas > without.decode.replicas
    from disagg.api import metrics as m
    from disagg.planner.metrics_source import queries

    assert m.ROUTER_ADAPTER_WORKERS in queries("ns", "dd", 90, 60)["lora_adapters"]
