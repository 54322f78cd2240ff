"""Flex workers in the planner (disagg.planner.flex): switch roles before asking for replicas, grow the pool when
neither role has a worker to spare, shrink it when both are idle; each decision with its reason. Pure: no cluster."""

from dataclasses import replace

import pytest

from disagg.perf.model import PerfModel
from disagg.planner import decide as dc
from disagg.planner import flex as fx
from disagg.planner import reasons

MODEL = PerfModel.analytic("meta-llama/Llama-3.1-8B-Instruct", "H100-SXM")
NOW = 1000.0


def target(prefill=1, decode=1, workers=(), flex_min=0, flex_max=8, **kw):
    base = dict(prefill=prefill, decode=decode, ttft_target=1.0, itl_target=0.05, cooldown=300.0)
    base.update(kw)
    return fx.FlexTarget(dc.Target(**base), tuple(workers), flex_min, flex_max)


def worker(name, role, state=fx.SERVING, since=0.0, load=0.0):
    return fx.FlexWorker(name, role, state, since, load)


def decision(reason=reasons.SCALED):
    return dc.Decision(dc.RoleDecision(1, 1, reason), dc.RoleDecision(1, 1, reason), reason, "decide's message", True)


def allocate(t, want, keep, now=NOW):
    return fx.allocate(t, {"prefill": want[0], "decode": want[1]}, {"prefill": keep[0], "decode": keep[1]}, now,
                       decision())


# ---------------------------------------------------------------- allocate: switch, grow, shrink

def test_a_role_short_takes_the_other_roles_spare_flex_workers_before_asking_for_replicas():
    t = target(workers=[worker("f1", "decode"), worker("f2", "decode"), worker("f3", "decode")])
    # prefill needs 3 (has 1); decode has 4 and keeps 2: two workers switch, nothing new is asked for
    fd = allocate(t, want=(3, 4), keep=(3, 2))
    assert len(fd.switches) == 2 and all(frm == "decode" and to == "prefill" for _, frm, to in fd.switches)
    assert fd.add == () and fd.remove == () and (fd.prefill, fd.decode) == (1, 1)
    assert fd.total("prefill") == 3 and fd.total("decode") == 2
    assert fd.reason == reasons.ROLE_SWITCHED and "2 decode->prefill switched" in fd.message
    # counted as one role up and the other down, reason RoleSwitched (disagg_planner_decisions_total's labels)
    assert fd.records(t).count(("prefill", "up", reasons.ROLE_SWITCHED)) == 2
    assert fd.records(t).count(("decode", "down", reasons.ROLE_SWITCHED)) == 2


def test_the_donor_keeps_its_keep_size_and_what_is_left_grows_the_flex_pool():
    t = target(workers=[worker("f1", "decode"), worker("f2", "decode")])
    # prefill needs 4 (has 1); decode has 3, keeps 2: one switch, two new flex workers for prefill
    fd = allocate(t, want=(4, 3), keep=(4, 2))
    assert [s[0] for s in fd.switches] == ["f1"] and fd.add == ("prefill", "prefill")
    assert fd.total("prefill") == 4 and fd.total("decode") == 2 and fd.reason == reasons.ROLE_SWITCHED
    # no keep known (a hold, or a fast path before any decision): nothing is taken from decode
    fd = allocate(t, want=(4, 3), keep=(4, None))
    assert fd.switches == () and fd.add == ("prefill",) * 3 and fd.reason == reasons.FLEX_GROWN


def test_both_roles_busy_grow_the_flex_pool_then_the_dedicated_pools_past_its_maximum():
    t = target(workers=[worker("f1", "prefill"), worker("f2", "decode")], flex_max=4)
    fd = allocate(t, want=(4, 4), keep=(4, 4))
    assert fd.switches == () and sorted(fd.add) == ["decode", "prefill"]    # the pool reaches its maximum ...
    assert (fd.prefill, fd.decode) == (2, 2)                                # ... the rest is dedicated
    assert fd.total("prefill") == 4 and fd.total("decode") == 4 and fd.reason == reasons.FLEX_GROWN


