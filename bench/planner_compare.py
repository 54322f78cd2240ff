"""The SLO planner (with and without flex workers) vs static-peak, a reactive autoscaler and a Dynamo-style
throughput planner, many workloads.

All five policies run in the same discrete-event simulator (disagg.simulator.simulate), on the same traces,
in one run: per workload, horizon (20 minutes and 2 hours) and seed (3). Reported per row: SLO attainment
(share of requests inside both the TTFT and the ITL target at their p90; and each target on its own),
TTFT and ITL at p90, GPU-hours, goodput per GPU-hour (requests inside both targets per GPU-hour); and
per policy the ratios against static-peak measured in the same run. Goal for the planner: >= 90%
attainment on every row, GPU-hours below static-peak on every row, goodput per GPU-hour >= 1.5x
static-peak on average over the rows.

Workloads (Llama-3.1-8B on H100, TP1 per role, replicas take 90 s to start, 30 s planning interval, 300 s
scale-down cooldown; TTFT 1 s / ITL 40 ms at p90 unless said):
  mooncake        the shared Mooncake conversation trace (../shared/traces/; TTFT 4 s / ITL 50 ms); 20 min:
                  three disjoint windows (the seeds), 2 h: the recorded hour (one row);
  step, diurnal, bursty   the synthetic shapes (12 requests/s mean, 3k-token prompts, prefix groups);
  step-slow, step-fast    step on hardware 1.5x slower / 1.5x faster than the data sheet all plan with;
  heavy-lognormal flat 4 requests/s, lognormal prompts (median ~12k, p90 ~39k tokens), ~70-token answers
                  (issue 13's production mix; TTFT 4 s / ITL 50 ms);
  heavy-pareto    flat 6 requests/s, Pareto prompts (alpha 1.4 from 3k tokens, cut at 100k) with a spike of
                  20% very short prompts (1-32 tokens), ~150-token answers (TTFT 4 s / ITL 50 ms);
  tenants         three tenants on one deployment, each its own shape: chat (diurnal, 3k in / 300 out, shared
                  system prompts), RAG (steps, 16k in / 150 out), agents (flat, 1.5k in / 1200 out);
                  TTFT 2 s / ITL 50 ms;
  flash           flat 4 requests/s with a flash crowd every 20 minutes at a seeded time (4x in 10 s, 3 min,
                  then decaying).

The planner with flex workers (planner-flex: disagg.planner.flex, up to FLEX_MAX flex workers of the roles'
one shape; they switch roles in a drain's seconds, no weight reload) starts from the same size, its dedicated
pools at their floor (one each) and the rest as flex workers in those roles.
The planner and the reactive autoscaler and the Dynamo-style planner start from a size fit for the first
minute's traffic; static-peak is sized with the same serving model for the busiest 30 s of the trace. The
planner and the Dynamo-style planner use the same predictor (Holt-Winters on the periodic shapes, moving
average elsewhere). See planner/README.md for how faithfully the Dynamo-style planner follows Dynamo's.

    .venv/bin/python bench/planner_compare.py [--out DIR] [--jobs N] [--quick] [--seeds 3] [--seed-from 0]
      [--horizons 1200,7200] [--workloads step,flash] [--policies planner,planner-flex,static-peak] [--no-plots]
      [--traces]
    .venv/bin/python bench/planner_compare.py --from-results A/results.json,B/results.json   # one table of runs
"""

from __future__ import annotations

import argparse
import bisect
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from disagg.simulator import simulate as sm
from disagg.simulator import traces

