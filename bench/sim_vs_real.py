"""The simulator against the real engines: the same trace through a real CPU prefill/decode pair and
through `disagg simulate`'s simulator driven by a `disagg profile` of those same workers.

What runs (no GPU, the tiny test model):

1. `disagg serve --local`'s processes: a CPU vLLM prefill worker (core 0) and a decode worker (core 1)
   with NIXL between them, and the router in front (disaggregation always);
2. `disagg profile` against each worker on its own (prefill points from the prefill worker, decode
   points from the decode worker), written to two profile files; the prefill worker's profile also
   times lone requests through the router (``--path-url``): the P/D hand-off, which the serving model
   charges each request between its prefill and its first decode step;
3. a few minutes of the Mooncake conversation trace (../shared/traces), scaled down so two one-core
   engines serve it without unbounded queueing: prompt lengths / ``--in-scale``, output lengths /
   ``--out-scale`` (clipped to the workers' 1024-token context), the request rate set so the profile
   predicts ``--load`` utilisation of the whole P/D path (a request's prefill, hand-off and first decode
   step as one server's time: on this host the hand-off is CPU work of processes sharing the two cores)
   and at most ``--decode-concurrency`` requests decoding at once; random token ids (no prefix sharing: the
   simulator's prefix cache and vLLM's are both idle, so neither is judged here);
4. the trace replayed open-loop (each request sent at its arrival time, streaming, ``ignore_eos``)
   through the router, TTFT and ITL measured by the client; ``--arrivals``: with the trace's own arrival
   times (the Mooncake trace logs its requests in bursts, ~10 at one instant every few seconds), and/or with
   each burst spread evenly over the time to the next one (same requests, same mean rate);
5. the two workers profiled again after the replays, the same way (this host's speed drifts within minutes);
6. the same trace through :class:`disagg.simulator.simulate.Simulation` with one prefill and one decode
   replica (a static policy), its performance model fitted to both profiles' points (and, to show the
   drift, to each profile alone).

Printed, per replay: TTFT and ITL p50/p90, real, simulated and simulated / real, and whether each is
within 20%; the TTFT p50 by a request's position in its burst, real and simulated (where queueing behind a
burst goes);
and the p50s of ``--unloaded`` requests of the trace sent one at a time (rows "alone"), which separate
the profile's shape and the path's fixed costs from queueing. For the lone requests and for the replay,
the mean TTFT as each component's own histogram saw it (router; prefill engine and decode engine, each
from arrival there to its first token) and the decode worker's mean NIXL transfer time.
TTFT is arrival to the first token; ITL is a request's mean time between its output tokens (the
simulator's definitions).

    nice -n 19 .venv/bin/python bench/sim_vs_real.py [--minutes 3] [--load 0.5] [--json out.json]

CPU contention: the workers share this machine's cores with whatever else runs; the profile is
measured minutes before the replay, so load that changes in between moves the real figures and not
the simulated ones. The load average before and after is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from pd_path_timing import cpu_times   # this directory's: CPU seconds of every process of the pair and router
from disagg.perf import model as perfmodel
from disagg.perf import serving
from disagg.perf.profile import mean_itl, stream_tokens
from disagg.simulator import traces
from disagg.simulator.simulate import SimConfig, Simulation, StaticPolicy, _pct
from disagg.workers.envpath import worker_python
from disagg.api.metrics import ROUTER_TTFT_SECONDS, VLLM_NIXL_XFER_TIME_SECONDS, VLLM_TTFT_SECONDS
from disagg.workers.local import free_port, metric_sum, pd_processes, scrape, start_pd, stop_all
from disagg.workers.tinymodel import ensure

REPO = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 1024        # workers.local.cpu_settings
MAX_NUM_SEQS = 64           # workers.local.cpu_settings' --max-num-seqs
TOLERANCE = 0.20


def profile_worker(url: str, out: Path, role: str, path_url: str | None = None) -> perfmodel.Profile:
    """`disagg profile` (the CLI, as a user runs it) against one worker (and, with ``path_url``, lone
    requests through the router: the hand-off)."""
    exe = shutil.which("disagg", path=str(Path(sys.executable).parent)) or "disagg"
    args = [exe, "profile", "--url", url, "--model", "tiny", "--vocab", "500", "--out", str(out),
            "--repeats", "3"]   # medians: one sample on this shared machine can be off by a factor
    if role == "prefill":   # prompts up to what the trace sends; decode points are not used from here
        args += ["--prompt-tokens", "32,256,768", "--batches", "1,3", "--concurrency", "1,2,4",
                 "--context", "64", "--decode-tokens", "8"]
        if path_url:
            args += ["--path-url", path_url]
    else:                   # concurrencies the replay reaches; prefill points are not used from here
        args += ["--prompt-tokens", "32,64,128", "--batches", "1", "--concurrency", "1,2,4,8,16",
                 "--context", "192", "--decode-tokens", "48"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    if run.returncode:
        raise RuntimeError(f"disagg profile {role} failed:\n{run.stderr[-3000:]}")
    print(f"  {role}: {run.stdout.strip()}", flush=True)
    return perfmodel.Profile.load(out)


def scaled_trace(minutes: float, in_scale: float, out_scale: float, start: float) -> traces.Trace:
    """The Mooncake trace from ``start`` s, lengths scaled down and clipped to the workers' context."""
    full = traces.real(REPO)
    reqs = []
    for r in full.requests:
        if r.t < start:
            continue
        out = min(max(round(r.output_tokens / out_scale), 2), 128)
        inp = min(max(round(r.input_tokens / in_scale), 8), MAX_MODEL_LEN - out - 8)
        reqs.append(traces.Request(r.t - start, inp, out, None, ()))
    return traces.Trace("mooncake-scaled", tuple(reqs))