def test_the_donor_order_starting_then_cancelled_switches_then_least_loaded_and_no_flapping():
    workers = [worker("busy", "decode", load=30), worker("light", "decode", load=2),
               worker("new", "decode", state=fx.STARTING, since=NOW - 5),
               worker("recent", "decode", since=NOW - 10, load=0)]   # took decode 10 s ago: it stays
    t = target(decode=1, workers=workers)
    fd = allocate(t, want=(3, 5), keep=(3, 1))
    assert [s[0] for s in fd.switches] == ["light", "new"]
    back = worker("back", "decode", state=fx.SWITCHING, since=NOW - 2, load=9)   # on its way to decode
    fd = allocate(target(decode=1, workers=workers + [back]), want=(2, 6), keep=(2, 1))
    assert [s[0] for s in fd.switches] == ["back"]   # cancelling its switch serves prefill at once


def test_shrinking_both_idle_removes_flex_workers_first_one_idle_the_dedicated_replicas_first():
    workers = [worker("p1", "prefill", load=3), worker("p2", "prefill", load=1), worker("d1", "decode")]
    t = target(prefill=2, decode=2, workers=workers, flex_min=2)
    both = allocate(t, want=(3, 2), keep=(3, 2))          # prefill 4 -> 3, decode 3 -> 2
    # decode first (the pooled spare's role, prefill, last): its flex worker, then flex_min 2 leaves prefill's
    # surplus to its dedicated replicas
    assert both.remove == ("d1",) and (both.prefill, both.decode) == (1, 2)
    assert both.reason == reasons.FLEX_SHRUNK and both.flex == 2
    one = allocate(t, want=(2, 3), keep=(2, 3))           # prefill 4 -> 2 only
    assert one.remove == ("p2",) and one.prefill == 1 and one.decode == 2  # dedicated to its floor, then flex
    assert one.total("prefill") == 2 and one.reason == reasons.FLEX_SHRUNK
    same = allocate(t, want=(4, 3), keep=(4, 3))
    assert (same.switches, same.add, same.remove) == ((), (), ()) and same.reason == reasons.STEADY


# ---------------------------------------------------------------- with decide() and react()

def _obs(**kw):
    base = dict(time=NOW, request_rate=12.0, ttft=0.4, itl=0.02, input_tokens_mean=3000, input_tokens_p=4500,
                output_tokens_mean=200, output_tokens_p=300, prefill_queue=0.0, decode_queue=0.0,
                prefill_ready=1.0, decode_ready=4.0)
    base.update(kw)
    return dc.Observation(**base)


def test_decide_flex_switches_a_decode_worker_to_prefill_on_a_prompt_heavy_shift_within_the_cooldown():
    # four decode workers (three flex) carry a light output mix; the prompts turn long: prefill is short.
    # The first decision also starts every role's cooldown, so without flex workers decode would hold
    t = target(prefill=1, decode=1, workers=[worker(f"f{i}", "decode") for i in range(3)])
    memory = fx.FlexMemory()
    fd, memory = fx.decide_flex(_obs(), t, memory, MODEL, NOW - 30)
    assert fd.switches == () and fd.reason != reasons.ROLE_SWITCHED
    heavy = _obs(input_tokens_mean=12000, input_tokens_p=18000, output_tokens_mean=60, output_tokens_p=90,
                 ttft=2.5, prefill_queue=25.0)
    fd, memory = fx.decide_flex(heavy, t, memory, MODEL, NOW)
    assert fd.switches and all((frm, to) == ("decode", "prefill") for _, frm, to in fd.switches)
    assert fd.reason == reasons.ROLE_SWITCHED and fd.decision.prefill.replicas > 1
    plain, _ = dc.decide(heavy, t.combined(), dc.Memory(), MODEL, NOW)
    assert plain.decode.replicas == 4     # the planner without flex workers keeps decode (cooldown) ...
    assert fd.total("decode") < 4         # ... the flex planner moves its spare to prefill in seconds
    assert fd.total("decode") >= fd.decision.decode.keep


