"""The discrete-event simulator, the traces and `disagg simulate` (small, fast runs)."""

import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from disagg.planner import decide as decide_module
from disagg.simulator import simulate as sm
from disagg.simulator import traces

REPO = Path(__file__).resolve().parent.parent
SMALL = sm.SimConfig(ttft_target=1.0, itl_target=0.04, interval=15.0, cooldown=60.0, startup=30.0)


# ---------------------------------------------------------------- traces

def _rate(trace, lo, hi):
    return sum(1 for r in trace.requests if lo <= r.t < hi) / (hi - lo)


def test_synthetic_shapes_have_their_shape():
    p = traces.poisson(10, 600, seed=1)
    assert _rate(p, 0, 600) == pytest.approx(10, rel=0.1)
    s = traces.step([2, 20], 300, seed=1)
    assert _rate(s, 0, 300) == pytest.approx(2, rel=0.3) and _rate(s, 300, 600) == pytest.approx(20, rel=0.15)
    d = traces.diurnal(10, 0.8, 1200, 1200, seed=1)
    assert _rate(d, 500, 700) > 3 * _rate(d, 0, 150)  # trough at the start, peak mid-period
    b = traces.bursty(30, 1, 60, 60, 480, seed=1)
    assert _rate(b, 60, 120) > 10 * max(_rate(b, 0, 60), 0.1)
    assert traces.poisson(5, 60, seed=3) == traces.poisson(5, 60, seed=3)  # deterministic


def test_heavy_tailed_tenant_and_flash_crowd_traces():
    pareto = traces.poisson(20, 600, traces.ParetoMix(alpha=1.4, minimum=3000, cap=100_000, short_share=0.2,
                                                      short_max=32), seed=4)
    lengths = sorted(r.input_tokens for r in pareto.requests)
    short = sum(1 for n in lengths if n <= 32) / len(lengths)
    assert short == pytest.approx(0.2, abs=0.04)           # the spike of very short prompts
    body = [n for n in lengths if n > 32]
    assert min(body) >= 3000 and max(body) <= 100_000
    # Pareto tail: P(X > 10 x minimum) = 10^-alpha ~ 4%, far above what a lognormal of that median gives
    assert sum(1 for n in body if n > 30_000) / len(body) == pytest.approx(10 ** -1.4, abs=0.02)
    chat = traces.poisson(4, 300, traces.Mix(prefix_groups=2), seed=1)
    rag = traces.poisson(2, 300, traces.Mix(input_mean=16000, prefix_groups=2), seed=2)
    both = traces.merge("tenants", chat, rag)
    assert len(both.requests) == len(chat.requests) + len(rag.requests)
    assert [r.t for r in both.requests] == sorted(r.t for r in both.requests)
    groups = {r.prefix_group for r in both.requests if r.prefix_group}
    assert {g.split(".")[0] for g in groups} == {"0", "1"}    # the tenants' prefixes stay apart
    flash = traces.flash_crowd(4.0, 5.0, 1200, crowds=1, seed=3)
    per_minute = [_rate(flash, m * 60, (m + 1) * 60) for m in range(20)]
    assert max(per_minute) > 3.5 * 4.0 and min(per_minute) < 1.5 * 4.0
    assert per_minute.index(max(per_minute)) >= 2          # not in the first tenth
    assert flash == traces.flash_crowd(4.0, 5.0, 1200, crowds=1, seed=3)


def test_prefix_groups_share_leading_blocks():
    t = traces.poisson(20, 60, traces.Mix(prefix_groups=2, prefix_share=1.0, prefix_tokens=1024), seed=2)
    by_group = {}
    for r in t.requests:
        assert len(r.blocks) == math.ceil(r.input_tokens / traces.BLOCK_TOKENS)
        by_group.setdefault(r.prefix_group, set()).add(r.blocks[:2])
    assert set(by_group) == {"g0", "g1"} and all(len(v) == 1 for v in by_group.values())


