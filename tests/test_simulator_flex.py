"""Flex workers in the simulator: a switch drains the old role (in-flight requests finish, KV blocks held for decodes
wait until a decode admits the request or their lease ends), flips with no reload, is given up past its bound, and
loses no request; the planner with a flex pool in the simulator (small, fast runs)."""

from dataclasses import replace

import pytest

from disagg.planner import decide as dc
from disagg.planner import flex as fx
from disagg.planner import reasons
from disagg.simulator import simulate as sm
from disagg.simulator import traces

SMALL = sm.SimConfig(ttft_target=1.0, itl_target=0.04, interval=15.0, cooldown=60.0, startup=30.0, fast_check=0.0,
                     drain_limit=600.0)


class Scripted:
    """A flex policy that, at its first decision, switches the flex workers named in ``switch`` and sets the
    dedicated pools to ``dedicated``; then holds."""

    name = "scripted"

    def __init__(self, switch: dict[str, str], dedicated: tuple[int, int] | None = None):
        self.switch, self.dedicated, self.done = switch, dedicated, False
        self.seen: list[fx.FlexTarget] = []

    def plan_flex(self, obs, target: fx.FlexTarget, now):
        self.seen.append(target)
        roles = {w.name: w.role for w in target.workers}
        switches = ()
        if not self.done:
            switches = tuple((n, roles[n], to) for n, to in self.switch.items() if roles[n] != to)
            roles.update(self.switch)
            self.done = True
        p, d = self.dedicated or (target.dedicated.prefill, target.dedicated.decode)
        rd = dc.RoleDecision(1, 1, reasons.STEADY)
        return fx.FlexDecision(dc.Decision(rd, rd, reasons.STEADY, "", True), p, d, tuple(sorted(roles.items())),
                               switches=switches, reason=reasons.ROLE_SWITCHED if switches else reasons.STEADY)


def _trace(*reqs):
    return traces.Trace("t", tuple(traces.Request(t, i, o, None, ()) for t, i, o in reqs))


def _flex_id(cfg, role, k=0):
    """Replica ids: dedicated prefill, dedicated decode, then flex prefill, flex decode, in that order."""
    base = cfg.initial_prefill + cfg.initial_decode
    return str(base + (k if role == "prefill" else cfg.initial_flex_prefill + k))


def test_a_decode_worker_switching_to_prefill_drains_its_streams_first_and_admits_nothing_meanwhile():
    cfg = replace(SMALL, initial_prefill=1, initial_decode=1, initial_flex_decode=1, ttft_target=30.0)
    # long streams that land on both decode workers before the switch at 15 s, and more after it
    trace = _trace(*[(0.1 * i, 200, 6000) for i in range(4)], *[(16.0 + i, 200, 50) for i in range(5)])
    name = _flex_id(cfg, "decode")
    policy = Scripted({name: "prefill"})
    sim = sm.Simulation(cfg, trace, policy)
    r = sim.run()
    assert r.finished == r.arrived == len(trace.requests)          # no request lost to the switch
    assert r.switches == 1 and r.switches_abandoned == 0 and len(r.switch_drains) == 1
    worker = next(x for x in sim.replicas["prefill"] if str(x.id) == name)
    assert worker.role == "prefill" and worker.flex
    # it flipped once its last stream ended: 6000 tokens at several ms a step take far beyond 15 s
    drain = r.switch_drains[0]
    assert drain > 10.0 and drain == pytest.approx(worker.since - 15.0 + cfg.switch_flip, abs=0.01)
    # the short requests after the switch were decoded by the dedicated decode replica alone
    later = [iv for iv in r.intervals if 15.0 < iv.t < worker.since]
    assert later and all(iv.ready_decode == 1 for iv in later)
    # the switch's drain is reported
    assert r.summary()["role_switches"] == 1 and r.summary()["switch_drain_p90_s"] == pytest.approx(drain, abs=0.01)