def with_rate(trace: traces.Trace, rate: float, seconds: float) -> traces.Trace:
    k = rate / (len(trace.requests) / trace.duration)
    return trace.scaled(rate=k, limit=seconds)


class ProfiledConfig(SimConfig):
    """A SimConfig whose performance models are the measured profiles (the simulator asks
    ``planning_models()`` for them); the shape is the tiny model's own config.json, the
    hardware entry only gives the physical floors, far below these CPU timings."""

    def with_models(self, prefill: perfmodel.PerfModel, decode: perfmodel.PerfModel) -> ProfiledConfig:
        object.__setattr__(self, "_models", (prefill, decode))
        return self

    def planning_models(self):
        return self._models


def role_models(model_dir: str, prefill: perfmodel.Profile,
                decode: perfmodel.Profile) -> tuple[perfmodel.PerfModel, perfmodel.PerfModel]:
    """The planner's performance models of the two workers: the tiny model's shape, each profile."""
    shape = perfmodel.model_from_config(model_dir, "tiny")
    shape = replace(shape, dtype_bytes=4)   # the CPU workers run float32
    # a same-host link: NIXL over UCX/TCP on loopback
    base = perfmodel.PerfModel(shape, perfmodel.gpu("L40S"), 1, perfmodel.interconnect("tcp-25g"))
    return replace(base, profile=prefill), replace(base, profile=decode)


def merged(a: perfmodel.Profile, b: perfmodel.Profile) -> perfmodel.Profile:
    """One profile fitted to both profiles' points (the same worker measured twice)."""
    return perfmodel.Profile(a.model, a.gpu, a.tensor_parallel_size, a.prefill + b.prefill, a.decode + b.decode,
                             a.handoff + b.handoff)


def path_seconds(models: tuple[perfmodel.PerfModel, perfmodel.PerfModel], tokens: int) -> float:
    """A lone request's TTFT through the P/D path as the serving model charges it: prefill, hand-off,
    decode's first step."""
    pre, dec = models
    return pre.ttft(tokens) + serving.kv_transfer_time(pre, tokens, dec.tp) + dec.decode_step_time(1, tokens)