def test_trace_file_roundtrip_and_errors(tmp_path):
    t = traces.poisson(5, 30, seed=4)
    path = tmp_path / "t.csv"
    traces.write_csv(t, path)
    back = traces.load(path)
    assert [(round(r.t, 3), r.input_tokens, r.output_tokens, r.prefix_group) for r in back.requests] == \
        [(round(r.t, 3), r.input_tokens, r.output_tokens, r.prefix_group) for r in t.requests]
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"timestamp": 1.5, "input_tokens": 1100, "output_tokens": 7, "prefix_group": "a"}\n'
                  '{"timestamp": 0.5, "input_tokens": 10, "output_tokens": 3}\n')
    rs = traces.load(jl).requests
    assert [r.t for r in rs] == [0.5, 1.5] and rs[1].blocks[0] == "a-0"
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,input_tokens\n1,2\n")
    with pytest.raises(ValueError, match=r"bad.csv:2: want timestamp, input_tokens, output_tokens"):
        traces.load(bad)


def test_real_trace_is_read_from_the_shared_folder():
    t = traces.real(REPO)
    assert len(t.requests) == 12031
    assert 3000 < t.duration < 3700
    mean_in = sum(r.input_tokens for r in t.requests) / len(t.requests)
    assert mean_in == pytest.approx(12035, rel=0.01)
    assert len(t.requests[0].blocks) == math.ceil(t.requests[0].input_tokens / 512)
    assert len(t.scaled(rate=2.0, limit=300).requests) == pytest.approx(2 * _rate(t, 0, 300) * 300, rel=0.05)


# ---------------------------------------------------------------- the simulation

def test_static_run_serves_everything_and_counts_gpu_hours():
    trace = traces.poisson(4, 120, seed=5)
    cfg = replace(SMALL, initial_prefill=2, initial_decode=3, prefill_tp=2)
    r = sm.simulate(trace, sm.StaticPolicy(2, 3), cfg)
    assert r.finished == r.arrived == len(trace.requests)
    end = max(i.t for i in r.intervals)
    assert r.gpu_seconds >= (2 * 2 + 3) * trace.duration and r.gpu_seconds <= (2 * 2 + 3) * (end + cfg.interval)
    assert 0.9 <= r.attainment <= 1.0
    model = cfg.planning_models()[0]
    # nobody's TTFT beats prefilling their uncached prompt on an idle replica (most prompts are uncached)
    assert min(r.ttft) >= model.ttft(1, 0) and len(r.itl) == r.finished


def test_too_few_replicas_queue_and_more_replicas_help():
    trace = traces.poisson(25, 120, seed=6)
    small = sm.simulate(trace, sm.StaticPolicy(1, 1), SMALL)
    big = sm.simulate(trace, sm.StaticPolicy(4, 4), replace(SMALL, initial_prefill=4, initial_decode=4))
    assert small.attainment < 0.5 < 0.9 < big.attainment
    assert sm._pct(small.ttft, 90) > 10 * sm._pct(big.ttft, 90)


def test_new_replicas_serve_only_after_startup():
    trace = traces.poisson(25, 90, seed=7)
    slow = sm.simulate(trace, sm.StaticPolicy(4, 4), replace(SMALL, startup=300.0))
    fast = sm.simulate(trace, sm.StaticPolicy(4, 4), replace(SMALL, startup=5.0))
    assert slow.attainment < fast.attainment
    # asked for at the first interval (15 s), they cost GPU time from then on
    assert slow.gpu_seconds > 8 * (trace.duration - 15)