def test_decide_flex_holds_when_metrics_are_missing():
    t = target(workers=[worker("f1", "decode"), worker("f2", "decode")])
    fd, memory = fx.decide_flex(dc.Observation.unavailable(NOW, "down"), t, fx.FlexMemory(), MODEL, NOW)
    assert (fd.switches, fd.add, fd.remove) == ((), (), ()) and fd.reason == reasons.PROMETHEUS_UNREACHABLE
    assert memory.keep == (None, None)


def test_react_flex_meets_a_growing_prefill_queue_by_switching_between_decisions():
    t = target(prefill=1, decode=1, workers=[worker(f"f{i}", "decode") for i in range(3)])
    memory = fx.FlexMemory()
    _, memory = fx.decide_flex(_obs(), t, memory, MODEL, NOW - 15)
    assert memory.keep[1] is not None and memory.keep[1] < 4
    growing = dc.Observation(time=NOW, prefill_queue=120.0, prefill_queue_growth=4.0, decode_queue=0.0,
                             decode_queue_growth=0.0, prefill_ready=1.0, decode_ready=4.0)
    fd, memory = fx.react_flex(growing, t, memory, MODEL, NOW)
    assert fd is not None and fd.switches and fd.reason == reasons.ROLE_SWITCHED
    assert fd.total("decode") >= memory.keep[1]
    quiet = replace(growing, prefill_queue=0.0, prefill_queue_growth=0.0)
    assert fx.react_flex(quiet, t, memory, MODEL, NOW)[0] is None


def test_combined_target_counts_flex_workers_in_their_role_and_widens_the_bounds():
    t = target(prefill=2, decode=1, workers=[worker("a", "prefill"), worker("b", "decode", state=fx.SWITCHING)],
               flex_max=5, prefill_max=4, decode_max=3)
    c = t.combined()
    assert (c.prefill, c.decode) == (3, 2) and (c.prefill_max, c.decode_max) == (9, 8)
    assert c.floor_prefill == 1 and c.gpus(c.prefill, c.decode) == 5


def test_a_pooled_spare_is_kept_beyond_both_roles_need_in_the_pressed_role_and_is_the_first_to_switch():
    t = replace(target(workers=[worker("f1", "decode")]), spare=1)
    fd = fx.allocate(t, {"prefill": 1, "decode": 2}, {"prefill": 1, "decode": 2}, NOW, decision(), "decode")
    assert fd.add == ("decode",) and fd.reason == reasons.FLEX_GROWN      # 1 + 2 needed, 1 + 3 kept
    kept = replace(t, workers=(worker("f1", "decode"), worker("f2", "decode")))
    fd = fx.allocate(kept, {"prefill": 1, "decode": 2}, {"prefill": 1, "decode": 2}, NOW, decision(), "decode")
    assert (fd.add, fd.remove) == ((), ()) and fd.reason == reasons.STEADY   # decide's shrink is the spare
    fd = fx.allocate(kept, {"prefill": 2, "decode": 3}, {"prefill": 2, "decode": 2}, NOW, decision(), "decode")
    assert len(fd.switches) == 1 and fd.total("prefill") == 2
    assert fd.add == ("decode",) and fd.total("decode") == 3   # the spare is made again (the switch serves now)
    budget = replace(kept, dedicated=replace(kept.dedicated, gpu_budget=4))
    fd = fx.allocate(budget, {"prefill": 2, "decode": 3}, {"prefill": 2, "decode": 2}, NOW, decision(), "decode")
    assert fd.add == ()             # no spare past the GPU budget