def test_a_prefill_worker_holding_kv_blocks_for_an_unadmitted_decode_does_not_switch_until_they_are_pulled():
    # no decode serves until a dedicated one asked for at 15 s starts (startup 30 s): the flex prefill
    # worker holds the prompts' blocks (a lease of 60 s); asked at 15 s to become a decode worker, it flips
    # only at ~45 s
    cfg = replace(SMALL, initial_prefill=0, initial_decode=0, initial_flex_prefill=1, startup=30.0, ttft_target=120.0,
                  kv_lease=60.0)
    trace = _trace(*[(1.0 + 0.5 * i, 500, 20) for i in range(6)])
    name = _flex_id(cfg, "prefill")
    r = sm.Simulation(cfg, trace, Scripted({name: "decode"}, dedicated=(0, 1))).run()
    assert r.finished == r.arrived and r.switches == 1 and r.kv_leases_expired == 0
    # held until the dedicated decode, ready at 45 s, admitted what it held (not at 15 s, when it went idle)
    assert r.switch_drains[0] == pytest.approx(45.0 - 15.0 + cfg.switch_flip, abs=0.5)


def test_held_blocks_whose_lease_expires_release_the_switch_and_the_decode_prefills_them_itself():
    # the flex prefill worker is the only one that could decode: no decode serves to extend the lease (20 s),
    # so only its end ends the drain
    cfg = replace(SMALL, initial_prefill=0, initial_decode=0, initial_flex_prefill=1, kv_lease=20.0,
                  ttft_target=120.0)
    trace = _trace(*[(1.0 + 0.5 * i, 500, 20) for i in range(6)])
    name = _flex_id(cfg, "prefill")
    r = sm.Simulation(cfg, trace, Scripted({name: "decode"})).run()
    assert r.finished == r.arrived == 6
    assert r.kv_leases_expired > 0
    assert max(r.ttft) > 20.0                       # they waited for the lease, then were prefilled again
    assert r.switch_drains[0] < 20.0 + cfg.switch_flip


def test_a_drain_past_its_bound_is_given_up_and_the_worker_serves_its_old_role_again():
    cfg = replace(SMALL, initial_prefill=1, initial_decode=1, initial_flex_decode=1, switch_drain_limit=5.0,
                  ttft_target=60.0)
    trace = _trace((0.1, 100, 8000), (0.2, 100, 8000), (30.0, 100, 20), (31.0, 100, 20), (32.0, 100, 20))
    name = _flex_id(cfg, "decode")
    sim = sm.Simulation(cfg, trace, Scripted({name: "prefill"}))
    r = sim.run()
    assert r.switches == 1 and r.switches_abandoned == 1 and r.switch_drains == []
    assert r.finished == r.arrived
    assert any(str(x.id) == name for x in sim.replicas["decode"])   # still (again) a decode worker


def test_a_worker_still_starting_switches_at_once_and_a_switch_asked_back_is_cancelled():
    sim = sm.Simulation(replace(SMALL, flex_max=4), _trace((0.0, 10, 10)), Scripted({}))
    new = sim._add("decode", 0.0, 30.0, flex=True)        # asked for, serving from 30 s
    sim._switch(new, "prefill", 1.0)
    assert new.role == "prefill" and new.switching is None and sim.switch_drains == [0.0]
    serving = sim._add("decode", 0.0, 0.0, flex=True)
    serving.active.append(sm._Req(traces.Request(0.0, 10, 100)))   # a stream in flight: the switch waits for it
    sim._switch(serving, "prefill", 2.0)
    assert serving.switching == "prefill" and serving.role == "decode" and not serving.ready(2.0)
    sim._switch(serving, "decode", 3.0)      # asked back before it drained: it serves decode on
    serving.active.clear()
    assert serving.switching is None and serving.ready(3.0) and sim.switches == 2


def test_a_flex_pool_needs_one_shape_for_both_roles():
    with pytest.raises(ValueError, match="both roles need one shape"):
        sm.Simulation(replace(SMALL, prefill_tp=2, flex_max=2), _trace((0.0, 10, 10)), Scripted({}))
    with pytest.raises(ValueError, match="needs flex workers"):
        sm.FlexPlannerPolicy(SMALL)


def test_with_flex_starts_the_dedicated_pools_at_their_floors_and_the_rest_as_flex():
    cfg = replace(SMALL, initial_prefill=3, initial_decode=2).with_flex(flex_max=8)
    assert (cfg.initial_prefill, cfg.initial_decode, cfg.initial_flex_prefill, cfg.initial_flex_decode) == (1, 1, 2, 1)
    assert cfg.flex and cfg.flex_max == 8