class _Recording(Simulation):
    """The simulator as it is, also keeping each request's TTFT by its arrival time (the burst table)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.by_arrival: list[tuple[float, float]] = []

    def _ttft(self, a) -> None:
        super()._ttft(a)
        self.by_arrival.append((a.r.t, a.first - a.r.t))


def simulate(trace: traces.Trace, models: tuple[perfmodel.PerfModel, perfmodel.PerfModel],
             max_batch_tokens: int) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    cfg = ProfiledConfig(model="tiny", gpu="L40S", ttft_target=1e9, itl_target=1e9, interval=60.0,
                         startup=0.0, max_batch_tokens=max_batch_tokens, max_num_seqs=MAX_NUM_SEQS,
                         drain_limit=3600.0)
    cfg.with_models(*models)
    sim = _Recording(cfg, trace, StaticPolicy(1, 1))
    res = sim.run()
    return res.ttft, res.itl, sorted(sim.by_arrival)


def spread(trace: traces.Trace) -> traces.Trace:
    """The trace with each burst (requests logged at the same instant: the Mooncake trace logs its
    arrivals in clumps of ~10 every few seconds) spread evenly over the time to the next burst, in
    the trace's order: the same requests at the same mean rate without the simultaneous arrivals."""
    reqs = list(trace.requests)
    out, i = [], 0
    while i < len(reqs):
        j = i
        while j < len(reqs) and reqs[j].t == reqs[i].t:
            j += 1
        end = reqs[j].t if j < len(reqs) else reqs[i].t + (reqs[i].t - reqs[0].t) / max(len(out), 1) * (j - i)
        for k in range(i, j):
            out.append(replace(reqs[k], t=reqs[i].t + (end - reqs[i].t) * (k - i) / (j - i)))
        i = j
    return traces.Trace(trace.name + "-spread", tuple(out))


def by_position(arrivals: list[tuple[float, float]], positions: tuple[int, ...] = (0, 1, 3, 6, 9)) -> dict[int, float]:
    """Median TTFT of the requests at each position in their burst (0: the fastest of the requests that
    arrived at the same instant, 1 the next, ...): queueing behind a burst shows as a rise with it."""
    ranks, last, k = {}, None, 0
    for t, v in sorted(arrivals):
        k = k + 1 if t == last else 0
        last = t
        ranks.setdefault(k, []).append(v)
    return {p: _pct(ranks[p], 50) for p in positions if p in ranks}


def _send(url: str, prompt: list[int], max_tokens: int, sent: float, out: list, i: int) -> None:
    begin = time.perf_counter()
    try:
        times, tokens = stream_tokens(url, "tiny", prompt, max_tokens, 600.0)
    except Exception as e:  # noqa: BLE001 - a failed request is reported, not fatal
        out[i] = ("error", repr(e))
        return
    out[i] = ("ok", begin - sent, times, tokens)