def test_planner_follows_a_step_up_and_back_down_running_decide_unchanged(monkeypatch):
    calls = []
    real_decide = decide_module.decide

    def spy(*args, **kwargs):
        calls.append(args[0])
        return real_decide(*args, **kwargs)

    monkeypatch.setattr(sm, "decide", spy)
    trace = traces.step([2, 40, 2], 240, traces.Mix(input_mean=4000, output_mean=300), seed=8)
    r = sm.simulate(trace, "planner", SMALL)
    assert len(calls) == len(r.intervals) and all(isinstance(o, decide_module.Observation) for o in calls)
    before = [i for i in r.intervals if i.t <= 240]
    during = [i for i in r.intervals if 330 <= i.t <= 480]
    after = [i for i in r.intervals if i.t >= 700]
    assert max(i.prefill + i.decode for i in during) > max(i.prefill + i.decode for i in before)
    assert after[-1].prefill + after[-1].decode < max(i.prefill + i.decode for i in during)
    peak = sm.static_peak(SMALL, trace)
    static = sm.simulate(trace, peak, replace(SMALL, initial_prefill=peak.size[0], initial_decode=peak.size[1]))
    assert r.gpu_hours < static.gpu_hours
    assert r.finished == r.arrived


def test_planner_holds_through_a_metrics_outage():
    trace = traces.step([2, 40], 200, traces.Mix(input_mean=4000, output_mean=300), seed=9)
    cfg = replace(SMALL, metrics_outages=((150.0, 400.0),))
    policy = sm.PlannerPolicy(cfg)
    r = sm.simulate(trace, policy, cfg)
    out = [(i, d) for i, d in zip(r.intervals, policy.decisions) if 165 <= i.t <= 390]
    assert out and all(d.reason == decide_module.PROMETHEUS_UNREACHABLE for _, d in out)
    sizes = {(i.prefill, i.decode) for i, _ in out}
    assert len(sizes) == 1 and min(min(s) for s in sizes) >= 1  # held, never zero
    later = [i for i in r.intervals if i.t >= 420]
    assert later[0].prefill + later[0].decode > sum(next(iter(sizes)))  # catches up once metrics return


def test_online_correction_inside_the_simulator():
    """The simulated hardware is 2x slower than the data sheet: the planner learns it."""
    trace = traces.poisson(6, 300, traces.Mix(input_mean=3000, output_mean=200), seed=10)
    policy = sm.PlannerPolicy(replace(SMALL, reality=2.0))
    sm.simulate(trace, policy, replace(SMALL, reality=2.0))
    assert policy.memory.correction.prefill > 1.3


def test_results_are_written_with_a_plot(tmp_path):
    r = sm.simulate(traces.poisson(3, 60, seed=11), "reactive", SMALL)
    paths = r.write(tmp_path)
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths["plot"].stat().st_size > 10_000
    rows = paths["intervals"].read_text().splitlines()
    assert rows[0].startswith("t,prefill,decode,gpus") and len(rows) == len(r.intervals) + 1
    assert json.loads(paths["summary"].read_text())["policy"] == "reactive"