def test_the_spare_is_not_made_again_within_a_cooldown_of_a_removal():
    # a need that moves by one between intervals: removed at one decision, and without this rule started
    # again at the next (step seed 0 with a spare, 1050-1200 s: each new one a start-up's GPU time)
    t = replace(target(workers=[worker("f1", "decode"), worker("f2", "decode")]), spare=1)
    fd = fx.allocate(t, {"prefill": 1, "decode": 3}, {"prefill": 1, "decode": 3}, NOW, decision(), "decode",
                     remake_spare=False)
    assert fd.add == () and fd.remove == ()
    fd = fx.allocate(t, {"prefill": 1, "decode": 3}, {"prefill": 1, "decode": 3}, NOW, decision(), "decode")
    assert fd.add == ("decode",)
    # decide_flex remembers when the pool last lost a worker
    fd, after = fx.decide_flex(_obs(), t, fx.FlexMemory(removed_at=NOW - 100), MODEL, NOW)
    assert after.removed_at == (NOW if fd.remove else NOW - 100)


def test_a_donor_whose_own_work_rises_above_its_forecast_keeps_its_workers():
    # tenants seed 1: RAG's step raised prefill's work ~20% above its forecast while the model, on a mix it
    # had not caught up with, still asked for fewer prefill replicas than ran; a prefill worker switched to
    # decode and prefill missed for 150 s. A role whose work rose over a standard deviation above the
    # forecast made for it keeps what it holds.
    t = target(prefill=1, decode=1, workers=[worker("p1", "prefill"), worker("p2", "prefill"),
                                             worker("d1", "decode")], ttft_target=2.0)
    steady = _obs(request_rate=6.0, ttft=0.3, prefill_ready=3.0, decode_ready=2.0)
    memory = fx.FlexMemory()
    for k in range(3, 0, -1):
        _, memory = fx.decide_flex(replace(steady, time=NOW - 30 * k), t, memory, MODEL, NOW - 30 * k)
    longer = replace(steady, input_tokens_mean=4200, input_tokens_p=6300)    # prefill's work +40%, decode's not
    fd, after = fx.decide_flex(longer, t, memory, MODEL, NOW)
    assert after.planner.rise_prefill > dc.RISE_KEEPS and after.planner.rise_decode == 0.0
    assert fd.decision.prefill.keep == 3 and fd.decision.prefill.needed < 3   # keeps all three, needs fewer
    assert all(frm != "prefill" for _, frm, _ in fd.switches)
    # the same need without the rise: the model's size is what prefill keeps, its surplus may switch
    fd, after = fx.decide_flex(steady, t, memory, MODEL, NOW)
    assert after.planner.rise_prefill <= dc.RISE_KEEPS
    assert fd.decision.prefill.keep == max(fd.decision.prefill.needed, 1) < 3


def test_requests_waiting_for_decode_take_a_prefill_flex_worker_whatever_the_ttft_they_cause():
    # streams queued at decode admission wait for their first token there: the TTFT percentile climbs with
    # prefill idle. That TTFT is decode's (as for decide's prefill breach), so prefill keeps what the model
    # asks and its flex worker switches to decode; seen on real engines (tests/test_router_pd.py)
    t = target(prefill=1, decode=1, workers=[worker("f1", "prefill")], ttft_target=10.0, itl_target=2.0)
    waiting = _obs(request_rate=5.0, ttft=9.0, itl=0.05, input_tokens_mean=20, input_tokens_p=22,
                   output_tokens_mean=160, output_tokens_p=160, decode_queue=16.0, prefill_ready=2.0,
                   decode_ready=1.0)
    fd, _ = fx.decide_flex(waiting, t, fx.FlexMemory(), MODEL, NOW)
    assert fd.decision.prefill.keep == max(fd.decision.prefill.needed, 1) < 2
    assert fd.switches == (("f1", "prefill", "decode"),) and fd.reason == reasons.ROLE_SWITCHED
    # nothing waiting at decode: the same TTFT is prefill's, and prefill keeps its worker
    fd, _ = fx.decide_flex(replace(waiting, decode_queue=0.0), t, fx.FlexMemory(), MODEL, NOW)
    assert fd.decision.prefill.keep == 2 and fd.switches == ()