REPO = Path(__file__).resolve().parent.parent
HEAVY = traces.Mix(input_mean=18300, output_mean=70, sigma=0.92, prefix_groups=0)
PARETO = traces.ParetoMix(alpha=1.4, minimum=3000, cap=100_000, short_share=0.2, short_max=32, output_mean=150)
CHAT = traces.Mix(input_mean=3000, output_mean=300, sigma=0.6, prefix_groups=8)
RAG = traces.Mix(input_mean=16000, output_mean=150, sigma=0.8, prefix_groups=0)
AGENT = traces.Mix(input_mean=1500, output_mean=1200, sigma=0.7, prefix_groups=4)
SYN = sm.SimConfig(ttft_target=1.0, itl_target=0.04)
REAL = sm.SimConfig(ttft_target=4.0, itl_target=0.05)
WORKLOADS = ("mooncake", "step", "diurnal", "bursty", "step-slow", "step-fast", "heavy-lognormal", "heavy-pareto",
             "tenants", "flash")
POLICIES = ("planner", "planner-flex", "static-peak", "reactive", "dynamo", "oracle", "oracle-instant")
DEFAULT_POLICIES = POLICIES[:-2]   # the oracles read the future: bounds, run only when asked for
FLEX_MAX = 64           # the flex pool's maximum (the roles' own maximum: 64 each)
FLEX_SPARE = 0          # flex workers kept beyond both roles' need (--flex-spare)
SHORT, LONG = 1200.0, 7200.0
MOONCAKE_HOUR = 3600.0  # the recorded trace's length (its long-horizon row)


