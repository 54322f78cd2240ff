"""bench/sim_vs_real.py's pure parts for --flex (no engines: the bench itself runs them): the load step, the
switch's moment, the phases the table is split into, and the simulated side with its scheduled switch."""

import sys
from pathlib import Path

import pytest

from disagg.simulator import simulate as sm
from disagg.simulator import traces

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
try:
    import sim_vs_real as svr
finally:
    sys.path.remove(str(REPO / "bench"))


def _trace(*reqs):
    return traces.Trace("t", tuple(traces.Request(t, i, o, None, ()) for t, i, o in reqs))


def test_the_load_step_is_prompt_heavy_before_the_switch_and_output_heavy_from_it_within_the_context():
    (pi, po), (ai, ao) = svr.FLEX_MIX
    assert pi > 1 > po and ai < 1 < ao
    t = svr.load_step(_trace((0.0, 200, 40), (9.99, 200, 40), (10.0, 200, 40), (11.0, 900, 120), (12.0, 20, 1)), 10.0)
    lens = [(r.input_tokens, r.output_tokens) for r in t.requests]
    assert lens[0] == lens[1] == (round(200 * pi), round(40 * po))
    assert lens[2] == (round(200 * ai), round(40 * ao))          # a request at the switch is the new mix's
    # clipped: outputs within 2..FLEX_MAX_OUTPUT, prompts at least 8 and within the context with the output
    assert lens[3][1] == svr.FLEX_MAX_OUTPUT and lens[3][0] <= svr.MAX_MODEL_LEN - svr.FLEX_MAX_OUTPUT - 8
    assert lens[4] == (8, 4)
    assert [r.t for r in t.requests] == [0.0, 9.99, 10.0, 11.0, 12.0]


def test_the_default_switch_lands_just_after_the_first_burst_from_the_given_time():
    t = _trace((1.0, 10, 10), (5.0, 10, 10), (5.0, 10, 10), (9.0, 10, 10))
    assert svr.switch_time(t, 3.0) == pytest.approx(5.0 + svr.SWITCH_AFTER_BURST)
    assert svr.switch_time(t, 5.0) == pytest.approx(5.0 + svr.SWITCH_AFTER_BURST)
    assert svr.switch_time(t, 9.5) == pytest.approx(9.0 + svr.SWITCH_AFTER_BURST)   # none later: the last


def test_phases_split_by_arrival_and_a_phase_one_side_lacks_gets_no_rows():
    records = [(0.0, 0.1, 0.01), (4.0, 0.2, None), (5.0, 0.3, 0.03), (6.5, 0.4, 0.04), (9.0, 0.5, 0.05)]
    ph = svr.phases(records, 5.0, 7.0)
    assert ph["before"] == {"ttft": [0.1, 0.2], "itl": [0.01]}    # a stream in one chunk: TTFT only
    assert ph["drain"] == {"ttft": [0.3, 0.4], "itl": [0.03, 0.04]}
    assert ph["after"] == {"ttft": [0.5], "itl": [0.05]}
    sim = svr.phases([(0.0, 0.1, 0.01), (9.0, 0.5, 0.05)], 5.0, 7.0)       # nothing arrived in its drain
    rows = svr.phase_rows(ph, sim)
    assert {r["phase"] for r in rows} == {"before", "after"}
    assert [r["metric"] for r in rows if r["phase"] == "after"] == [
        "TTFT p50 after", "TTFT p90 after", "ITL p50 after", "ITL p90 after"]
    assert all(r["within"] for r in rows if r["phase"] == "after") and rows[0]["n"] == 2
    assert svr.within(0.100, 0.119)["within"] and not svr.within(0.100, 0.121)["within"]


def test_the_simulated_side_switches_its_flex_worker_at_the_given_time_after_draining_the_burst():
    # a burst of long prompts at 10 s, the switch 50 ms later: the flex worker is prefilling part of it, so
    # the drain lasts until those prefills are done and pulled; the output-heavy requests after it decode on
    # two workers
    burst = [(10.0, 12000, 8)] * 4
    streams = [(20.0 + 0.1 * i, 100, 4000) for i in range(8)]
    models = sm.SimConfig().planning_models()
    records, drains = svr.simulate_flex(_trace(*burst, *streams), models, 16384, 10.05)
    assert len(records) == len(burst) + len(streams) and all(itl is not None for *_, itl in records)
    assert len(drains) == 1 and 0.0 < drains[0] < 10.0
    # two decode workers after the flip: the streams decode in two batches of four, faster than in one of eight
    # on the dedicated decode alone (the same run with the switch after the trace)
    late, _ = svr.simulate_flex(_trace(*burst, *streams), models, 16384, 1000.0)
    flipped = [itl for t, _, itl in records if t >= 20.0]
    unflipped = [itl for t, _, itl in late if t >= 20.0]
    assert max(flipped) < min(unflipped)


def test_the_router_log_gives_the_last_switch_seen_and_flipped_after_a_moment(tmp_path):
    log = tmp_path / "router.log"
    line = '{{"ts":"2026-12-05 10:00:{}","level":"INFO","logger":"disagg.router.fleet","msg":"flex worker u: {}"}}'
    log.write_text("\n".join([
        line.format("00,000", "switching prefill -> decode, draining (1 in flight, 0 KV held)"),   # before: not this one
        line.format("01,000", "serves decode (drained prefill in 0.10 s)"),
        line.format("05,000", "switching decode -> prefill, draining (0 in flight, 0 KV held)"),
        "a line from elsewhere",
        line.format("10,250", "switching prefill -> decode, draining (2 in flight, 1 KV held)"),
        line.format("10,400", "serves decode (drained prefill in 0.15 s)")]))
    import datetime
    at = datetime.datetime(2026, 12, 5, 10, 0, 3).timestamp()
    seen, flipped = svr.router_switch(log, at)
    assert seen - at == pytest.approx(7.25) and flipped - at == pytest.approx(7.4)
    assert svr.router_switch(log, at + 60) == (None, None)
