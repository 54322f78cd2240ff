"""bench/planner_compare.py --quick (5-minute traces, one seed): every workload runs under every policy and
the figures it reports are consistent with each other. The full run (20-minute and 2-hour horizons, three
seeds) is the benchmark; its figures are in planner/README.md, not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = {"mooncake", "step", "diurnal", "bursty", "step-slow", "step-fast", "heavy-lognormal", "heavy-pareto",
             "tenants", "flash"}
POLICIES = {"planner", "planner-flex", "static-peak", "reactive", "dynamo"}


def test_planner_bench_quick_runs_every_workload_and_policy(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "bench" / "planner_compare.py"), "--quick", "--traces",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    doc = json.loads((tmp_path / "results.json").read_text())
    rows = doc["rows"]
    assert {(r["workload"], r["policy"]) for r in rows} == {(w, p) for w in WORKLOADS for p in POLICIES}
    for r in rows:
        assert r["requests"] > 0 and r["gpu_hours"] > 0, r
        # both targets met implies each target met
        assert r["slo_attainment"] <= min(r["ttft_attainment"], r["itl_attainment"]) + 1e-9, r
        assert r["goodput_per_gpu_hour"] == pytest.approx(
            r["slo_attainment"] * r["requests"] / r["gpu_hours"], rel=0.02, abs=1.0), r
    for w in WORKLOADS:  # static-peak never changes size: its GPU-hours are its size for the whole run
        st = next(r for r in rows if r["workload"] == w and r["policy"] == "static-peak")
        assert st["gpu_hours"] >= (st["max_prefill"] + st["max_decode"]) * 300 / 3600 * 0.99, st
    for r in rows:   # flex workers' switches lose no request, and a drain is given up only past its bound
        if r["policy"] == "planner-flex":
            assert r["finished"] == r["requests"] and r["switches_abandoned"] == 0, r
    assert {e["workload"] for e in doc["table"]} == WORKLOADS
    assert all(doc["goal"][p]["rows"] == len(WORKLOADS) for p in POLICIES)
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("| workload |") and all(f"| {w} |" in table for w in WORKLOADS)
    assert "Dynamo-style" in run.stdout
    # --traces: every policy's per-interval trace, the planner's with what it sized for and what waited
    for w in WORKLOADS:
        lines = (tmp_path / "traces" / f"{w}-300s-seed0" / f"{w}-planner.csv").read_text().splitlines()
        head = lines[0].split(",")
        assert {"t", "request_rate", "sized_rate", "prefill", "decode", "ready_prefill", "ready_decode",
                "prefill_queue", "decode_queue", "ttft_p", "itl_p"} <= set(head), head
        rows = [dict(zip(head, line.split(","))) for line in lines[1:]]
        assert len(rows) >= 300 // 30 and all(r["sized_rate"] for r in rows), w
        # the planner sizes for at least the rate it forecast, never less than it saw
        assert all(float(r["sized_rate"]) >= float(r["request_rate"]) - 1e-6 for r in rows), w


def test_the_lookahead_oracle_sizes_for_the_load_a_start_up_ahead():
    # the bound the README compares with: at a decision it already sizes for a step that comes within
    # its window (start-up + two intervals), and sizes down once the window is past it
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import planner_compare as pc
    finally:
        sys.path.remove(str(REPO / "bench"))
    from disagg.simulator import traces
    trace = traces.step([4.0, 24.0], 600.0, seed=0)
    oracle = pc.LookaheadOracle(pc.SYN, trace)
    target = pc.SYN.target(1, 1)
    quiet, before, during = (oracle.plan(None, target, t) for t in (60.0, 600.0 - oracle.ahead / 2, 900.0))
    assert sum(before) > sum(quiet) and sum(during) > sum(quiet)
    assert oracle.plan(None, target, 1300.0) == (1, 1)    # no requests ahead: the size it has
    assert "oracle" not in pc.DEFAULT_POLICIES