def workload(name: str, horizon: float, seed: int) -> tuple[traces.Trace, sm.SimConfig, int] | None:
    """(trace, config, Holt-Winters season in intervals) of one row; None where the row does not exist."""
    hw = replace(SYN, predictor="holt-winters")
    if name == "mooncake":
        real = traces.real(REPO)
        if horizon >= real.duration:  # the recorded hour: one row
            if seed:
                return None
            start, horizon = 0.0, real.duration + 1.0
        else:                         # disjoint windows, one per seed, while the trace lasts
            start = seed * horizon
            if start >= real.duration - horizon / 2:
                return None
        window = traces.Trace("mooncake", tuple(
            traces.Request(r.t - start, r.input_tokens, r.output_tokens, r.prefix_group, r.blocks)
            for r in real.requests if start <= r.t < start + horizon))
        return window, REAL, 0
    if name in ("step", "step-slow", "step-fast"):
        reality = {"step": 1.0, "step-slow": 1.5, "step-fast": 1 / 1.5}[name]
        return (traces.synthetic("step", duration=horizon, rate=12.0, seed=seed), replace(SYN, reality=reality), 0)
    if name == "diurnal":  # one cycle over the horizon: Holt's trend (no season seen twice)
        return traces.synthetic("diurnal", duration=horizon, rate=12.0, seed=seed), hw, 0
    if name == "bursty":   # on/off halves of horizon / 6: the season is the burst cycle
        return traces.synthetic("bursty", duration=horizon, rate=12.0, seed=seed), hw, int(horizon / 6 // SYN.interval)
    if name == "heavy-lognormal":
        return traces.poisson(4.0, horizon, HEAVY, seed=seed), REAL, 0
    if name == "heavy-pareto":
        return traces.poisson(6.0, horizon, PARETO, seed=seed), REAL, 0
    if name == "tenants":
        chat = traces.diurnal(5.0, 0.6, horizon, horizon, CHAT, seed=seed)
        rag = traces.step([0.5, 1.5, 2.5, 1.0], horizon / 4, RAG, seed=seed + 1000)
        agent = traces.poisson(1.5, horizon, AGENT, seed=seed + 2000)
        return traces.merge("tenants", chat, rag, agent), replace(SYN, ttft_target=2.0, itl_target=0.05), 0
    if name == "flash":
        crowds = max(1, round(horizon / SHORT))
        return traces.flash_crowd(4.0, 4.0, horizon, crowds=crowds, seed=seed), SYN, 0
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


class LookaheadOracle:
    """A bound, not a policy: it reads the trace's future. Every decision sizes for the next start-up plus two
    intervals of the actual requests, as static-peak sizes for the whole trace (the same serving model, the
    busiest 30 s of the window), scaling up and down at once. It pays the same start-up as every policy, so
    it says what perfect foresight buys with this serving model against static-peak: what no planner
    that sees only the past can beat by much."""

    name = "oracle"

    def __init__(self, config: sm.SimConfig, trace: traces.Trace, name: str = "oracle"):
        self.cfg, self.trace, self.name = config, trace, name
        self.requests = tuple(sorted(trace.requests, key=lambda r: r.t))
        self.times = [r.t for r in self.requests]
        self.ahead = config.startup + 2 * config.interval

    def plan(self, obs, target, now: float) -> tuple[int, int]:
        lo, hi = bisect.bisect_left(self.times, now), bisect.bisect_left(self.times, now + self.ahead)
        if lo >= hi:
            return target.prefill, target.decode
        return sm.static_peak(self.cfg, traces.Trace("window", self.requests[lo:hi])).size


def run_row(args: tuple) -> list[dict]:
    """Every policy (of ``policies``; static-peak always: the ratios' baseline) on one (workload, horizon, seed)."""
    name, horizon, seed, plot_dir, trace_dir, *rest = args
    policies = rest[0] if rest else DEFAULT_POLICIES
    spare = rest[1] if len(rest) > 1 else FLEX_SPARE
    made = workload(name, horizon, seed)
    if made is None:
        return []
    trace, cfg, season = made
    first = sm.static_peak(cfg, trace.scaled(limit=2 * cfg.interval)).size
    dyn = replace(cfg, initial_prefill=first[0], initial_decode=first[1])
    peak = sm.static_peak(cfg, trace)
    rows, results = [], []
    for policy in (p for p in POLICIES if p in policies or p == "static-peak"):
        started = time.perf_counter()
        if policy == "static-peak":
            pol, c = peak, replace(cfg, initial_prefill=peak.size[0], initial_decode=peak.size[1])
        elif policy == "oracle":
            pol, c = LookaheadOracle(cfg, trace), dyn
        elif policy == "oracle-instant":
            # the look-ahead oracle whose replicas serve the moment they are asked for: what sizing by this
            # serving model reaches when capacity, not only the ratio, moves in seconds (the bound on any planner
            # with flex workers, which move the ratio alone)
            c = replace(dyn, startup=0.0, pod_startup_spread=0.0)
            pol = LookaheadOracle(c, trace, name="oracle-instant")
        elif policy == "planner-flex":
            c = dyn.with_flex(FLEX_MAX, spare=spare)
            pol = sm.make_policy(policy, c, trace, season)
        else:
            pol, c = sm.make_policy(policy, dyn, trace, season), dyn
        r = sm.simulate(trace, pol, c)
        results.append(r)
        if trace_dir is not None:  # per interval: rate, sized rate, replicas asked/ready, queues, TTFT/ITL p
            r.write(trace_dir / f"{name}-{int(horizon)}s-seed{seed}", plot=False, name=name)
        rows.append({**r.summary(), "workload": name, "horizon_s": round(min(horizon, MOONCAKE_HOUR)
                                                                          if name == "mooncake" else horizon),
                     "seed": seed, "sim_seconds": round(time.perf_counter() - started, 1)})
    if plot_dir is not None:
        sm.plot_results(results, plot_dir / f"{name}-{int(horizon)}s-seed{seed}.png")
    return rows


def summarise(rows: list[dict]) -> tuple[list[dict], dict]:
    """Per (workload, horizon): each policy's worst attainment, largest GPU-h / static-peak and mean
    goodput-per-GPU-hour / static-peak over the seeds; and the goal over every row."""
    by = {(r["workload"], r["horizon_s"], r["seed"], r["policy"]): r for r in rows}
    groups: dict[tuple[str, int], list[int]] = {}
    for (w, h, s, _p) in by:
        groups.setdefault((w, h), [])
        if s not in groups[(w, h)]:
            groups[(w, h)].append(s)
    ran = [p for p in POLICIES if any(r["policy"] == p for r in rows)]
    table = []
    for (w, h), seeds in groups.items():
        entry: dict = {"workload": w, "horizon_s": h, "seeds": len(seeds)}
        for p in ran:
            rs = [by[(w, h, s, p)] for s in seeds]
            st = [by[(w, h, s, "static-peak")] for s in seeds]
            entry[p] = {
                "attainment_min": min(r["slo_attainment"] for r in rs),
                "attainment_mean": statistics.mean(r["slo_attainment"] for r in rs),
                "gpu_h_vs_static_max": max(r["gpu_hours"] / t["gpu_hours"] for r, t in zip(rs, st)),
                "goodput_per_gpu_h_vs_static": statistics.mean(
                    r["goodput_per_gpu_hour"] / t["goodput_per_gpu_hour"] if t["goodput_per_gpu_hour"] else 0.0
                    for r, t in zip(rs, st)),
            }
        table.append(entry)
    goal = {}
    for p in ran:
        runs = [(r, by[(r["workload"], r["horizon_s"], r["seed"], "static-peak")]) for r in rows if r["policy"] == p]
        goal[p] = {
            "rows": len(runs),
            "rows_below_90pct": sorted(f"{r['workload']}/{r['horizon_s']}s/seed{r['seed']}"
                                       for r, _ in runs if r["slo_attainment"] < 0.9),
            "rows_not_below_static_gpu_h": sorted(f"{r['workload']}/{r['horizon_s']}s/seed{r['seed']}"
                                                  for r, t in runs if r["gpu_hours"] >= t["gpu_hours"]),
            "goodput_per_gpu_h_vs_static_mean": statistics.mean(
                r["goodput_per_gpu_hour"] / t["goodput_per_gpu_hour"] if t["goodput_per_gpu_hour"] else 0.0
                for r, t in runs) if runs else 0.0,
        }
    return table, goal


def markdown(table: list[dict], goal: dict) -> str:
    """The README's table: per workload and horizon, over the seeds ("-" for a policy not run)."""
    head = ("| workload | horizon | planner attainment (worst seed) | planner GPU-h / static (worst) | "
            "planner goodput/GPU-h vs static | flex planner attainment (worst) | flex planner GPU-h / static (worst) | "
            "flex planner goodput/GPU-h vs static | Dynamo-style attainment (worst) | Dynamo-style GPU-h / static | "
            "Dynamo-style goodput/GPU-h vs static | reactive attainment (worst) | static-peak attainment (worst) |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]

    def three(e: dict, p: str) -> str:
        if p not in e:
            return "- | - | -"
        x = e[p]
        return (f"{x['attainment_min']:.1%} | {x['gpu_h_vs_static_max']:.2f} | "
                f"{x['goodput_per_gpu_h_vs_static']:.2f}x")

    for e in table:
        re = f"{e['reactive']['attainment_min']:.1%}" if "reactive" in e else "-"
        lines.append(
            f"| {e['workload']} | {e['horizon_s'] / 60:.0f} min x{e['seeds']} | {three(e, 'planner')} | "
            f"{three(e, 'planner-flex')} | {three(e, 'dynamo')} | {re} | {e['static-peak']['attainment_min']:.1%} |")
    lines.append("")
    for p in ("planner", "planner-flex", "dynamo", "reactive", "oracle", "oracle-instant"):
        if p not in goal:
            continue
        g = goal[p]
        lines.append(f"- {p}: {g['rows']} rows; below 90%: {len(g['rows_below_90pct'])}; GPU-h not below "
                     f"static-peak: {len(g['rows_not_below_static_gpu_h'])}; goodput per GPU-hour vs static-peak, "
                     f"mean over rows: {g['goodput_per_gpu_h_vs_static_mean']:.2f}x")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="directory for results.json, table.md and plots (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="a smoke test: 5-minute traces, one seed, no plots")
    p.add_argument("--horizons", default=f"{SHORT:.0f},{LONG:.0f}", help="seconds, comma-separated")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seed-from", type=int, default=0, help="first seed (to split a run: seeds from .. from+seeds-1)")
    p.add_argument("--from-results", default=None,
                   help="no simulation: the table and goal over the rows of these results.json files (comma-separated)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--flex-spare", type=int, default=FLEX_SPARE,
                   help="planner-flex: flex workers kept beyond both roles' need (a pooled headroom)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="policies to run (static-peak always runs: it is every ratio's baseline); 'oracle' adds "
                        "the look-ahead bound (LookaheadOracle: it reads the trace's future), 'oracle-instant' the same with "
                        "replicas that serve the moment they are asked for")
    p.add_argument("--jobs", type=int, default=1, help="rows simulated in parallel (processes)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--traces", action="store_true",
                   help="write each policy's per-interval trace (CSV: rate, sized rate, replicas asked and ready, "
                        "queues, TTFT/ITL at the percentile, attainment, reason) under OUT/traces/")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="planner-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.from_results:  # several partial runs (horizons, seeds) -> one table
        rows = [r for f in args.from_results.split(",") for r in json.loads(Path(f).read_text())["rows"]]
        report(rows, out, plots=False, started=time.perf_counter())
        return 0
    horizons = [300.0] if args.quick else [float(h) for h in args.horizons.split(",")]
    seeds = range(0, 1) if args.quick else range(args.seed_from, args.seed_from + args.seeds)
    names = [w for w in args.workloads.split(",") if w]
    for w in names:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    plots = not (args.quick or args.no_plots)
    traced = out / "traces" if args.traces else None
    policies = tuple(x for x in args.policies.split(",") if x)
    for x in policies:
        if x not in POLICIES:
            p.error(f"unknown policy {x!r}; known: {', '.join(POLICIES)}")
    jobs = [(w, h, s, out if plots and s == 0 else None, traced, policies, args.flex_spare) for h in horizons
            for w in names for s in seeds]
    started = time.perf_counter()
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            parts = pool.map(run_row, jobs, chunksize=1)
    else:
        parts = [run_row(j) for j in jobs]
    report([r for part in parts for r in part], out, plots, started)
    return 0


def report(rows: list[dict], out: Path, plots: bool, started: float) -> None:
    table, goal = summarise(rows)
    (out / "results.json").write_text(json.dumps({"rows": rows, "table": table, "goal": goal}, indent=2) + "\n")
    md = markdown(table, goal)
    (out / "table.md").write_text(md)
    print(f"{'workload':16} {'horizon':>7} {'seed':>4} {'policy':12} {'attain':>7} {'TTFT ok':>7} {'ITL ok':>7} "
          f"{'p90 TTFT':>9} {'p90 ITL':>8} {'GPU-h':>7} {'good/GPU-h':>10} {'GPU-h/static':>12}")
    static = {(r["workload"], r["horizon_s"], r["seed"]): r for r in rows if r["policy"] == "static-peak"}
    for r in rows:
        st = static[(r["workload"], r["horizon_s"], r["seed"])]
        print(f"{r['workload']:16} {r['horizon_s']:7} {r['seed']:4} {r['policy']:12} {r['slo_attainment']:7.1%} "
              f"{r['ttft_attainment']:7.1%} {r['itl_attainment']:7.1%} {r['ttft_p_s'] or 0:9.2f} "
              f"{r['itl_p_s'] or 0:8.3f} {r['gpu_hours']:7.2f} {r['goodput_per_gpu_hour']:10.0f} "
              f"{r['gpu_hours'] / st['gpu_hours']:12.2f}")
    print()
    print(md)
    print(f"{len(rows)} rows in {time.perf_counter() - started:.0f} s; results.json, table.md"
          f"{' and plots' if plots else ''} in {out}")


if __name__ == "__main__":
    sys.exit(main())