def test_cli_simulate(tmp_path):
    exe = shutil.which("disagg", path=str(Path(sys.executable).parent))
    out = subprocess.run([exe, "simulate", "--trace", "bursty", "--duration", "240", "--rate", "4",
                          "--policy", "all", "--interval", "15", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    summaries = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [s["policy"] for s in summaries] == ["planner", "planner-flex", "static-peak", "reactive", "dynamo"]
    assert all(s["requests"] == s["finished"] > 0 for s in summaries)
    assert (tmp_path / "bursty-all.png").stat().st_size > 10_000
    bad = subprocess.run([exe, "simulate", "--trace", "nonsense.csv", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "nonsense.csv" in bad.stderr


def test_dynamo_style_policy_sizes_from_throughput_per_gpu():
    """Dynamo's SLA planner's arithmetic, by hand: prefill = rate x ISL / (ISL / TTFT of one prompt);
    decode = rate x OSL / (the best tokens/s per GPU whose ITL meets the target); corrections from means."""
    cfg = replace(SMALL, predictor="last-value")
    policy = sm.DynamoPolicy(cfg)
    pm, dm = cfg.planning_models()
    target = cfg.target(1, 1)
    obs = decide_module.Observation(time=30, request_rate=20.0, input_tokens_mean=4000, output_tokens_mean=200)
    p, d = policy.plan(obs, target, 30.0)
    assert p == math.ceil(20.0 * 4000 / (4000 / pm.ttft(4000)))
    batch = min(dm.max_concurrency_for_itl(cfg.itl_target, 4100), dm.max_concurrency(4200))
    assert d == math.ceil(20.0 * 200 / (batch / dm.itl(batch, 4100)))
    # ITL 3x what the profile predicts: the ITL it sizes for is a third, so decode grows; a TTFT above the
    # profile's (queueing) never grows prefill (min(1, correction)), one below it shrinks prefill
    slow = replace(obs, ttft_mean=10 * pm.ttft(4000), itl_mean=3 * dm.itl(20.0 * 2.0 / d, 4100),
                   request_seconds_mean=2.0)
    p2, d2 = sm.DynamoPolicy(cfg).plan(slow, cfg.target(p, d), 60.0)
    assert p2 == p and d2 > d
    fast = replace(slow, ttft_mean=0.5 * pm.ttft(4000))
    assert sm.DynamoPolicy(cfg).plan(fast, cfg.target(p, d), 60.0)[0] < p
    assert policy.plan(decide_module.Observation.unavailable(90, "down"), cfg.target(3, 4), 90.0) == (3, 4)


def test_dynamo_style_policy_follows_a_step_in_the_simulator():
    trace = traces.step([4, 16], 150, traces.Mix(input_mean=3000, output_mean=200), seed=5)
    r = sm.simulate(trace, "dynamo", SMALL)
    assert r.finished == r.arrived > 0
    early = [i for i in r.intervals if i.t <= 150]
    late = [i for i in r.intervals if 150 + SMALL.startup + 2 * SMALL.interval <= i.t <= 300]
    assert late and max(i.prefill + i.decode for i in late) > max(i.prefill + i.decode for i in early)
    assert r.summary()["goodput_per_gpu_hour"] == pytest.approx(r.met / r.gpu_hours, rel=0.01)


def test_planner_learns_capacity_while_saturated_and_reacts_to_queue_growth_between_decisions():
    # a step to a level never seen, on hardware 1.5x slower than the model it plans with: the planner's
    # fast path acts on the growing queue before the next decision, and the saturated intervals teach it
    # the real service time (the latency far below target before the step taught it nothing)
    trace = traces.step([6.0, 24.0], 240.0, seed=3)
    cfg = sm.SimConfig(ttft_target=1.0, itl_target=0.04, reality=1.5, initial_prefill=1, initial_decode=1,
                       fast_check=10.0)
    policy = sm.PlannerPolicy(cfg)
    r = sm.simulate(trace, policy, cfg)
    assert r.finished == r.arrived
    assert policy.reactions, "no reaction to the growing queue"
    first = policy.reactions[0][0]
    assert 240.0 < first and first % cfg.interval != 0  # between decisions, after the step
    learnt = [d.prediction.get("prefillCapacityScale") or d.prediction.get("decodeCapacityScale")
              for d in policy.decisions]
    scales = [s for s in learnt if s is not None]
    assert scales and max(scales) > 1.2  # the service time it measured is slower than the model's
    # without the fast path the same run reacts only at decisions
    slow = sm.PlannerPolicy(replace(cfg, fast_check=0.0))
    sm.simulate(trace, slow, replace(cfg, fast_check=0.0))
    assert not slow.reactions


def test_a_bursts_hand_offs_queue_one_per_decode_replica(monkeypatch):
    # a CPU P/D pair (bench/sim_vs_real.py, 2026-12-04): ten prompts arriving at once reached decode one
    # after another; as overlapping delays the simulator put the whole burst's TTFT at 0.57 of the real
    handoff = 0.5   # far above prefill and a decode step here, so the order is the hand-off's alone
    monkeypatch.setattr(sm.serving, "kv_transfer_time", lambda model, tokens, tp=None: handoff)
    burst = traces.Trace("burst", tuple(traces.Request(0.0, 16, 4, None, ()) for _ in range(8)))

    def first_tokens(decode: int) -> list[float]:
        cfg = replace(SMALL, initial_prefill=1, initial_decode=decode, ttft_target=60.0)
        return sorted(sm.simulate(burst, sm.StaticPolicy(1, decode), cfg).ttft)

    one = first_tokens(1)
    assert [b - a for a, b in zip(one, one[1:])] == pytest.approx([handoff] * 7, abs=0.05)
    four = first_tokens(4)
    assert four[-1] - four[0] == pytest.approx(handoff, abs=0.05)   # two waves of four
    assert four[3] - four[0] < 0.05 and four[4] - four[3] == pytest.approx(handoff, abs=0.05)


def test_multi_pod_replicas_start_with_their_slowest_pod_and_count_whole_groups():
    """A decode replica of 2 pods whose second pod is ready 60 s after the first: the group serves only then
    (its slowest pod), the planner is told that start-up, and its GPUs are the group's (TP 16 over 2 pods)."""
    cfg = replace(SMALL, decode_pods=2, decode_tp=16, pod_startup_spread=60.0, model="meta-llama/Llama-3.1-70B-Instruct")
    assert cfg.group_startup("decode") == SMALL.startup + 60.0 and cfg.group_startup("prefill") == SMALL.startup
    assert cfg.target(1, 1).startup == SMALL.startup + 60.0
    assert cfg.target(1, 2).gpus(1, 2) == 1 + 2 * 16
    trace = traces.poisson(2, 90, seed=7)
    r = sm.simulate(trace, sm.StaticPolicy(1, 2), cfg)
    sim_fast = sm.simulate(trace, sm.StaticPolicy(1, 2), replace(cfg, pod_startup_spread=0.0))
    # the second decode group, asked for at the first interval, serves 60 s later than a one-pod one would
    def first_ready(res, n):
        return min(i.t for i in res.intervals if i.ready_decode >= n)
    assert first_ready(r, 2) - first_ready(sim_fast, 2) >= 60.0 - SMALL.interval
    assert r.gpu_seconds == pytest.approx(sim_fast.gpu_seconds, rel=0.05) and r.finished == r.arrived


def test_an_adapter_mix_slows_the_steps_the_planner_sees_it_and_a_few_slots_cap_it():
    """LoRA adapters (SimConfig.adapter_mix): requests are given adapters at random; a step with more distinct
    adapters in its batch runs slower (perf.model.lora_step_factor), at most max_loras of them; the planner's
    observation carries the adapters, and its model the same factor."""
    from disagg.perf.model import lora_step_factor

    trace = traces.poisson(8, 120, seed=9)
    cfg = replace(SMALL, initial_prefill=2, initial_decode=2)
    mix = (0.25, 0.25, 0.25, 0.25)
    tagged = sm.with_adapters(trace, mix, seed=1)
    assert {r.adapter for r in tagged.requests} == {"lora-0", "lora-1", "lora-2", "lora-3"}
    assert [(r.t, r.input_tokens) for r in tagged.requests] == [(r.t, r.input_tokens) for r in trace.requests]
    base = sm.simulate(trace, sm.StaticPolicy(2, 2), cfg)
    many = sm.simulate(trace, sm.StaticPolicy(2, 2), replace(cfg, adapter_mix=mix, max_loras=4))
    capped = sm.simulate(trace, sm.StaticPolicy(2, 2), replace(cfg, adapter_mix=mix, max_loras=1))
    itl = {name: sm._pct(r.itl, 50) for name, r in (("base", base), ("many", many), ("capped", capped))}
    assert itl["base"] < itl["capped"] < itl["many"], itl
    assert itl["many"] <= itl["base"] * lora_step_factor(4) * 1.05
    obs = sm.Simulation(replace(cfg, adapter_mix=mix), trace, sm.StaticPolicy(2, 2))._observe(cfg.interval)
    assert obs.lora_adapters == 4 and obs.inputs()["loraAdapters"] == 4
    model = cfg.planning_models()[1]
    assert model.with_lora(4).itl(16, 1000) > model.itl(16, 1000)
    with pytest.raises(ValueError):
        sm.with_adapters(trace, (0.7, 0.7))