def test_the_flex_planner_switches_on_a_prompt_heavy_shift_and_beats_the_planner_without_flex_workers():
    # 16 requests/s whose prompts grow 4x at 240 s (outputs unchanged): prefill needs more at once, decode
    # has a spare worker its cooldown holds. The planner without flex workers asks for a prefill replica
    # that serves 90 s later; the flex planner switches a decode worker, serving within seconds
    short = traces.Mix(input_mean=1000, output_mean=400, sigma=0.5, prefix_groups=0)
    long_ = traces.Mix(input_mean=4000, output_mean=400, sigma=0.5, prefix_groups=0)
    trace = traces.merge("shift", traces.poisson(16.0, 240, short, seed=1), traces.Trace("long", tuple(
        replace(r, t=r.t + 240) for r in traces.poisson(16.0, 240, long_, seed=2).requests)))
    cfg = replace(SMALL, initial_prefill=1, initial_decode=4, fast_check=5.0, ttft_target=2.0, itl_target=0.05,
                  startup=90.0, cooldown=600.0)
    flex = sm.FlexPlannerPolicy(cfg.with_flex())
    r = sm.simulate(trace, flex, cfg.with_flex())
    plain = sm.simulate(trace, "planner", cfg)
    assert r.finished == r.arrived == plain.finished                 # no request lost to a switch
    assert r.switches >= 1 and r.switches_abandoned == 0 and max(r.switch_drains) < cfg.interval
    first = next(i.t for i, d in zip(r.intervals, flex.decisions) if d.reason == reasons.ROLE_SWITCHED)
    assert 240.0 < first <= 240.0 + 2 * cfg.interval
    assert r.attainment > plain.attainment + 0.1 and r.attainment > 0.9
    assert r.gpu_hours < plain.gpu_hours


def test_a_serving_decode_extends_the_lease_of_the_blocks_it_will_pull():
    # one decode replica that takes one request at a time (max_num_seqs 1): the flex prefill worker's third
    # prompt waits ~24 s for it, far past a 5 s lease; the decode's heartbeats keep the blocks, so the
    # switch asked at 15 s waits for that pull, and nothing is prefilled twice
    cfg = replace(SMALL, initial_prefill=0, initial_decode=1, initial_flex_prefill=1, kv_lease=5.0, ttft_target=600.0,
                  max_num_seqs=1)
    trace = _trace((0.0, 100, 2000), (0.1, 100, 2000), (0.2, 100, 2000))
    name = _flex_id(cfg, "prefill")
    r = sm.Simulation(cfg, trace, Scripted({name: "decode"})).run()
    assert r.finished == r.arrived and r.kv_leases_expired == 0
    assert r.switch_drains[0] > 5.0 + cfg.switch_flip      # it waited for the pull, not for the lease


def test_a_switch_set_for_a_time_drains_then_flips_whatever_the_policy():
    # bench/sim_vs_real.py --flex: the switch it writes to the real router at 20 s, under a static policy (no
    # plan_flex). Two long prompts just before it: the second, past the dedicated prefill's token budget, is
    # computing on the flex worker at 20 s, so the flip waits for its prefill and for the decode to admit it
    cfg = replace(SMALL, initial_prefill=1, initial_decode=1, initial_flex_prefill=1, switch_flip=0.0,
                  ttft_target=60.0, flex_switches=((20.0, "decode"), (30.0, "decode")))
    trace = _trace((1.0, 200, 20), (19.9, 12000, 20), (19.9, 12000, 20), *[(21.0 + i, 200, 200) for i in range(8)])
    sim = sm.Simulation(cfg, trace, sm.StaticPolicy(1, 1))
    r = sim.run()
    assert r.finished == r.arrived == len(trace.requests)
    # one switch: the second, to the role it already serves, is no switch
    assert r.switches == 1 and r.switches_abandoned == 0 and len(r.switch_drains) == 1
    worker = next(x for x in sim.replicas["decode"] if x.flex)
    assert worker.since > 20.05 and r.switch_drains[0] == pytest.approx(worker.since - 20.0, abs=1e-6)
    assert not any(x.flex for x in sim.replicas["prefill"])