def unloaded(url: str, trace: traces.Trace, n: int, gap: float = 120.0) -> tuple[traces.Trace, list, list]:
    """``n`` of the trace's requests one at a time (closed loop: nothing queues), and the same requests
    as a trace whose arrivals are ``gap`` s apart for the simulator: the profile's shape and the
    path's fixed costs, without queueing."""
    picked = sorted(trace.requests, key=lambda r: r.input_tokens)[:: max(len(trace.requests) // n, 1)][:n]
    ttft, itl = [], []
    for i, r in enumerate(picked):
        t, it, _ = replay(url, traces.Trace("one", (traces.Request(0.0, r.input_tokens, r.output_tokens, None, ()),)),
                          seed=100 + i)
        ttft += t
        itl += it
    return (traces.Trace("unloaded", tuple(traces.Request(i * gap, r.input_tokens, r.output_tokens, None, ())
                                            for i, r in enumerate(picked))), ttft, itl)


def replay(url: str, trace: traces.Trace, seed: int = 0,
           arrivals: list[tuple[float, float]] | None = None) -> tuple[list[float], list[float], int]:
    """Open loop: each request at its arrival time; TTFT from the scheduled arrival (so a late send
    counts against the real system, as a queue would)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 500) for _ in range(r.input_tokens)] for r in trace.requests]
    results: list = [None] * len(trace.requests)
    threads = []
    t0 = time.perf_counter() + 1.0
    for i, r in enumerate(trace.requests):
        delay = t0 + r.t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=_send, args=(url, prompts[i], r.output_tokens, t0 + r.t, results, i),
                              daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    ttft, itl, errors, one_chunk = [], [], 0, 0
    for r, res in zip(trace.requests, results):
        if res is None or res[0] != "ok":
            errors += 1
            print(f"  request failed: {res[1] if res else 'no answer'}", file=sys.stderr, flush=True)
            continue
        _, late, times, tokens = res
        ttft.append(late + times[0])   # from the scheduled arrival: a late send counts as queueing
        if arrivals is not None:
            arrivals.append((r.t, ttft[-1]))
        v = mean_itl(times, tokens)
        if v is None:
            # every token in one chunk (a lagging frontend merges them): its TTFT counts, its ITL is unknown
            one_chunk += 1
            continue
        itl.append(v)
    if one_chunk:
        print(f"  {one_chunk} of {len(results)} streams came in one chunk (TTFT kept, no ITL)", flush=True)
    return ttft, itl, errors


def ttft_totals(procs) -> dict[str, tuple[float, float]]:
    """(sum, count) of the router's TTFT histogram, each engine's own (arrival at that engine to its
    first token) and the decode worker's NIXL transfer times: differences over a phase split the
    client's TTFT by where it was spent."""
    out = {}
    for key, p, name in (("router", procs[2], ROUTER_TTFT_SECONDS), ("prefill engine", procs[0], VLLM_TTFT_SECONDS),
                         ("decode engine", procs[1], VLLM_TTFT_SECONDS),
                         ("KV pull (NIXL)", procs[1], VLLM_NIXL_XFER_TIME_SECONDS)):
        m = scrape(p.url)
        out[key] = (metric_sum(m, name + "_sum"), metric_sum(m, name + "_count"))
    return out


def ttft_split(before: dict, after: dict, client: list[float]) -> tuple[dict[str, float], str]:
    means = {k: (after[k][0] - before[k][0]) / max(after[k][1] - before[k][1], 1) for k in after}
    text = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in means.items())
    return means, (f"mean TTFT: client {sum(client) / max(len(client), 1) * 1000:.1f} ms; as each saw it: {text} "
                   f"(an engine's: arrival there to its first token; NIXL: per transfer)")


def engine_max_batch_tokens(log: Path) -> int:
    """vLLM's max_num_batched_tokens as the prefill worker logged it (its scheduler's token budget)."""
    import re

    m = re.findall(r"max_num_batched_tokens=(\d+)", log.read_text(errors="replace"))
    return int(m[-1]) if m else 2048


def table(real: dict[str, list[float]], sim: dict[str, list[float]], label: str = "",
          percentiles: tuple[int, ...] = (50, 90)) -> list[dict]:
    rows = []
    for metric in ("ttft", "itl"):
        for p in percentiles:
            r, s = _pct(real[metric], p), _pct(sim[metric], p)
            ratio = s / r if r else math.nan
            rows.append({"metric": f"{metric.upper()} p{p}{label}", "real_ms": r * 1000, "sim_ms": s * 1000,
                         "ratio": ratio, "within": abs(ratio - 1) <= TOLERANCE})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--load", type=float, default=0.5, help="utilisation of the P/D path (prefill + hand-off + first decode step) the profile predicts")
    ap.add_argument("--decode-concurrency", type=float, default=8.0,
                    help="mean requests decoding at once the rate is held to (Little's law on the profile)")
    ap.add_argument("--in-scale", type=float, default=32.0, help="prompt lengths divided by this")
    ap.add_argument("--out-scale", type=float, default=8.0, help="output lengths divided by this")
    ap.add_argument("--start", type=float, default=600.0, help="trace offset in seconds")
    ap.add_argument("--unloaded", type=int, default=8,
                    help="requests of the trace also sent one at a time (rows '... alone': no queueing)")
    ap.add_argument("--arrivals", default="trace,spread",
                    help="replays, in order: 'trace' (the trace's own arrival times: bursts of ~10 at one "
                         "instant) and/or 'spread' (each burst spread evenly to the next)")
    ap.add_argument("--json", help="write the rows and settings here")
    ap.add_argument("--keep", help="keep logs and profiles in this directory")
    args = ap.parse_args()

    python = worker_python()
    model = str(ensure(python))
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="sim-vs-real-"))
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = pd_processes(model, port, python, work)
    load_before = os.getloadavg()
    try:
        print(f"starting prefill, decode, router (logs in {work}) ...", flush=True)
        start_pd(procs, engine_timeout=900)
        # warm the path (first NIXL handshake, compiled shapes, the engines' first minute) before anything
        # is timed through it: 40 requests, 16-800 tokens, over 20 s
        print("warming the path ...", flush=True)
        warm = traces.Trace("warm", tuple(traces.Request(i * 0.5, 16 + (i * 97) % 785, 8 + i % 24, None, ())
                                          for i in range(40)))
        replay(procs[2].url, warm, seed=1)
        print("profiling the workers (disagg profile) ...", flush=True)
        pre = profile_worker(procs[0].url, work / "prefill-profile.yaml", "prefill", procs[2].url)
        dec = profile_worker(procs[1].url, work / "decode-profile.yaml", "decode")
        models = role_models(model, pre, dec)   # the rate is set from this one (the replays have not run)

        base = scaled_trace(args.minutes, args.in_scale, args.out_scale, args.start)
        ins = [r.input_tokens for r in base.requests]
        # the whole path's capacity: a request's prefill, hand-off and first decode step as one server's
        mean_path = sum(path_seconds(models, n) for n in ins) / len(ins)
        # and at most --decode-concurrency requests decoding at once on average (Little's law at the
        # profile's step time for that batch): past its knee a one-core decode queues without bound
        outs = [r.output_tokens for r in base.requests]
        c, ctx = args.decode_concurrency, sum(ins) / len(ins) + sum(outs) / len(outs) / 2
        decode_rate = c / (sum(outs) / len(outs) * dec.decode_seconds(c, c * ctx))
        rate = min(args.load / mean_path, decode_rate)
        trace = with_rate(base, rate, args.minutes * 60.0)
        n = len(trace.requests)
        print(f"trace: {n} requests over {trace.duration:.0f} s ({n / trace.duration:.2f}/s; the path takes "
              f"{mean_path * 1000:.1f} ms a request, decode allows {decode_rate:.2f}/s), prompt "
              f"p50/p90 {_pct(ins, 50):.0f}/{_pct(ins, 90):.0f} tokens, output p50 "
              f"{_pct([r.output_tokens for r in trace.requests], 50):.0f}", flush=True)

        print("one request at a time ...", flush=True)
        before = ttft_totals(procs)
        alone, alone_ttft, alone_itl = unloaded(procs[2].url, trace, args.unloaded)
        alone_means, text = ttft_split(before, ttft_totals(procs), alone_ttft)
        sim_alone = [path_seconds(models, r.input_tokens) for r in alone.requests]
        print(f"  {text}; the model charges {sum(sim_alone) / len(sim_alone) * 1000:.1f} ms "
              f"(hand-off {1000 * sum(serving.kv_transfer_time(models[0], r.input_tokens) for r in alone.requests) / len(sim_alone):.1f} ms)",
              flush=True)
        replays = {}
        for mode in args.arrivals.split(","):
            t_mode = spread(trace) if mode == "spread" else trace
            print(f"replaying through the router (arrivals: {mode}) ...", flush=True)
            t = time.perf_counter()
            before, cpu_before, own_before = ttft_totals(procs), cpu_times(procs), sum(os.times()[:2])
            arrivals: list[tuple[float, float]] = []
            real_ttft, real_itl, errors = replay(procs[2].url, t_mode, arrivals=arrivals)
            after, cpu_after, own = ttft_totals(procs), cpu_times(procs), sum(os.times()[:2]) - own_before
            served = sum(cpu_after.values()) - sum(cpu_before.get(k, 0.0) for k in cpu_after)
            wall = time.perf_counter() - t
            print(f"  done in {wall:.0f} s, {errors} failed; CPU per request: {served / len(t_mode.requests) * 1000:.0f} ms "
                  f"in the engines, frontends and router, {own / len(t_mode.requests) * 1000:.0f} ms in this client "
                  f"({(served + own) / wall / (os.cpu_count() or 1) * 100:.0f}% of the machine's {os.cpu_count()} "
                  f"cores over the replay)", flush=True)
            means, text = ttft_split(before, after, real_ttft)
            print(f"  {text}", flush=True)
            replays[mode] = (t_mode, real_ttft, real_itl, errors, arrivals, means)
        # the same workers profiled again after the replays: this host's speed drifts within minutes (two
        # runs' profiles 2026-12-04: hand-off 5.8 and 41.4 ms, decode step 4.3 and 8.7 ms), so the
        # simulator is driven by both profiles' points in one fit, and by each alone to show the drift
        print("profiling the workers again ...", flush=True)
        pre_after = profile_worker(procs[0].url, work / "prefill-profile-after.yaml", "prefill", procs[2].url)
        dec_after = profile_worker(procs[1].url, work / "decode-profile-after.yaml", "decode")
        mbt = engine_max_batch_tokens(procs[0].log_path)
    finally:
        stop_all(procs)
    profiles = {"before": (pre, dec), "after": (pre_after, dec_after),
                "both": (merged(pre, pre_after), merged(dec, dec_after))}
    models = role_models(model, *profiles["both"])
    load_after = os.getloadavg()

    print(f"\nsimulator (profile of these workers, max_batch_tokens {mbt}) vs the real CPU P/D pair; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    a_ttft, a_itl, _ = simulate(alone, models, mbt)
    alone_rows = table({"ttft": alone_ttft, "itl": alone_itl}, {"ttft": a_ttft, "itl": a_itl}, " alone", (50,))
    report = {"requests": n, "rate": n / trace.duration, "max_batch_tokens": mbt, "alone_ttft_seen_by": alone_means,
              "load_before": load_before, "load_after": load_after,
              "profiles": {k: {"prefill": p.to_dict(), "decode": d.to_dict()} for k, (p, d) in profiles.items()
                           if k != "both"},
              "handoff_ms": {k: p.handoff_base * 1000 for k, (p, _) in profiles.items() if p.handoff_base is not None},
              "replays": {}}
    for mode, (t_mode, real_ttft, real_itl, errors, arrivals, means) in replays.items():
        sim_ttft, sim_itl, sim_arrivals = simulate(t_mode, models, mbt)
        rows = table({"ttft": real_ttft, "itl": real_itl}, {"ttft": sim_ttft, "itl": sim_itl})
        if mode == "trace":
            rows += alone_rows
        print(f"\narrivals: {mode}, {len(real_ttft)} requests")
        print(f"{'metric':<16}{'real ms':>10}{'sim ms':>10}{'sim/real':>10}  within 20%")
        for r in rows:
            print(f"{r['metric']:<16}{r['real_ms']:>10.1f}{r['sim_ms']:>10.1f}{r['ratio']:>10.2f}  "
                  f"{'yes' if r['within'] else 'NO'}")
        drift = {}
        for label in ("before", "after"):
            d_ttft, d_itl, _ = simulate(t_mode, role_models(model, *profiles[label]), mbt)
            drift[label] = {"ttft_p50": _pct(d_ttft, 50) / _pct(real_ttft, 50), "itl_p50": _pct(d_itl, 50) / _pct(real_itl, 50)}
        print("  sim / real with one profile alone: " + "; ".join(
            f"{k}: TTFT p50 {v['ttft_p50']:.2f}, ITL p50 {v['itl_p50']:.2f}" for k, v in drift.items()))
        real_pos, sim_pos = by_position(arrivals), by_position(sim_arrivals)
        print("TTFT p50 by position in its burst (requests that arrived at the same instant, fastest first), "
              "real / sim ms: " + ", ".join(f"#{k} {real_pos[k] * 1000:.0f} / {sim_pos.get(k, math.nan) * 1000:.0f}"
                                            for k in real_pos))
        report["replays"][mode] = {"rows": rows, "errors": errors, "mean_ttft_seen_by": means, "one_profile": drift,
                                   "ttft_by_position": {"real": real_pos, "sim": sim_pos}}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
